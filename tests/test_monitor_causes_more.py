"""What the Monitor's rules say about zero gradients, named by what happened.

Three families, each tried member by member on a plain model and under
torch.compile (DDP and torch.distributed.pipelining on a 2-rank gloo world:
test_monitor_causes_more_distributed.py):

- float16 underflow where the weights are float32: autocast to float16
  without a GradScaler that scales (monitor/precision.py);
- gradients that are zero in exact arithmetic by the model's structure
  (monitor/structural.py), and the genuinely vanishing gradients that must
  still warn;
- explanations that name the call that ran: clip_grad_value_ against
  clip_grad_norm_ (monitor/whole_model.py), a cut at a pipeline stage
  boundary, an auxiliary loss computed but left out of the loss
  (monitor/kept.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import fresh_seed, serious
from zeroscan import Monitor, Report, Severity, Thresholds
from zeroscan.monitor import GLOBAL_NAME, Finding

STEPS = 3
Batch = Callable[[], tuple[torch.Tensor, ...]]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def fit(
    model: nn.Module,
    batch: Batch,
    loss_of: Callable[..., torch.Tensor],
    *,
    steps: int = STEPS,
    lr: float = 0.1,
    target: nn.Module | None = None,
    after_backward: Callable[[nn.Module], None] | None = None,
    scaler: torch.amp.GradScaler | None = None,
    thresholds: Thresholds | None = None,
) -> Report:
    """`steps` SGD steps under a Monitor on `target` (default: the model);
    `after_backward` runs between backward() and the step, `scaler` (if
    any) scales the loss and runs the step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with Monitor(target if target is not None else model, opt, thresholds=thresholds) as monitor:
        for _ in range(steps):
            opt.zero_grad()
            loss = loss_of(model, *batch())
            if scaler is None:
                loss.backward()
            else:
                scaler.scale(loss).backward()
            if after_backward is not None:
                after_backward(model)
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
    return monitor.report()


def short(name: str) -> str:
    return name.removeprefix("_orig_mod.")


def detailed(report: Report, cause: str) -> list[Finding]:
    """Each tensor's own finding of `cause` (see Report.detailed)."""
    return [f for f in report.detailed if f.cause == cause]


def generator() -> torch.Generator:
    g = torch.Generator().manual_seed(fresh_seed(2**31))
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=g)))  # model init
    return g


# ---- 8. float16 underflow where the weights are float32 -------------------------------


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def convnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3), nn.Tanh(), nn.Flatten(), nn.Linear(16 * 6 * 6, 1))


class PartlyHalf(nn.Module):
    """Only the first layer runs under float16 autocast, inside the model's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(32, 64)
        self.rest = nn.Sequential(nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            h = self.first(x)
        return self.rest(h.float())


def features(g: torch.Generator) -> Batch:
    """Features from 1e-4 to 1e2: the small ones give float16 gradients below its subnormals."""
    return lambda: (torch.randn(16, 32, generator=g) * torch.logspace(-4, 2, 32),)


def images(g: torch.Generator) -> Batch:
    return lambda: (torch.randn(16, 3, 8, 8, generator=g) * torch.logspace(-4, 2, 8),)


def small_loss(scale: float, dtype: torch.dtype | None) -> Callable[..., torch.Tensor]:
    """A loss `scale` times the mean square output, the forward pass under
    autocast to `dtype` (None: the model autocasts itself, or not)."""

    def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if dtype is None:
            return model(x).float().square().mean() * scale
        with torch.autocast("cpu", dtype=dtype):
            return model(x).float().square().mean() * scale

    return loss_of


# member -> (model, batch, loss scale, autocast around the forward pass, GradScaler(enabled=...) or None)
AMP_MEMBERS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], Batch], float, bool, bool | None]] = {
    "linear": (mlp, features, 1e-5, True, None),  # the example
    "conv": (convnet, images, 3e-6, True, None),  # unnamed: the zeros are in a convolution
    "autocast_inside": (PartlyHalf, features, 1e-5, False, None),  # unnamed: only part of forward is float16
    "scaler_disabled": (mlp, features, 1e-5, True, False),  # unnamed: GradScaler(enabled=False)
}


def compiled_if(model: nn.Module, compiled: bool) -> nn.Module:
    """The model, or (compiled) the model under torch.compile's aot_eager backend after a dynamo reset."""
    if not compiled:
        return model
    torch._dynamo.reset()
    return torch.compile(model, backend="aot_eager")


def amp_report(member: str, compiled: bool = False) -> Report:
    make, batch, scale, around, scaler = AMP_MEMBERS[member]
    g = generator()
    model = compiled_if(make(), compiled)
    grad_scaler = None if scaler is None else torch.amp.GradScaler("cpu", enabled=scaler)
    # Four steps: a gradient zero everywhere warns once it lasts three (Thresholds.zero_window).
    return fit(model, batch(g), small_loss(scale, torch.float16 if around else None), steps=4, scaler=grad_scaler)


def assert_named_fp16_underflow(report: Report, says: str) -> None:
    """float16 underflow and its fixes are named; no mask, no plain zero finding."""
    found = detailed(report, "underflow")
    assert any(f.severity == Severity.WARNING for f in found), report.format(verbose=True)
    for f in found:  # a gradient zero everywhere that has not lasted is INFO (a design that starts at zero)
        assert "underflowed to zero in float16" in f.message and "GradScaler" in f.message, str(report)
        assert "bfloat16" in f.message and says in f.message, str(report)
    assert not detailed(report, "mostly_zero") and not detailed(report, "exact_zero"), report.format(verbose=True)
    assert "mask" not in str(report)


FP16_WORDS = {
    "linear": "torch.autocast(dtype=torch.float16)",
    "conv": "torch.autocast(dtype=torch.float16)",
    "autocast_inside": "first (a torch.autocast(dtype=torch.float16) region there",
    "scaler_disabled": "enabled=False",
}


@pytest.mark.parametrize("member", list(AMP_MEMBERS))
def test_float16_underflow_into_float32_weights_is_named(member: str) -> None:
    assert_named_fp16_underflow(amp_report(member), FP16_WORDS[member])


# member -> the parameters whose gradients backward computes in float16 (any of them may underflow)
FP16_PARAMS = {
    "linear": {f"{layer}.{kind}" for layer in (0, 2, 4) for kind in ("weight", "bias")},
    "autocast_inside": {"first.weight", "first.bias"},
}


@pytest.mark.parametrize("member", list(FP16_PARAMS))
def test_float16_underflow_is_named_under_torch_compile(member: str) -> None:
    """The probed forward pass runs eagerly, so the float16 ops are seen in compiled code too."""
    report = amp_report(member, compiled=True)
    assert_named_fp16_underflow(report, FP16_WORDS[member])
    assert {short(f.name) for f in detailed(report, "underflow")} <= FP16_PARAMS[member], str(report)


@pytest.mark.parametrize("how", ["bfloat16", "float16_with_scaler"])
def test_bfloat16_and_a_scaling_gradscaler_get_no_underflow(how: str) -> None:
    """The same model, batch and loss: bfloat16 keeps float32's range, and a
    GradScaler that scales keeps the float16 gradients above its subnormals."""
    g = generator()
    scaler = torch.amp.GradScaler("cpu") if how == "float16_with_scaler" else None
    dtype = torch.bfloat16 if how == "bfloat16" else torch.float16
    report = fit(mlp(), features(g), small_loss(1e-5, dtype), scaler=scaler)
    assert not detailed(report, "underflow"), str(report)
    assert not detailed(report, "mostly_zero") and not detailed(report, "exact_zero"), str(report)


# ---- 9. gradients that are zero by structure ------------------------------------------


class Attention(nn.Module):
    """Single-head attention with separate query, key and value projections (BERT, ViT, CLIP)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        self.value = nn.Linear(width, width)
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query(x), self.key(x), self.value(x)
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        return self.out(weights @ v).mean(1)


class ConvNorm(nn.Module):
    """A convolution with a bias right before a norm layer."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.norm = norm
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.conv(x))).mean((2, 3)))


class ShiftedLogits(nn.Module):
    """A learned constant added to every logit of a row, before the model's own LogSoftmax."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 10)
        self.shift = nn.Parameter(torch.ones(1))
        self.log_probs = nn.LogSoftmax(dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.log_probs(self.proj(x) + self.shift)


def squared(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def nll(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(model(x), y)


def tokens(g: torch.Generator) -> Batch:
    return lambda: (torch.randn(4, 10, 32, generator=g),)


def pictures(g: torch.Generator) -> Batch:
    return lambda: (torch.randn(4, 3, 8, 8, generator=g),)


def rows(g: torch.Generator) -> Batch:
    return lambda: (torch.randn(32, 16, generator=g), torch.randint(0, 10, (32,), generator=g))


# member -> (model, batch, loss, the parameter whose gradient is zero by structure, the op named)
STRUCTURAL: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], Batch], Callable[..., torch.Tensor],
                            str, str]] = {
    "key_bias": (Attention, tokens, squared, "key.bias", "softmax"),  # the issue's
    "bias_before_batch_norm": (lambda: ConvNorm(nn.BatchNorm2d(8)), pictures, squared, "conv.bias", "batch norm"),
    # unnamed: a conv bias before InstanceNorm (it subtracts each sample's channel mean)
    "bias_before_instance_norm": (
        lambda: ConvNorm(nn.InstanceNorm2d(8, affine=True)), pictures, squared, "conv.bias", "batch norm"),
    # unnamed: a per-row constant before log_softmax
    "shift_before_log_softmax": (ShiftedLogits, rows, nll, "shift", "log_softmax"),
}


def structural_report(
    member: str,
    compiled: bool = False,
    steps: int = 4,
    lr: float = 1e-3,
    after_backward: Callable[[nn.Module], None] | None = None,
    thresholds: Thresholds | None = None,
) -> Report:
    make, batch, loss_of, _, _ = STRUCTURAL[member]
    g = generator()
    model = compiled_if(make(), compiled)
    return fit(model, batch(g), loss_of, steps=steps, lr=lr, after_backward=after_backward, thresholds=thresholds)


def cancel_at_last_step(name: str, share: float, steps: int) -> Callable[[nn.Module], None]:
    """An after_backward that, at the last of `steps`, sets the first `share`
    of the gradient of `name` to exactly zero, as a sum that cancels exactly
    leaves it (a one-element shift does so at some seeds)."""
    seen = [0]

    def cancel(model: nn.Module) -> None:
        seen[0] += 1
        if seen[0] == steps:
            inner = getattr(model, "_orig_mod", model)  # under torch.compile
            inner = inner.module if isinstance(inner, nn.parallel.DistributedDataParallel) else inner
            grad = inner.get_parameter(name).grad.view(-1)
            grad[: max(1, math.ceil(share * grad.numel()))] = 0

    return cancel


def assert_explained_once_as_info(report: Report, member: str) -> None:
    _, _, _, name, op = STRUCTURAL[member]
    assert serious(report) == [], str(report)  # a healthy model: no warning at any report
    (f,) = [f for f in report.findings if f.cause == "zero_by_structure"]
    assert f.severity == Severity.INFO and short(f.name) == name, str(report)
    assert "zero in exact arithmetic by the model's structure" in f.message and op in f.message, str(report)
    assert not detailed(report, "vanishing")


@pytest.mark.parametrize("member", list(STRUCTURAL))
def test_a_gradient_zero_by_structure_is_explained_once_as_info(member: str) -> None:
    assert_explained_once_as_info(structural_report(member), member)


@pytest.mark.parametrize("share", [1.0, 0.95])
@pytest.mark.parametrize("member", list(STRUCTURAL))
def test_rounding_noise_that_cancels_exactly_at_one_step_stays_zero_by_structure(member: str, share: float) -> None:
    """All or most of the noise cancels to exactly 0 at the latest step:
    still the structure's INFO, never an exact_zero or mostly_zero finding."""
    name = STRUCTURAL[member][3]
    assert_explained_once_as_info(structural_report(member, after_backward=cancel_at_last_step(name, share, 4)), member)


@pytest.mark.parametrize("member", list(STRUCTURAL))
def test_a_gradient_that_trains_and_then_is_zero_is_not_called_structure(member: str) -> None:
    """The counterpart: a neighbour (its gradient of the terms' size before)
    exactly zero at the latest step is an exact_zero finding of its own."""
    make, _, _, name, _ = STRUCTURAL[member]
    neighbour = next(n for n, _ in make().named_parameters() if n != name and n.endswith(("weight", "bias")))
    report = structural_report(member, after_backward=cancel_at_last_step(neighbour, 1.0, 4))
    assert [short(f.name) for f in detailed(report, "exact_zero")] == [neighbour], str(report)
    assert neighbour not in [short(n) for f in report.findings if f.cause == "zero_by_structure" for n in f.names]


@pytest.mark.parametrize("member", list(STRUCTURAL))
def test_a_first_gradient_that_is_exactly_zero_is_not_called_structure(member: str) -> None:
    """No gradient before the latest step (set to None), exactly zero at it:
    no step showed the noise, so it is the exact_zero INFO (a design that
    starts at zero does this), not the structure's."""
    name = STRUCTURAL[member][3]
    cancel = cancel_at_last_step(name, 1.0, 4)
    seen = [0]

    def none_then_zero(model: nn.Module) -> None:
        seen[0] += 1
        if seen[0] < 4:
            model.get_parameter(name).grad = None
        cancel(model)

    report = structural_report(member, after_backward=none_then_zero)
    (f,) = detailed(report, "exact_zero")
    assert short(f.name) == name and f.severity == Severity.INFO, str(report)
    assert not [f for f in report.findings if f.cause == "zero_by_structure"], str(report)


@pytest.mark.parametrize("member", list(STRUCTURAL))
def test_a_weight_its_rounding_noise_cannot_move_is_no_warning(member: str) -> None:
    """No SGD step at lr 1e-6 moves a weight by its noise. Where the ratio
    ||g||/||w|| is not called vanishing (here: never), the weight that did
    not change is the structure's INFO, not a not_updated warning (the other
    weights, which lr 1e-6 does not move either, are)."""
    name = STRUCTURAL[member][3]
    grads: list[torch.Tensor] = []
    report = structural_report(member, lr=1e-6, thresholds=Thresholds(vanishing=1e-30),
                               after_backward=lambda model: grads.append(model.get_parameter(name).grad.clone()))
    assert name not in [short(f.name) for f in detailed(report, "not_updated")], str(report)
    if grads[-2].count_nonzero() == 0:
        return  # the step before cancelled exactly: no update was due, and no rule looks (default: vanishing does)
    (f,) = [f for f in report.findings if f.cause == "zero_by_structure"]
    assert f.severity == Severity.INFO and short(f.name) == name, str(report)


@pytest.mark.parametrize("member", ["key_bias", "bias_before_instance_norm"])
def test_a_gradient_zero_by_structure_under_torch_compile(member: str) -> None:
    assert_explained_once_as_info(structural_report(member, compiled=True), member)


@pytest.mark.parametrize("member", ["bias_before_batch_norm", "shift_before_log_softmax"])
def test_noise_that_cancels_exactly_under_torch_compile(member: str) -> None:
    cancel = cancel_at_last_step(STRUCTURAL[member][3], 1.0, 4)
    assert_explained_once_as_info(structural_report(member, compiled=True, after_backward=cancel), member)


def test_bert_key_biases_are_one_info_finding() -> None:
    """The issue's model: BERT's separate key projections, with nonzero
    biases as a pretrained checkpoint has them (zero biases make no ratio)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    g = generator()
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=96,
        max_position_embeddings=32, num_labels=3,
    ))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1, generator=g)
    batch = lambda: (torch.randint(0, 96, (4, 16), generator=g), torch.randint(0, 3, (4,), generator=g))  # noqa: E731
    report = fit(model, batch, lambda m, ids, y: m(input_ids=ids, labels=y).loss, steps=4, lr=1e-2)
    assert serious(report) == [], str(report)
    (f,) = [f for f in report.findings if f.cause == "zero_by_structure"]
    assert set(f.names) == {f"bert.encoder.layer.{k}.attention.self.key.bias" for k in range(2)}, str(report)


def test_every_report_of_a_healthy_model_stays_quiet() -> None:
    """Read after every step, as a logger does: never a warning about the key bias."""
    g = generator()
    model = Attention()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = tokens(g)
    with Monitor(model, opt) as monitor:
        for _ in range(5):
            opt.zero_grad()
            squared(model, *batch()).backward()
            opt.step()
            report = monitor.report()
            assert serious(report) == [], str(report)


class SigmoidStack(nn.Module):
    """A deep stack of saturating sigmoids: the first layers' gradients genuinely vanish."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(30))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.sigmoid(4 * layer(x))
        return self.out(x)


class TinyBranch(nn.Module):
    """A branch behind a 1e-9 scale, before the model's own LogSoftmax: its
    gradients vanish, and every way from them goes through a normalizing op."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(16, 10)
        self.tiny = nn.Linear(16, 10)
        self.log_probs = nn.LogSoftmax(dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.log_probs(self.main(x) + 1e-9 * self.tiny(x))


@pytest.mark.parametrize("case", ["sigmoid_stack", "tiny_branch_before_log_softmax"])
def test_a_genuinely_vanishing_gradient_still_warns(case: str) -> None:
    g = generator()
    if case == "sigmoid_stack":
        report = fit(SigmoidStack(), lambda: (torch.randn(32, 16, generator=g),), squared, lr=1e-3)
        expected = {"layers.0.weight", "layers.0.bias"}
    else:
        report = fit(TinyBranch(), rows(g), nll, lr=1e-3)
        expected = {"tiny.weight", "tiny.bias"}
    vanishing = {f.name for f in detailed(report, "vanishing") if f.severity == Severity.WARNING}
    assert expected <= vanishing, report.format(verbose=True)
    assert not [f for f in report.findings if f.cause == "zero_by_structure"], str(report)


# ---- 10. explanations that name what happened ---------------------------------------------


def clip_grad_value(model: nn.Module) -> None:
    nn.utils.clip_grad_value_(model.parameters(), 0)


def clip_grads_with_norm(model: nn.Module) -> None:
    params = list(model.parameters())
    total = nn.utils.get_total_norm([p.grad for p in params])
    nn.utils.clip_grads_with_norm_(params, 0.0, total)


def grad_mul_zero(model: nn.Module) -> None:
    for p in model.parameters():
        assert p.grad is not None
        p.grad.mul_(0)


def clip_grad_norm(model: nn.Module) -> None:
    nn.utils.clip_grad_norm_(model.parameters(), max_norm=0)


# member -> (what runs between backward() and the step, what the message must say)
ZEROED_AFTER_BACKWARD: dict[str, tuple[Callable[[nn.Module], None], tuple[str, ...]]] = {
    "clip_grad_value_": (clip_grad_value, ("clip_grad_value_ with clip_value=0",)),  # the issue's
    "clip_grad_norm_": (clip_grad_norm, ("clip_grad_norm_", "could not tell which")),
    "clip_grads_with_norm_": (clip_grads_with_norm, ("clip_grads_with_norm_", "could not tell which")),  # unnamed
    "grad_mul_zero": (grad_mul_zero, (".grad.mul_(0)", "could not tell which")),  # unnamed
}


def zeroed_report(member: str, compiled: bool = False) -> Report:
    g = generator()
    model = compiled_if(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)), compiled)
    after, _ = ZEROED_AFTER_BACKWARD[member]
    return fit(model, lambda: (torch.randn(8, 6, generator=g),), squared, after_backward=after)


def assert_names_the_call(report: Report, member: str) -> None:
    (f,) = [f for f in report.findings if f.cause == "exact_zero"]
    assert f.name == GLOBAL_NAME and "nonzero when backward() finished" in f.message, str(report)
    _, says = ZEROED_AFTER_BACKWARD[member]
    for words in says:
        assert words in f.message, f.message
    if member == "clip_grad_value_":  # told apart: it writes every gradient twice
        assert "clip_grad_norm_" not in f.message and "could not tell" not in f.message, f.message


@pytest.mark.parametrize("member", list(ZEROED_AFTER_BACKWARD))
def test_gradients_zeroed_after_backward_name_the_call_or_say_so(member: str) -> None:
    assert_names_the_call(zeroed_report(member), member)


@pytest.mark.parametrize("member", ["clip_grad_value_", "grad_mul_zero"])
def test_gradients_zeroed_after_backward_under_torch_compile(member: str) -> None:
    assert_names_the_call(zeroed_report(member, compiled=True), member)


class Stage0(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(torch.tanh(self.a(x))))


class Stage1(nn.Module):
    """The second stage of a pipeline, which cuts what it receives (`how`)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.c = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.how == "detach":
            h = h.detach()
        elif self.how == "no_grad":
            with torch.no_grad():
                h = h * 1.0
        return self.out(torch.tanh(self.c(h)))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("how", ["detach", "no_grad"])  # no_grad: unnamed, a no_grad block at the boundary
def test_a_stage_boundary_cut_in_a_hand_written_pipeline(how: str, compiled: bool) -> None:
    """Two stages in one process, as a pipeline schedule runs them: stage 1
    gets what stage 0 sent as a leaf that requires grad, and stage 0's
    backward starts at its output with the gradient stage 1 sends back
    (zeros where its input got none, as torch.distributed.pipelining does).
    Stage 1's Monitor names the cut of its own input; stage 0's cannot see
    which stage sent zeros and says it could not tell, naming the pipeline
    among the causes."""
    g = generator()
    first: nn.Module = Stage0()
    second: nn.Module = Stage1(how)
    opt0 = torch.optim.SGD(first.parameters(), lr=0.1)
    opt1 = torch.optim.SGD(second.parameters(), lr=0.1)
    if compiled:
        torch._dynamo.reset()
        first, second = torch.compile(first, backend="aot_eager"), torch.compile(second, backend="aot_eager")
    with Monitor(first, opt0) as mon0, Monitor(second, opt1) as mon1:
        for _ in range(STEPS):
            opt0.zero_grad()
            opt1.zero_grad()
            sent = first(torch.randn(8, 6, generator=g))
            received = sent.detach().requires_grad_()
            (second(received) - torch.randn(8, 1, generator=g)).square().mean().backward()
            sent.backward(received.grad if received.grad is not None else torch.zeros_like(sent))
            opt0.step()
            opt1.step()
    zero = [f for f in mon0.report().findings if f.cause == "exact_zero"]
    assert len(zero) == 1 and zero[0].name == GLOBAL_NAME, str(mon0.report())
    assert "could not tell which" in zero[0].message and "pipeline stage" in zero[0].message, zero[0].message
    (cut,) = [f for f in mon1.report().findings if f.cause == "detached"]
    assert cut.severity == Severity.INFO and "the input of the model requires grad" in cut.message, str(mon1.report())
    assert ("torch.no_grad()" if how == "no_grad" else ".detach()") in cut.message


class Router(nn.Module):
    """Top-1 routing whose router trains only through its load-balancing
    loss, kept as self.aux_loss; the load per expert is logged from a
    detached copy."""

    def __init__(self, width: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        with torch.no_grad():  # every expert as likely as the others (an idle one gets no gradient)
            self.router.weight.copy_(3 * torch.eye(experts, width))
            self.router.bias.zero_()
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(-1)
        top = probs.argmax(-1)
        self.load = probs.detach().mean(0) * len(self.experts)  # for a log
        share = F.one_hot(top, len(self.experts)).float().mean(0)
        self.aux_loss = len(self.experts) * (share * probs.mean(0)).sum()
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = top == e
            if hit.any():
                out = out.index_put((hit.nonzero()[:, 0],), expert(x[hit]))
        return out


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = Router()
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.moe(x))


def routed(g: torch.Generator) -> Batch:
    """32 tokens, 8 for each of Router's 4 experts (an idle expert gets no gradient, for another reason)."""
    lift = 10 * F.one_hot(torch.arange(32) % 4, 8)
    return lambda: (torch.randn(32, 8, generator=g) + lift,)


class WithAuxHead(nn.Module):
    """A trunk that returns its auxiliary head's loss beside its features."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Linear(width, 8)
        self.aux_head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return h, self.aux_head(h).square().mean()


class AuxNet(nn.Module):
    """Takes the trunk's features and drops the auxiliary loss it computed."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = WithAuxHead(width=8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _aux = self.trunk(x)
        return self.out(h)


# member -> (model, the parameters without a gradient, how the message names the tensor they feed)
LEFT_OUT: dict[str, tuple[Callable[[], nn.Module], set[str], tuple[str, ...]]] = {
    "router_aux_loss": (MoENet, {"moe.router.weight", "moe.router.bias"}, ("moe.aux_loss",)),  # the issue's
    # unnamed: an auxiliary head (no MoE) whose loss a submodule returns and its caller drops
    "aux_head_output": (AuxNet, {"trunk.aux_head.weight", "trunk.aux_head.bias"}, ("output[1] of", "trunk")),
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("member", list(LEFT_OUT))
def test_a_loss_computed_but_left_out_is_named_not_a_detach(member: str, compiled: bool) -> None:
    make, names, feeds = LEFT_OUT[member]
    g = generator()
    model = compiled_if(make(), compiled)
    report = fit(model, routed(g), squared)
    (f,) = [f for f in report.findings if f.cause == "unused"]
    assert {short(n) for n in f.names} == names, str(report)
    assert all(words in f.message for words in feeds), str(report)
    assert "not part of the loss that backward ran" in f.message, str(report)
    assert ".detach()" not in f.message and "discarded" not in f.message, str(report)


class CachesThenCuts(nn.Module):
    """Keeps a block's result as an attribute (a cache for a hook or a log),
    and passes it on through a .detach(): the result was used, and the cut
    is what leaves the block without a gradient."""

    def __init__(self, keep: str) -> None:
        super().__init__()
        self.keep = keep
        self.block = nn.Sequential(nn.Linear(6, 8), nn.Tanh())  # its output holds the Linear's graph
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x)
        if self.keep == "attribute":
            self.cached = h
        return self.out(h.detach())


@pytest.mark.parametrize("keep", ["attribute", "submodule_output"])
def test_a_kept_result_that_went_on_into_a_cut_names_the_cut(keep: str) -> None:
    g = generator()
    report = fit(CachesThenCuts(keep), lambda: (torch.randn(8, 6, generator=g),), squared)
    (f,) = [f for f in report.findings if f.kind == "grad"]
    assert f.cause == "detached" and set(f.names) == {"block.0.weight", "block.0.bias"}, str(report)
    assert ".detach()" in f.message and "not part of the loss" not in f.message, str(report)


def test_sparse_rows_under_float16_autocast_are_no_underflow() -> None:
    """An embedding's rows are zero where a batch has none of their tokens,
    and a manual monitor.step() (auto=False) cannot see the GradScaler: under
    float16 autocast, with a scaler, neither is an underflow."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(2000, 32), nn.Linear(32, 2000))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    monitor = Monitor(model, opt, auto=False)
    for _ in range(3):
        tokens = torch.randint(0, 2000, (4, 8))
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, 2000), tokens.reshape(-1))
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        monitor.step()
        scaler.step(opt)
        scaler.update()
    report = monitor.report()
    assert not [f for f in report.findings if f.cause == "underflow" and f.severity != "info"], str(report)
