"""Monitor(trace_nonfinite=True) on the next families of training code:
infinities that are part of the computation, outputs in any structure,
passes that no backward follows, and graphs 20,000 calls deep.

Each model holds a `Bad` module, the identity until armed; armed, its own
code makes a NaN. A healthy run (never armed) must report nothing, and an
armed step must be named at `bad`, whatever else the model does. Each
family runs on a plain model and with part of it torch.compile'd (the
trace stops at a compiled module's boundary).
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import zeroscan
from helpers import ended, fresh_generator, run_python, serious

pytestmark = pytest.mark.usefixtures("one_thread")

WIDTH, LENGTH, VOCAB = 16, 6, 12
STEPS, ARMED_AT = 4, 2


class Bad(nn.Module):
    """x as it is until armed; armed, a NaN made in its own code."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * float("nan") if self.armed else y


def causal_attention_scores(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return ((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + bias).softmax(-1)


# ---- family 1: infinities that are part of the computation ----------------------------------


class CausalEncoder(nn.Module):
    """nn.TransformerEncoder with the standard additive causal mask (-inf above
    the diagonal), made in the model's forward and passed to the encoder."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.bad = Bad()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.bad(self.enc(self.emb(tokens), mask=mask)))


class PaddingAttention(nn.Module):
    """nn.MultiheadAttention given a float key-padding mask (-inf at the padded keys)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.bad = Bad()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        padding = torch.zeros(tokens.shape, dtype=x.dtype)
        padding[:, -2:] = float("-inf")  # the last two tokens are padding; every query still sees a key
        y, _ = self.attn(x, x, x, key_padding_mask=padding, need_weights=False)
        return self.head(self.bad(y))


class Alibi(nn.Module):
    """ALiBi: a per-head linear distance penalty, -inf above the diagonal."""

    def forward(self, t: int) -> torch.Tensor:
        pos = torch.arange(t)
        bias = -(pos[:, None] - pos[None, :]).abs().float() * 0.5
        return bias.masked_fill(pos[None, :] > pos[:, None], float("-inf"))


class AlibiAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return causal_attention_scores(q, k, bias) @ v


class AlibiModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.alibi = Alibi()
        self.attn = AlibiAttention()
        self.bad = Bad()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        return self.head(self.bad(self.attn(x, bias=self.alibi(tokens.shape[1]))))


class RunningMaxInit(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full_like(x[:, 0], float("-inf"))


class RunningMax(nn.Module):
    def forward(self, running: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        for t in range(x.shape[1]):
            running = torch.maximum(running, x[:, t])
        return running


class RunningMaxModel(nn.Module):
    """A running max over time that starts from -inf, returned by its own module."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.init = RunningMaxInit()
        self.pool = RunningMax()
        self.bad = Bad()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        pooled = self.pool(self.init(x), x)
        return self.head(self.bad(pooled))[:, None].expand(-1, tokens.shape[1], -1)


class MaskedLogProbs(nn.Module):
    """log-probabilities with -inf at the tokens a vocabulary mask rules out (log 0)."""

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        banned = torch.zeros(logits.shape[-1], dtype=torch.bool)
        banned[-3:] = True
        return logits.log_softmax(-1).masked_fill(banned, float("-inf"))


class LogProbModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.bad = Bad()
        self.head = nn.Linear(WIDTH, VOCAB)
        self.logprobs = MaskedLogProbs()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.logprobs(self.head(self.bad(self.emb(tokens))))


class Distances(nn.Module):
    """Pairwise distances with +inf on the diagonal: a point is not its own neighbour."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = torch.cdist(x, x)
        eye = torch.eye(x.shape[1], dtype=torch.bool)
        return d.masked_fill(eye, float("inf"))


class Nearest(nn.Module):
    def forward(self, d: torch.Tensor) -> torch.Tensor:
        return d.topk(2, dim=-1, largest=False).values.mean(-1, keepdim=True)


class NeighbourModel(nn.Module):
    """Top-k nearest neighbours over a distance matrix with inf sentinels."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.dist = Distances()
        self.nearest = Nearest()
        self.bad = Bad()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        x = x + self.nearest(self.dist(x))
        return self.head(self.bad(x))


class ChoiceModel(nn.Module):
    """A pointer-style head whose output logits are -inf at the choices that
    are invalid; cross_entropy over them, with valid targets, is finite. The
    infinity leaves the model: an unnamed member (the model's own output
    holds it, and the loss consumes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.bad = Bad()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.bad(self.emb(tokens)))
        return logits.masked_fill(torch.arange(VOCAB) >= VOCAB - 3, float("-inf"))


LEGIT: dict[str, Callable[[], nn.Module]] = {
    "causal_mask": CausalEncoder,
    "padding_mask": PaddingAttention,
    "alibi": AlibiModel,
    "running_max": RunningMaxModel,
    "masked_log_probs": LogProbModel,
    "distance_topk": NeighbourModel,
    "invalid_choice_logits": ChoiceModel,  # not named by the issue
}


def tokens_and_targets(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB - 3, (4, LENGTH + 1), generator=g)  # targets are never a banned choice
    return tokens[:, :-1], tokens[:, 1:]


def train_tokens(
    model: nn.Module, g: torch.Generator, arm: Callable[[bool], None], *, lr: float = 0.01
) -> zeroscan.Report:
    """STEPS SGD steps of next-token cross-entropy under
    Monitor(trace_nonfinite=True); arm(True) before step ARMED_AT's forward
    pass, arm(False) before every other's."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    monitor = zeroscan.Monitor(model, opt, trace_nonfinite=True)
    for step in range(STEPS):
        arm(step == ARMED_AT)
        tokens, targets = tokens_and_targets(g)
        loss = nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    report = monitor.report()
    monitor.close()
    return report


def train(model: nn.Module, g: torch.Generator, armed: bool) -> zeroscan.Report:
    """train_tokens with the model's `bad` module armed at step ARMED_AT (or never)."""
    bad = dict(model.named_modules())["bad"]
    return train_tokens(model, g, lambda on: setattr(bad, "armed", on and armed))


def compiled_parts(model: nn.Module) -> nn.Module:
    """The model with every child but `bad` and `head` torch.compile'd in its place."""
    for name, child in list(model.named_children()):
        if name not in ("bad", "head") and any(True for _ in child.parameters()):
            setattr(model, name, torch.compile(child, backend="eager"))
    return model


def assert_named_at_bad(report: zeroscan.Report, step: int = ARMED_AT) -> None:
    origin = report.nonfinite_origin
    assert origin is not None, str(report)
    assert (origin["name"], origin["step"], origin["pass"]) == ("bad", step, "forward"), origin
    assert origin["how"].startswith("bad returned NaN"), origin


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("member", sorted(LEGIT))
def test_a_legitimate_infinity_is_not_trouble(member: str, compiled: bool) -> None:
    g = fresh_generator()
    torch.manual_seed(int(torch.randint(0, 2**31, (), generator=g)))

    def make() -> nn.Module:
        model = LEGIT[member]()
        return compiled_parts(model) if compiled else model

    healthy = train(make(), g, False)
    assert healthy.nonfinite_origin is None, healthy.nonfinite_origin
    assert serious(healthy) == [], str(healthy)
    assert not [f for f in healthy.findings if f.cause in ("nonfinite", "nonfinite_origin")], str(healthy)
    assert_named_at_bad(train(make(), g, True))


class MaskedBlock(nn.Module):
    """Takes the causal mask itself and hands it to its attention (which
    consumes it); its own code then makes a NaN, in forward or in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = AlibiAttention()
        self.armed: str | None = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y = self.attn(x, bias=mask)
        if self.armed == "forward":
            y = y * float("nan")
        if self.armed == "backward":  # finite forward; sqrt's gradient at 0 is inf, times 0: NaN
            y = y + torch.sqrt((y - y.detach()) ** 2)
        return y


class MaskedBlockModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.block = MaskedBlock()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.block(self.emb(tokens), mask=mask))


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_nan_in_a_module_that_took_the_mask_is_its_own(phase: str) -> None:
    """The block took the -inf mask, and its attention consumed it; the NaN
    its own code makes is born there, in forward or in backward, not in the
    code that made the mask."""
    g = fresh_generator()
    model = MaskedBlockModel()
    origin = train_tokens(model, g, lambda on: setattr(model.block, "armed", phase if on else None)).nonfinite_origin
    assert origin is not None and (origin["name"], origin["step"], origin["pass"]) == ("block", ARMED_AT, phase), origin
    if phase == "forward":
        assert "its only non-finite inputs (kwargs['mask']) were consumed harmlessly" in origin["how"], origin


class Overflow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e30 * 1e30 if self.armed else x


class OverflowModel(nn.Module):
    """A real infinity (an overflow) that a later module turns into NaN
    (LayerNorm: inf - inf), in a model that also masks with -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = CausalEncoder()
        self.big = Overflow()
        self.norm = nn.LayerNorm(VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.norm(self.big(self.inner(tokens)))


def test_a_nan_that_descends_from_a_real_infinity_names_the_infinity() -> None:
    g = fresh_generator()
    model = OverflowModel()
    origin = train_tokens(model, g, lambda on: setattr(model.big, "armed", on)).nonfinite_origin
    assert origin is not None and (origin["name"], origin["step"]) == ("big", ARMED_AT), origin
    assert "norm returned NaN from that inf" in origin["how"], origin


class FullyMasked(nn.Module):
    """Attention whose additive mask, made by its caller, hides every key from one query."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = AlibiAttention()
        self.hide_row: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.zeros(t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        if self.hide_row is not None:
            mask[self.hide_row] = float("-inf")
        return self.attn(x, bias=mask)


def test_a_fully_masked_row_descends_from_its_mask() -> None:
    """The NaN of a query that sees no key descends from the mask's -inf: the
    origin is the code that made the mask, not the attention's softmax."""
    g = fresh_generator()
    model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), FullyMasked(), nn.Linear(WIDTH, VOCAB))
    origin = train_tokens(model, g, lambda on: setattr(model[1], "hide_row", 3 if on else None)).nonfinite_origin
    assert origin is not None and (origin["name"], origin["step"]) == ("1", ARMED_AT), origin
    assert "1.attn returned NaN from that inf" in origin["how"], origin


class InfInBackward(torch.autograd.Function):
    """Identity in forward; its backward multiplies the gradient by inf."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


class BlowsUpInBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return InfInBackward.apply(y) if self.armed else y


class BanChoices(nn.Module):
    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill(torch.arange(VOCAB) >= VOCAB - 3, float("-inf"))


@pytest.mark.parametrize("masked", [False, True], ids=["plain_logits", "masked_logits"])
def test_an_infinity_born_in_backward_is_not_the_masked_output(masked: bool) -> None:
    """The model returns logits that are -inf at banned choices (consumed by
    the loss), and an inf is born in a module's backward, after which NaN
    follows: the origin is that backward, with or without the mask."""
    g = fresh_generator()
    body = BlowsUpInBackward()
    layers = [nn.Embedding(VOCAB, WIDTH), body, nn.Tanh(), nn.Linear(WIDTH, VOCAB)]
    model = nn.Sequential(*layers, *([BanChoices()] if masked else []))
    # lr 0: the weights stay finite, so every step is like the first.
    origin = train_tokens(model, g, lambda on: setattr(body, "armed", on), lr=0.0).nonfinite_origin
    assert origin is not None and (origin["name"], origin["step"], origin["pass"]) == ("1", ARMED_AT, "backward"), origin
    assert "the gradient reaching the output of 1.lin held inf" in origin["how"], origin
    # The bias's gradient sums the inf over the batch and its weight's multiplies it by inputs of both
    # signs: NaN, after the inf; it comes from the inf, and no message says every gradient before was finite.
    assert "held NaN made from that inf" in origin["how"], origin["how"]


# ---- family 2: any output structure ---------------------------------------------------------


@dataclasses.dataclass
class DataOut:
    hidden: torch.Tensor
    note: str = "plain dataclass"


class TupleOut(NamedTuple):
    hidden: torch.Tensor
    extra: int


class Registered:
    """A user's container registered with torch's pytree utilities (not named by the issue)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


pytree.register_pytree_node(
    Registered, lambda r: ([r.hidden], None), lambda leaves, _: Registered(leaves[0]),
)


class Box:
    """A container the trace cannot look into."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


def model_output_type() -> type:
    transformers = pytest.importorskip("transformers")

    @dataclasses.dataclass
    class HiddenOutput(transformers.utils.ModelOutput):
        hidden: torch.Tensor | None = None

    return HiddenOutput


WRAPS: dict[str, tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]] = {
    "dataclass": (lambda h: DataOut(h), lambda o: o.hidden),
    "namedtuple": (lambda h: TupleOut(h, 1), lambda o: o.hidden),
    "nested": (lambda h: {"layers": [{"out": (h, None)}]}, lambda o: o["layers"][0]["out"][0]),
    "ordered_dict": (lambda h: OrderedDict(hidden=h), lambda o: o["hidden"]),
    "pytree_registered": (lambda h: Registered(h), lambda o: o.hidden),
}


class Inner(nn.Module):
    """Makes a NaN in its own code when armed, and returns it wrapped."""

    def __init__(self, wrap: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.wrap = wrap
        self.armed = False

    def forward(self, x: torch.Tensor) -> Any:
        y = self.lin(x)
        return self.wrap(y * float("nan") if self.armed else y)


class Outer(nn.Module):
    def __init__(self, inner: nn.Module, unwrap: Callable[[Any], torch.Tensor]) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.inner = inner
        self.unwrap = unwrap
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.unwrap(self.inner(self.emb(tokens))))


def train_outer(model: Outer, inner: Inner, g: torch.Generator) -> zeroscan.Report:
    return train_tokens(model, g, lambda on: setattr(inner, "armed", on))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("structure", [*sorted(WRAPS), "model_output"])
def test_a_nan_returned_in_any_structure_is_seen(structure: str, compiled: bool) -> None:
    if structure == "model_output":
        output_type = model_output_type()
        wrap, unwrap = (lambda h: output_type(hidden=h)), (lambda o: o.hidden)
    else:
        wrap, unwrap = WRAPS[structure]
    g = fresh_generator()
    inner = Inner(wrap)
    model = Outer(torch.compile(inner, backend="eager") if compiled else inner, unwrap)
    origin = train_outer(model, inner, g).nonfinite_origin
    assert origin is not None and (origin["name"], origin["step"]) == ("inner", ARMED_AT), origin
    assert origin["how"].startswith("inner returned NaN"), origin


def test_a_structure_the_trace_cannot_see_is_said() -> None:
    g = fresh_generator()
    inner = Inner(Box)
    origin = train_outer(Outer(inner, lambda o: o.hidden), inner, g).nonfinite_origin
    assert origin is not None and origin["name"] == "(model)", origin
    assert "could not look into what inner returned: a Box" in origin["how"], origin
    assert "every module before returned finite values" not in origin["how"], origin


class KwargsTaker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, *, extra: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        return self.lin(x + extra["terms"][0])


class KwargsCaller(nn.Module):
    """Makes a NaN in its own code and passes it, inside kwargs, to its child."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.taker = KwargsTaker()
        self.head = nn.Linear(WIDTH, VOCAB)
        self.armed = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        term = x * float("nan") if self.armed else x * 0.5
        return self.head(self.taker(x, extra={"terms": [term]}))


def test_a_nan_in_kwargs_is_seen() -> None:
    g = fresh_generator()
    model = KwargsCaller()
    origin = train_tokens(model, g, lambda on: setattr(model, "armed", on)).nonfinite_origin
    assert origin is not None and origin["name"] == "(model)", origin
    assert "called taker with NaN in kwargs['extra']['terms'][0]" in origin["how"], origin


# ---- family 3: passes that no backward follows ----------------------------------------------


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(WIDTH, WIDTH)
        self.bad = Bad()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bad(torch.tanh(self.emb(x))))


def poisoned(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[0, 0] = float("nan")
    return x


def validation_with_grad(model: nn.Module, x: torch.Tensor) -> None:
    model(poisoned(x)).sum()  # a metric, computed with grad on, no backward


def generation_loop(model: nn.Module, x: torch.Tensor) -> None:
    state = poisoned(x)
    for _ in range(3):  # each output feeds the next call; nothing is backpropagated
        state = nn.functional.pad(torch.tanh(model(state)), (0, WIDTH - VOCAB))


def dropped_after_exception(model: nn.Module, x: torch.Tensor) -> None:
    try:
        loss = model(poisoned(x)).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError("non-finite loss: batch skipped")
    except FloatingPointError:
        pass


def probe_of_features(model: nn.Module, x: torch.Tensor) -> None:
    """Not named by the issue: a submodule called from outside the model (a
    feature probe), with grad on, on a poisoned batch; its output is dropped."""
    model.emb(poisoned(x)).norm()


DEAD_PASSES: dict[str, Callable[[nn.Module, torch.Tensor], None]] = {
    "validation_with_grad": validation_with_grad,
    "generation_loop": generation_loop,
    "dropped_after_exception": dropped_after_exception,
    "submodule_probe": probe_of_features,
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dead", sorted(DEAD_PASSES))
def test_a_pass_no_backward_follows_is_not_merged(dead: str, compiled: bool) -> None:
    g = fresh_generator()
    model = Plain()
    if compiled:
        model.head = torch.compile(model.head, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = zeroscan.Monitor(model, opt, trace_nonfinite=True)
    for step in range(STEPS):
        x = torch.randn(4, WIDTH, generator=g)
        DEAD_PASSES[dead](model, x)
        model.bad.armed = step == ARMED_AT
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.bad.armed = False
    report = monitor.report()
    assert_named_at_bad(report)
    # The dropped passes are not counted among the step's passes either.
    (finding,) = [f for f in report.findings if f.cause == "nonfinite_origin"]
    assert report.nonfinite_origin["micro_batch"] == 0 and "(forward pass" not in finding.message, finding.message  # type: ignore[index]


def test_two_passes_one_backward_are_both_kept() -> None:
    """A siamese step: two forward passes, one loss, one backward. The NaN of
    the second pass is named in pass 2 of 2."""
    g = fresh_generator()
    model = Plain()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = zeroscan.Monitor(model, opt, trace_nonfinite=True)
    for step in range(STEPS):
        a, b = torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)
        first = model(a)
        model.bad.armed = step == ARMED_AT
        second = model(b)
        model.bad.armed = False
        opt.zero_grad()
        (first - second).square().mean().backward()
        opt.step()
    report = monitor.report()
    assert_named_at_bad(report)
    assert report.nonfinite_origin["micro_batch"] == 1  # type: ignore[index]
    (finding,) = [f for f in report.findings if f.cause == "nonfinite_origin"]
    assert "(forward pass 2 of 2)" in finding.message, finding.message


# ---- family 4: deep graphs ------------------------------------------------------------------

DEEP_SCRIPT = """
    import sys, weakref, torch, zeroscan
    from torch import nn
    calls, nan_at, compiled = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "compiled"

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.Linear(8, 8)
            self.head = nn.Linear(8, 1)
            self.side = nn.Linear(8, 1)  # cut off by .detach(): the cause analysis asks the graph why
            self.poison_call = -1

        def forward(self, x):
            h = x
            for k in range(calls):
                h = torch.tanh(self.cell(h))
                if k == self.poison_call:
                    h = h * float("nan")  # born in the model's own code, between two cell calls
            return self.head(h) + self.side(x).detach()

    model = Model()
    if compiled:
        model.cell = torch.compile(model.cell, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = zeroscan.Monitor(model, opt, trace_nonfinite=True)
    kept = []
    for step in range(3):
        model.poison_call = nan_at if step == 2 else -1
        out = model(torch.randn(2, 8))
        kept.append(weakref.ref(out))
        opt.zero_grad()
        out.sum().backward()
        opt.step()
        del out
    assert kept[0]() is None and kept[1]() is None, "a graph outlived its step"
    report = monitor.report()
    print(str(report).replace("\\n", " "), file=sys.stderr)
    print(report.nonfinite_origin)
"""


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_twenty_thousand_calls_per_forward(compiled: bool) -> None:
    """Three traced steps of a 60,000-node graph (the trace's hooks, the
    Monitor's graph walks for a parameter cut off by .detach(), a graph freed
    each step) in a process of its own; the NaN planted at call 15,000 of the
    last step is named in the forward pass."""
    nan_at = 15_000  # past the gradient hooks' cap: forward flags still see it
    proc = run_python(DEEP_SCRIPT, "20000", str(nan_at), "compiled" if compiled else "eager", timeout=600)
    assert proc.returncode == 0, ended(proc) + proc.stderr[-3000:]
    origin = eval(proc.stdout.strip().splitlines()[-1])  # noqa: S307  our own script's dict
    assert (origin["name"], origin["step"], origin["pass"]) == ("(model)", 2, "forward"), origin
    assert "called cell with NaN" in origin["how"], origin


def test_a_dropped_pass_does_not_count_as_made() -> None:
    """A pass no backward reached is let go with its flags: across ranks, the
    exchange (born_words) must not say this rank made inf/NaN because of it."""
    g = fresh_generator()
    model = Plain()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = zeroscan.Monitor(model, opt, trace_nonfinite=True)
    trace = monitor._trace
    assert trace is not None
    trace.exchanging = True
    for dead in (False, True):
        x = torch.randn(4, WIDTH, generator=g)
        if dead:
            validation_with_grad(model, x)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        assert trace.born_words(0, 2, torch.device("cpu")).tolist() == [2, -1]
    assert [len(s.passes) for t in trace.steps for s in t.segments] == [1, 1]


def test_flags_clear_exactly_the_slots_given() -> None:
    """Flags.clear zeroes runs of slots within a buffer and across the boundary
    of two, and nothing else."""
    from zeroscan.monitor.nonfinite_trace import CHUNK, Flags

    flags = Flags()
    bad = torch.tensor([float("nan")])
    slots = [flags.mark(bad) for _ in range(CHUNK + 40)]
    cleared = {5, *range(CHUNK - 10, CHUNK + 10), CHUNK + 39}
    flags.clear([s for s in slots if s in cleared])
    values = torch.cat([flags.buffers[(torch.device("cpu"), k)] for k in range(2)])[: len(slots)]
    assert [s for s in slots if int(values[s]) == 0] == sorted(cleared)
