"""Monitor(trace_nonfinite=True) on torch.compile'd models.

The trace stops at a compiled module's boundary (nonfinite_trace.traced_modules):
the OptimizedModule gets the hooks, nothing inside it does, so a NaN born
inside is named at that boundary, and the trace adds no graph break. The
Monitor's probe watches its first monitored forward pass eagerly (a graph
break per op, by design: test_monitor_causes.py), so graph breaks are
counted apart for that first step and for the steps after it.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from zeroscan import Cause, Monitor
from zeroscan.monitor import nonfinite_trace
from zeroscan.monitor.nonfinite_trace import traced_modules

pytestmark = pytest.mark.usefixtures("one_thread")

BACKEND = "eager"
NAN_AT = 2  # the optimizer step (from 0, as the Monitor counts) whose forward makes the NaN
STEPS = 4


class NaNScale(nn.Module):
    """Multiplies by a buffer, 1 unless a test fills it with NaN: the value is
    data, so planting it recompiles nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.Tanh()
        self.nan = NaNScale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nan(self.act(self.fc(x)))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.block = Block()
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.inp(x)))


def build(how: str) -> tuple[nn.Module, MLP]:
    """(what is trained and monitored, the plain MLP inside it): the MLP as it
    is ("none"), compiled as a whole ("whole"), or with its block compiled ("child")."""
    torch.manual_seed(0)
    mlp = MLP()
    if how == "whole":
        return torch.compile(mlp, backend=BACKEND), mlp
    if how == "child":
        mlp.block = torch.compile(mlp.block, backend=BACKEND)  # type: ignore[assignment]
    return mlp, mlp


def planted(mlp: MLP) -> NaNScale:
    block = mlp.block
    inner = getattr(block, "_orig_mod", block)
    return inner.nan


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


# The name the origin is given: the planted module itself where nothing is compiled,
# else the compiled module that holds it.
BORN_IN = {"none": "block.nan", "whole": "(model)", "child": "block"}


@pytest.mark.parametrize("how", sorted(BORN_IN))
def test_a_nan_born_inside_a_compiled_module_is_named_at_its_boundary(how: str) -> None:
    torch._dynamo.reset()
    model, mlp = build(how)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    with Monitor(model, opt, trace_nonfinite=True) as monitor:
        origins = []
        for step in range(STEPS):
            planted(mlp).scale.fill_(float("nan") if step == NAN_AT else 1.0)
            train_step(model, opt, torch.randn(5, 4, generator=g))
            origins.append(monitor.report().nonfinite_origin)
        report = monitor.report()
    assert monitor.steps_seen == STEPS
    assert origins[:NAN_AT] == [None] * NAN_AT  # finite until the planted step
    assert all(o == report.nonfinite_origin for o in origins[NAN_AT:]), origins
    origin = report.nonfinite_origin
    assert origin is not None, str(report)
    assert (origin["name"], origin["pass"], origin["step"]) == (BORN_IN[how], "forward", NAN_AT), origin
    assert (origin["kind"], origin["values"]) == ("activation", "NaN"), origin
    assert origin["how"].startswith(f"{BORN_IN[how]} returned NaN while its inputs were finite"), origin
    (finding,) = [f for f in report.findings if f.cause == Cause.NONFINITE_ORIGIN]
    assert finding.name == BORN_IN[how], str(report)
    assert f"NaN was born at step {NAN_AT}, in the forward pass" in finding.message, finding.message


def test_the_trace_hooks_a_compiled_child_at_its_boundary_only() -> None:
    model, mlp = build("child")
    assert [name for name, _ in traced_modules(model)] == ["(model)", "inp", "block", "out"]
    compiled = mlp.block
    inside = list(compiled._orig_mod.modules())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Monitor(model, opt, trace_nonfinite=True):
        train_step(model, opt, torch.randn(5, 4))  # the probe, which hooks every module, is gone after it
        assert compiled._forward_pre_hooks and compiled._forward_hooks
        assert [m for m in inside if m._forward_pre_hooks or m._forward_hooks] == []
    assert not compiled._forward_pre_hooks and not compiled._forward_hooks  # close() removed them


class Breaks:
    """Graph breaks and graphs dynamo made in a run: in the first (probed)
    step, and in the steps after it."""

    def __init__(self) -> None:
        self.first = self.first_graphs = self.later = self.later_graphs = 0

    def __repr__(self) -> str:
        return (
            f"Breaks(first={self.first}, first_graphs={self.first_graphs}, "
            f"later={self.later}, later_graphs={self.later_graphs})"
        )


def count_breaks(how: str, monitor: dict[str, bool] | None, steps: int = 3) -> Breaks:
    """Trains build(how) `steps` steps, with a Monitor(**monitor) or none."""
    torch._dynamo.reset()
    counters.clear()
    model, _ = build(how)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watching = Monitor(model, opt, **monitor) if monitor is not None else None
    g = torch.Generator().manual_seed(1)
    out = Breaks()
    try:
        train_step(model, opt, torch.randn(5, 4, generator=g))
        out.first = sum(counters["graph_break"].values())
        out.first_graphs = counters["stats"]["unique_graphs"]
        counters.clear()
        for _ in range(steps - 1):
            train_step(model, opt, torch.randn(5, 4, generator=g))
        out.later = sum(counters["graph_break"].values())
        out.later_graphs = counters["stats"]["unique_graphs"]
    finally:
        if watching is not None:
            watching.close()
    return out


def every_module(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """What traced_modules would return if the trace went inside compiled modules."""
    return [(name or "(model)", module) for name, module in model.named_modules()]


@pytest.mark.parametrize("how", ["whole", "child"])
def test_the_trace_adds_no_graph_break(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    without = count_breaks(how, None)
    plain = count_breaks(how, {"trace_nonfinite": False})
    traced = count_breaks(how, {"trace_nonfinite": True})
    # Without a Monitor: one graph, compiled at the first step, and no break.
    assert (without.first, without.first_graphs, without.later, without.later_graphs) == (0, 1, 0, 0), without
    # The probed first step runs eagerly, a break per op (the Monitor's own, with or
    # without the trace); the steps after it compile one graph without a break, as
    # the first step does without a Monitor.
    assert (traced.first, traced.first_graphs) == (plain.first, plain.first_graphs), (traced, plain)
    assert (traced.later, traced.later_graphs) == (plain.later, plain.later_graphs) == (0, 1), (traced, plain)
    # What the count would show were the trace to hook the modules inside the compiled region.
    monkeypatch.setattr(nonfinite_trace, "traced_modules", every_module)
    inside = count_breaks(how, {"trace_nonfinite": True})
    assert inside.later > 0, inside

