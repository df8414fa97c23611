"""The cause the Monitor names, found by its mechanism, on every stack.

Each family of the cause analysis is tried member by member: the ways
forward can cut the graph, the hooks that zero a gradient (and those that
only rescale it, which must raise nothing), the wiring of the loss, what
counts as trainable state, and learning-rate schedules. Each runs on a plain
model and under a wrapper: torch.compile (aot_eager and inductor, the
Monitor on the compiled wrapper or on _orig_mod) here, DDP and FSDP2 on a
2-rank gloo world (test_monitor_causes_distributed.py). One root cause is
one finding: the tests read the grouped finding, and its members.
"""

from __future__ import annotations

import io
import contextlib
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from helpers import fresh_seed
from zeroscan import Monitor, Report, Severity
from zeroscan.monitor import Finding

STEPS = 3


class Reverse(torch.autograd.Function):
    """A gradient reversal: passes -g back (raises nothing)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return -g


class DropsGrad(torch.autograd.Function):
    """A custom Function whose backward returns None for the input that needs grad."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x * 2

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return None


def cut(how: str, h: torch.Tensor) -> torch.Tensor:
    """`h` with its graph cut by one mechanism."""
    if how == "detach":
        return h.detach()
    if how == "detach_":
        return h.detach_()
    if how == "data":
        return h.data
    if how == "tolist":
        return torch.tensor(h.tolist())
    if how == "item":
        return torch.full_like(h, h.mean().item())
    if how == "numpy":
        return torch.from_numpy(h.detach().numpy().copy())
    if how == "no_grad":
        with torch.no_grad():
            return h * 2
    if how == "inference_mode":
        with torch.inference_mode():
            out = h * 2
        return out.clone()
    if how == "function":
        return DropsGrad.apply(h)
    raise ValueError(how)


class Chain(nn.Module):
    """inp -> block1 -> (cut) -> block2 -> out: the cut is after block1."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.inp = nn.Linear(6, 8)
        self.block1 = nn.Linear(8, 8)
        self.block2 = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.block1(torch.tanh(self.inp(x))))
        h = cut(self.how, h)
        return self.out(torch.tanh(self.block2(h)))


BEFORE_CUT = {"inp.weight", "inp.bias", "block1.weight", "block1.bias"}
CUTS = ["detach", "detach_", "data", "tolist", "item", "numpy", "no_grad", "inference_mode", "function"]


def train(model: nn.Module, target: nn.Module | None = None, steps: int = STEPS, **kwargs: object) -> Report:
    """`steps` SGD steps on random data, monitored on `target` (default: the model)."""
    torch.manual_seed(fresh_seed(2**31))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(target if target is not None else model, opt, **kwargs) as monitor:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(5, 6)).square().mean().backward()
            opt.step()
    return monitor.report()


def short(name: str) -> str:
    return name.removeprefix("_orig_mod.")


def grad_findings(report: Report) -> list[Finding]:
    return [f for f in report.findings if f.kind == "grad"]


def assert_one_detached_finding(report: Report, names: set[str], says: str) -> None:
    """One grouped DETACHED finding for exactly `names`, whose message says `says`."""
    found = grad_findings(report)
    assert len(found) == 1, report.format(verbose=True)
    f = found[0]
    assert f.cause == "detached" and f.severity == Severity.ERROR, str(report)
    assert {short(n) for n in f.names} == names, str(report)
    assert says in f.message, str(report)
    assert "unused" not in {m.cause for m in f.members} and "autograd.grad" not in f.message


CUT_WORDS = {
    "detach": ".detach()", "detach_": ".detach_()", "data": ".data", "tolist": ".tolist()", "item": ".item()",
    "numpy": ".detach()", "no_grad": "torch.no_grad()", "inference_mode": "torch.inference_mode()",
    "function": "DropsGrad",
}


@pytest.mark.parametrize("how", CUTS)
def test_every_parameter_before_a_cut_is_detached_in_one_finding(how: str) -> None:
    assert_one_detached_finding(train(Chain(how)), BEFORE_CUT, CUT_WORDS[how])


@pytest.mark.slow  # 16 compilations
@pytest.mark.parametrize("place", ["wrapper", "orig"])
@pytest.mark.parametrize("how", ["detach", "no_grad", "function", "tolist"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_cut_under_torch_compile_is_named_not_blamed_on_autograd_grad(backend: str, how: str, place: str) -> None:
    """The forward the probe watches runs eagerly, so the cut inside the
    compiled code is found wherever the Monitor sits."""
    if backend == "inductor" and how in ("tolist", "function"):
        pytest.skip("inductor compiles the same graph as aot_eager here; two members are enough")
    torch._dynamo.reset()
    model = Chain(how)
    compiled = torch.compile(model, backend=backend)
    report = train(compiled, compiled if place == "wrapper" else model)
    if how == "function" and place == "orig":
        # The Function runs inside the compiled graph, which turns its None into zeros,
        # and the probe cannot force eager mode from inside the compiled frame: never a
        # confident wrong cause, and the parameters before the cut are the ones named.
        (f,) = grad_findings(report)
        assert f.cause in ("detached", "exact_zero") and {short(n) for n in f.names} == BEFORE_CUT, str(report)
        return
    assert_one_detached_finding(report, BEFORE_CUT, CUT_WORDS[how])


def test_the_probed_forward_pass_runs_eagerly_under_torch_compile() -> None:
    """dynamo captures no graph while the probe watches (its observer is
    compiler-disabled); the steps after it run compiled."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = Chain("detach")
    compiled = torch.compile(model, backend="aot_eager")
    train(compiled, steps=1)
    assert counters["stats"]["unique_graphs"] == 0
    train(compiled, steps=2)  # a new Monitor probes its first step; the second is compiled
    assert counters["stats"]["unique_graphs"] >= 1


def test_a_compiled_cut_never_probed_eagerly_says_so() -> None:
    """Found at a later step, when the first probe saw nothing wrong: the
    compiled graph's backward gave no gradient, and the report says the
    cause is hidden by torch.compile (never autograd.grad); the next
    monitored step probes eagerly and names the cut."""
    torch._dynamo.reset()
    model = Chain("none_yet")
    model.how = "detach"
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = Monitor(compiled, opt)
    monitor._causes.drop()  # as if the first probe had already come and gone
    opt.zero_grad()
    compiled(torch.randn(5, 6)).square().mean().backward()
    opt.step()
    first = monitor.report()
    (f,) = grad_findings(first)
    # Where the compiled graph's backward node keeps its edge to the parameters, it is
    # named; where it prunes that edge, the graph does not reach them: either way no
    # confident wrong cause, and never autograd.grad.
    assert (f.cause == "detached" and "torch.compile" in f.message) or f.cause == "not_reached", str(first)
    assert "autograd.grad" not in f.message and {short(n) for n in f.names} == BEFORE_CUT, str(first)
    for _ in range(2):
        opt.zero_grad()
        compiled(torch.randn(5, 6)).square().mean().backward()
        opt.step()
    assert_one_detached_finding(monitor.report(), BEFORE_CUT, ".detach()")
    monitor.close()


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(checkpoint(self.block, x, use_reentrant=True))


def test_a_reentrant_checkpoint_without_grad_inputs_is_named() -> None:
    with pytest.warns(UserWarning):  # torch's own: "None of the inputs have requires_grad=True"
        report = train(Checkpointed())
    assert_one_detached_finding(report, {"block.0.weight", "block.0.bias"}, "use_reentrant=True")


# ------------------------------------------------------------------ hooks


class Heads(nn.Module):
    """trunk -> (head_a, head_b): two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.head_a = nn.Linear(8, 1)
        self.head_b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.head_a(h), self.head_b(h)


def zeroing_hook(g: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(g)


def zero_after_accumulate(p: torch.Tensor) -> None:
    assert p.grad is not None
    p.grad.zero_()


def zero_grad_input(module: nn.Module, grad_input: tuple, grad_output: tuple) -> tuple:
    return tuple(None if g is None else torch.zeros_like(g) for g in grad_input)


def zero_grad_output(module: nn.Module, grad_output: tuple) -> tuple:
    return tuple(torch.zeros_like(g) for g in grad_output)


HOOKS: dict[str, tuple[Callable[[Heads], object], set[str], str]] = {
    # how the hook is put on the model, which gradients it zeroes, the hook's name
    "tensor": (lambda m: m.head_a.weight.register_hook(zeroing_hook), {"head_a.weight"}, "zeroing_hook"),
    "post_accumulate": (
        lambda m: [p.register_post_accumulate_grad_hook(zero_after_accumulate) for p in m.head_b.parameters()],
        {"head_b.weight", "head_b.bias"}, "zero_after_accumulate",
    ),
    "full_backward": (
        lambda m: m.head_a.register_full_backward_hook(zero_grad_input) and m.head_b.register_full_backward_hook(
            zero_grad_input), {"trunk.weight", "trunk.bias"}, "zero_grad_input",
    ),
    "backward_pre": (
        lambda m: m.head_b.register_full_backward_pre_hook(zero_grad_output),
        {"head_b.weight", "head_b.bias"}, "zero_grad_output",
    ),
}


def train_heads(model: nn.Module, loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], steps: int = STEPS,
                target: nn.Module | None = None) -> Report:
    torch.manual_seed(fresh_seed(2**31))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(target if target is not None else model, opt) as monitor:
        for _ in range(steps):
            opt.zero_grad()
            a, b = model(torch.randn(5, 6))
            loss_of(a, b).backward()
            opt.step()
    return monitor.report()


def both(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.square().mean() + b.square().mean()


@pytest.mark.parametrize("kind", list(HOOKS))
def test_a_hook_that_zeroes_gradients_is_named(kind: str) -> None:
    put, zeroed, hook_name = HOOKS[kind]
    model = Heads()
    put(model)
    report = train_heads(model, both)
    found = [f for f in report.detailed if f.kind == "grad"]
    assert {f.name for f in found} == zeroed, report.format(verbose=True)
    assert all(f.cause == "exact_zero" and hook_name in f.message for f in found), str(report)
    assert "dead ReLU" not in str(report)
    assert len(grad_findings(report)) == 1, str(report)  # one hook, one finding


@pytest.mark.parametrize("kind", ["scale", "reverse", "clip"])
def test_hooks_that_only_rescale_or_reverse_raise_nothing(kind: str) -> None:
    model = Heads()
    if kind == "scale":
        model.head_a.weight.register_hook(lambda g: 0.5 * g)
    elif kind == "clip":
        for p in model.parameters():
            p.register_hook(lambda g: g.clamp(-0.01, 0.01))
    else:
        model.head_b.register_full_backward_pre_hook(lambda m, go: tuple(-g for g in go))
    report = train_heads(model, both)
    assert report.worst <= Severity.INFO, str(report)


# ------------------------------------------------------------ loss wiring


def test_an_output_left_out_of_the_loss_is_said_in_those_words() -> None:
    report = train_heads(Heads(), lambda a, b: a.square().mean())
    (f,) = grad_findings(report)
    assert f.cause == "unused" and set(f.names) == {"head_b.weight", "head_b.bias"}, str(report)
    assert "output[1]" in f.message and "never enters the loss" in f.message, str(report)
    assert "autograd.grad" not in f.message


def test_a_loss_term_weighted_by_zero_is_said_in_those_words() -> None:
    report = train_heads(Heads(), lambda a, b: a.square().mean() + 0.0 * b.square().mean())
    (f,) = grad_findings(report)
    assert f.cause == "exact_zero" and set(f.names) == {"head_b.weight", "head_b.bias"}, str(report)
    assert "output[1] enters the loss weighted by 0" in f.message, str(report)


def test_an_auxiliary_loss_under_no_grad_is_said_in_those_words() -> None:
    model = Heads()
    aux = nn.Linear(8, 1)
    model.aux = aux  # a head the training loop calls itself, under no_grad
    torch.manual_seed(fresh_seed(2**31))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, opt) as monitor:
        for _ in range(STEPS):
            opt.zero_grad()
            x = torch.randn(5, 6)
            a, b = model(x)
            with torch.no_grad():
                aux_loss = model.aux(torch.tanh(model.trunk(x))).square().mean()
            (a.square().mean() + b.square().mean() + aux_loss).backward()
            opt.step()
    report = monitor.report()
    (f,) = grad_findings(report)
    assert f.cause == "detached" and set(f.names) == {"aux.weight", "aux.bias"}, str(report)
    assert "outside the model's forward under torch.no_grad()" in f.message, str(report)


def test_autograd_grad_is_named_only_when_the_code_calls_it() -> None:
    model = Heads()
    torch.manual_seed(fresh_seed(2**31))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, opt) as monitor:
        for _ in range(STEPS):
            opt.zero_grad()
            a, b = model(torch.randn(5, 6))
            both(a, b).backward(inputs=list(model.trunk.parameters()) + list(model.head_a.parameters()))
            opt.step()
    (f,) = grad_findings(monitor.report())
    assert f.cause == "no_backward" and set(f.names) == {"head_b.weight", "head_b.bias"}
    assert "backward(inputs=...)" in f.message


@pytest.mark.parametrize("case", ["left_out", "weighted_by_zero", "tensor_hook"])
def test_loss_wiring_and_hooks_under_torch_compile(case: str) -> None:
    """The same answers with the Monitor on a compiled model (aot_eager): an
    output left out of the loss, and a zeroing hook, are named; a term
    weighted by 0 is at worst the generic exact-zero finding (the compiled
    graph's one backward node hides which output a parameter feeds), never
    a confident wrong cause."""
    torch._dynamo.reset()
    model = Heads()
    if case == "tensor_hook":
        model.head_a.weight.register_hook(zeroing_hook)
    compiled = torch.compile(model, backend="aot_eager")
    loss_of = {
        "left_out": lambda a, b: a.square().mean(),
        "weighted_by_zero": lambda a, b: a.square().mean() + 0.0 * b.square().mean(),
        "tensor_hook": both,
    }[case]
    report = train_heads(compiled, loss_of, steps=4)
    (f,) = grad_findings(report)
    if case == "left_out":
        assert f.cause == "unused" and "never enters the loss" in f.message, str(report)
        assert {short(n) for n in f.names} == {"head_b.weight", "head_b.bias"}
    elif case == "weighted_by_zero":
        assert f.cause == "exact_zero" and {short(n) for n in f.names} == {"head_b.weight", "head_b.bias"}
    else:
        assert f.cause == "exact_zero" and "zeroing_hook" in f.message and short(f.name) == "head_a.weight"


# ------------------------------------------------------- trainable state


class Caches(nn.Module):
    """Caches activations on itself (never trainable state) and keeps one
    learnable scale as a buffer (trainable state the optimizer cannot see)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.register_buffer("scale", torch.ones(1, requires_grad=True))
        self.features: dict[str, torch.Tensor] = {}
        self.lin.register_forward_hook(lambda m, i, o: self.features.__setitem__("lin", o))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.attention_map = torch.softmax(h, dim=-1)
        self.aux_loss = h.square().mean()
        self.history = [h, h * 2]
        return h * self.scale


def test_only_leaf_state_that_requires_grad_is_trainable_state() -> None:
    report = train(Caches())
    plain = [f for f in report.findings if f.cause == "plain_attribute"]
    assert [f.name for f in plain] == ["scale"], str(report)
    assert "_buffers" not in str(report)


# ------------------------------------------------------ learning rates


def test_a_warmup_from_zero_is_judged_by_the_lr_each_step_ran_with() -> None:
    model = Heads()
    torch.manual_seed(fresh_seed(2**31))
    opt = torch.optim.SGD(
        [{"params": list(model.trunk.parameters()) + list(model.head_a.parameters())},
         {"params": list(model.head_b.parameters()), "lr": 0.0}], lr=0.04,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: min(1.0, s / 4), lambda s: 1.0])
    reports = []
    with Monitor(model, opt) as monitor:
        for _ in range(10):
            opt.zero_grad()
            both(*model(torch.randn(5, 6))).backward()
            opt.step()
            sched.step()
            reports.append(monitor.report())  # read after every step, as a logger does
    after_first = reports[1]
    assert after_first.worst <= Severity.INFO, str(after_first)
    first_step = [f for f in after_first.findings if f.cause == "not_updated"]
    assert sorted(len(f.names) for f in first_step) == [2, 4], str(after_first)  # one finding per param group
    for f in first_step:
        assert "lr=0" in f.message and "below the weight's resolution" not in f.message, str(after_first)
    for r in reports[2:]:  # group 0 warmed up and trains; group 1 stays at lr 0
        assert all(set(f.names or (f.name,)) <= {"head_b.weight", "head_b.bias"} for f in r.findings), str(r)
        assert "resolution" not in str(r)
    last = reports[-1]
    (stuck,) = last.findings
    assert stuck.cause == "frozen_in_time" and stuck.severity == Severity.WARNING and "lr=0" in stuck.message


# ------------------------------------------------------------- grouping


class Deep(nn.Module):
    """A .detach() upstream of three layers (six parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if k == 2:
                x = x.detach()
        return x


def test_one_root_cause_is_one_finding_with_its_members_kept() -> None:
    report = train(Deep())
    (f,) = report.findings
    assert len(f.names) == 6 and len(f.members) == 6
    d = f.to_dict()
    assert [m["name"] for m in d["members"]] == list(f.names) and d["names"] == list(f.names)
    assert all(m.cause == "detached" and m.name in m.message for m in f.members)
    assert len(str(report).splitlines()) < len(report.format(verbose=True).splitlines())
    for name in f.names:
        assert name in report.format(verbose=True).split("\n", 2)[2]


def test_a_nan_that_spread_is_one_finding_naming_where_it_began() -> None:
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, opt) as monitor:
        for step in range(3):
            opt.zero_grad()
            x = torch.randn(5, 6)
            if step == 1:
                x[0, 0] = float("nan")
            model(x).square().mean().backward()
            opt.step()
    report = monitor.report()
    nonfinite = [f for f in report.findings if f.cause == "nonfinite"]
    assert len(nonfinite) == 1, str(report)
    assert "first appeared at step 1" in nonfinite[0].message and len(nonfinite[0].members) >= 6


def test_a_report_before_any_step_is_one_finding() -> None:
    report = Monitor(Deep()).report()
    assert [f.cause for f in report.findings] == ["no_step"], str(report)


# ------------------------------------------------------- the text table


def test_the_table_wraps_to_the_width_and_never_runs_hundreds_of_columns() -> None:
    model = Chain("detach")
    model.add_module("a_module_with_a_rather_long_name_indeed_that_goes_on", nn.Linear(3, 3))
    report = train(model)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # not a terminal: 100 columns
        text = str(report)
    assert max(len(line) for line in text.splitlines()) <= 100, text
    for width in (60, 80, 140):
        text = report.format(width=width, verbose=True)
        assert max(len(line) for line in text.splitlines()) <= width, text
    for bad in (0, -3, 2.5, "80", True):
        with pytest.raises(ValueError, match=r"width must be an int >= 1 or None, got"):
            report.format(width=bad)  # type: ignore[arg-type]
    assert "a_module_with_a_rather_long_name_indeed_that_goes_on" in "".join(
        line.strip() for line in report.format(width=80).splitlines()
    )


# ------------------------------------------- what the probe must not count


class KeepsStatistics(nn.Module):
    """Computes a statistic under no_grad and a detached copy for logging,
    keeps both aside (no cut of the graph), and discards a branch."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.side = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        with torch.no_grad():
            self.running_mean = h.mean(0) * 0.9
        self.logged = h.detach()
        self.side(h)  # computed, then discarded
        return self.out(h)


def test_statistics_kept_aside_cut_nothing_and_a_discarded_branch_is_unused() -> None:
    report = train(KeepsStatistics())
    (f,) = grad_findings(report)
    assert f.cause == "unused" and set(f.names) == {"side.weight", "side.bias"}, str(report)
    assert "discarded" in f.message and "no_grad" not in f.message


class Pass(torch.autograd.Function):
    """A correct pass-through Function, as libraries put on every path (a fused kernel, say)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g


class LoraLike(nn.Module):
    """LoRA's A gets an exactly zero gradient at the first step while B = 0,
    by design; a pass-through Function sits on every way to it."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(6, 6)
        self.base.requires_grad_(False)
        self.a = nn.Linear(6, 2, bias=False)
        self.b = nn.Linear(2, 6, bias=False)
        nn.init.zeros_(self.b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Pass.apply(self.base(x) + self.b(self.a(x)))


def test_a_zero_by_design_stays_info_whatever_sits_on_its_way() -> None:
    report = train(LoraLike(), steps=1)
    assert report.worst <= Severity.INFO, str(report)
    assert "lasts" in str(report) or "by design" in str(report)


def test_a_hook_that_sets_grad_to_none_is_named_before_any_function() -> None:
    """An optimizer run in backward (a post-accumulate-grad hook that steps and
    clears .grad), with a pass-through Function on the way: the hook is named,
    never the Function nor autograd.grad."""
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    inner = torch.optim.SGD(model[2].parameters(), lr=0.1)

    def step_in_backward(p: torch.Tensor) -> None:
        inner.step()
        p.grad = None

    for p in model[2].parameters():
        p.register_post_accumulate_grad_hook(step_in_backward)
    outer = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with Monitor(model, outer) as monitor:
        for _ in range(STEPS):
            outer.zero_grad()
            Reverse.apply(model(torch.randn(5, 6))).square().mean().backward()
            outer.step()
    report = monitor.report()
    named = [f for f in report.detailed if f.name.startswith("2.") and f.kind == "grad"]
    assert named and all("step_in_backward" in f.message for f in named), str(report)
    assert "Reverse" not in str(report) and "autograd.grad" not in str(report)


def test_an_output_left_out_probes_once_not_every_other_step(monkeypatch: pytest.MonkeyPatch) -> None:
    import zeroscan.monitor.causes as causes_module

    probed = []
    enter = causes_module.Probe.__enter__
    monkeypatch.setattr(causes_module.Probe, "__enter__", lambda self: probed.append(1) or enter(self))
    report = train_heads(Heads(), lambda a, b: a.square().mean(), steps=10)
    assert grad_findings(report)[0].cause == "unused"
    assert len(probed) <= 2, f"the probe ran at {len(probed)} of 10 steps"


def test_a_tensor_learning_rate_is_read_as_each_step_ran_with_it() -> None:
    """A scheduler changes a tensor lr in place: the lr of each step is the one
    it ran with, copied at the step (a warmup from 0)."""
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01), foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 3))
    reports = []
    with Monitor(model, opt) as monitor:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(5, 6)).square().mean().backward()
            opt.step()
            sched.step()
            reports.append(monitor.report())
    (f,) = reports[1].findings
    assert f.cause == "not_updated" and f.severity == Severity.INFO and "lr=0" in f.message, str(reports[1])
    assert reports[2].findings == [], str(reports[2])
