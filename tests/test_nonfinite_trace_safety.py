"""Monitor(trace_nonfinite=True) inside training loops that do unusual
things: parameters and long-lived leaves passed as arguments, gradient
penalties, graphs kept across steps, inference tensors, a module held twice,
modules compiled in place, reports before and after close(), skipped steps
before the one that mattered. None may break training, collect hooks or
memory step after step, or mislead the report.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroscan
from helpers import fresh_generator
from nan_plants import Plant


class TakesItsOwnWeight(nn.Module):
    """Passes a parameter to a submodule as an argument (DETR's query embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(3, 4))
        self.mix = Mix()
        self.plant = Plant()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.plant(self.mix(x, self.queries))


class Mix(nn.Module):
    def forward(self, x: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        return x @ queries.t()


def hook_count(*tensors: torch.Tensor) -> int:
    return sum(len(t._backward_hooks or {}) for t in tensors)


def test_parameters_and_long_lived_leaves_as_arguments() -> None:
    """Backward after the step closed, graphs kept, leaves that live across
    steps: no error, and no hook piles up on them."""
    g = fresh_generator()
    model = TakesItsOwnWeight()
    points = torch.randn(5, 4, generator=g, requires_grad=True)  # a PINN's collocation points
    opt = torch.optim.SGD([*model.parameters(), points], lr=0.01)
    mon = zeroscan.Monitor(model, opt, trace_nonfinite=True)
    hooks_after_one = None
    for step in range(5):
        opt.zero_grad()
        out = model(points)
        (grad,) = torch.autograd.grad(out.sum(), points, create_graph=True)  # a gradient penalty
        loss = out.square().mean() + grad.square().mean()
        loss.backward(retain_graph=True)
        loss.backward()  # the same graph again
        opt.step()
        if step == 0:
            hooks_after_one = hook_count(model.queries, points)
    assert hook_count(model.queries, points) == hooks_after_one
    assert mon.report().nonfinite_origin is None
    mon.close()
    assert hook_count(model.queries, points) == 0


def test_two_forward_passes_then_two_backward_passes() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = zeroscan.Monitor(model, opt, trace_nonfinite=True)
    for _ in range(3):
        opt.zero_grad()
        a, b = model(torch.randn(2, 4)), model(torch.randn(2, 4))
        a.sum().backward()
        b.sum().backward()
        opt.step()
    assert mon.report().nonfinite_origin is None


def test_inference_tensors_as_inputs() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = zeroscan.Monitor(model, opt, trace_nonfinite=True)
    with torch.inference_mode():
        cached = torch.randn(2, 4)
    for _ in range(2):
        opt.zero_grad()
        model[1](cached)  # an inference tensor given to a module while grad mode is on
        model(torch.randn(2, 4) + cached).sum().backward()
        opt.step()
    assert mon.report().nonfinite_origin is None


def test_nothing_grows_without_a_process_group_and_reports_rehook_nothing() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = zeroscan.Monitor(model, opt, trace_nonfinite=True, history=4)
    for _ in range(20):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        mon.report()
    trace = mon._trace
    assert trace is not None and len(trace.steps) <= 4 and trace._unexchanged == []
    ids = [sorted(m._forward_pre_hooks) for m in model.modules()]
    mon.report()
    assert [sorted(m._forward_pre_hooks) for m in model.modules()] == ids  # report() registered nothing
    mon.close()
    mon.report()
    model(torch.randn(2, 4)).sum().backward()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert all(not p._backward_hooks for p in model.parameters())


def test_every_ten_steps_still_dates_the_birth() -> None:
    """history=4 monitored steps of every=10 span 40 steps: the trace keeps them all."""
    model = nn.Sequential(nn.Linear(4, 4), Plant(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = zeroscan.Monitor(model, opt, trace_nonfinite=True, every=10, history=4)
    for step in range(21):
        model[1].fault = "log_zero" if step == 3 else None
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    origin = mon.report().nonfinite_origin
    assert origin is not None and (origin["step"], origin["name"]) == (3, "1")


def test_a_module_held_twice_is_traced_once() -> None:
    shared = nn.Tanh()
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), shared), nn.Sequential(shared, Plant(), nn.Linear(4, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = zeroscan.Monitor(model, opt, trace_nonfinite=True)
    # As many pre-hooks as a module held once (the trace's and the cause probe's), not twice the trace's.
    assert len(shared._forward_pre_hooks_with_kwargs) == len(model[0][0]._forward_pre_hooks_with_kwargs) == 2
    for step in range(3):
        model[1][1].fault = "divide_by_zero_norm" if step == 1 else None
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    origin = mon.report().nonfinite_origin
    assert origin is not None and (origin["step"], origin["name"]) == (1, "1.1")


def test_a_module_compiled_in_place_is_not_hooked() -> None:
    from zeroscan.monitor.nonfinite_trace import traced_modules

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Tanh(), nn.Linear(4, 4)), nn.Linear(4, 1))
    model[1].compile(backend="eager")
    assert [name for name, _ in traced_modules(model)] == ["(model)", "0", "2"]


@pytest.mark.parametrize("skip", ["scaler_like", "guard"])
def test_the_birth_that_was_applied_is_named_not_an_earlier_skipped_one(skip: str) -> None:
    """Step 1 makes inf and is skipped (harmless); step 4 makes NaN that the
    optimizer applies: the finding names step 4, as an error."""
    model = nn.Sequential(nn.Linear(4, 4), Plant(), nn.Tanh(), Plant(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = zeroscan.Monitor(model, opt, trace_nonfinite=True)
    if skip == "guard":
        zeroscan.guard(opt)
    for step in range(6):
        model[1].fault = "log_zero" if step == 1 else None
        model[3].fault = "sqrt_at_zero" if step == 4 else None
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        if step == 1 and skip == "scaler_like":
            opt.zero_grad()  # a check of one's own: no step on inf gradients
            continue
        if step == 4 and skip == "guard":
            with torch.no_grad():
                model[0].weight.fill_(float("nan"))  # step 4 applied: the weights take it (guard cannot undo this)
        opt.step()
    report = mon.report()
    origin = report.nonfinite_origin
    assert origin is not None and (origin["step"], origin["pass"], origin["name"]) == (4, "backward", "3"), origin
    (finding,) = [f for f in report.findings if f.cause == "nonfinite_origin"]
    assert finding.severity == zeroscan.Severity.ERROR


class DetachesInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 6)
        self.b = nn.Linear(6, 4)
        self.c = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(torch.tanh(self.a(x)).detach()))


@pytest.mark.parametrize("trace", [False, True], ids=["untraced", "traced"])
def test_the_traces_own_hooks_are_not_named_as_cuts(trace: bool) -> None:
    """The trace's hooks read each module's output: a detach the model makes
    is named where it is, in the model's own forward, and nowhere else."""
    g = fresh_generator()
    model = DetachesInside()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = zeroscan.Monitor(model, opt, trace_nonfinite=trace)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(7, 5, generator=g)).square().mean().backward()
        opt.step()
    (f,) = [f for f in monitor.report().findings if f.cause == "detached"]
    assert set(f.names) == {"a.weight", "a.bias"}, f.message
    assert ".detach() in the model (DetachesInside);" in f.message, f.message
    assert "(Linear)" not in f.message, f.message
