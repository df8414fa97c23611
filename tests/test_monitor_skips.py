"""Steps that did not train, as the Monitor reports them: every step skipped
for inf/NaN gradients shows with its step number and where the values were,
whoever skipped it (zeroscan.guard, a GradScaler, a check of the user's own);
and a report made before anything ran says so once."""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

import zeroscan
from helpers import fresh_generator
from steps import batches, loss_of, make_model
from zeroscan import Cause, Monitor, Severity

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

# Which gradient holds the bad value at a bad step: parameter name -> how it is reached.
TARGETS = {"2.weight": lambda m: m[2].weight, "4.bias": lambda m: m[4].bias, "0.weight": lambda m: m[0].weight}


def skip_by_guard(opt: torch.optim.Optimizer, model: nn.Module, bad: bool) -> None:
    opt.step()  # zeroscan.guard, installed on opt, makes a bad step a no-op


def skip_by_own_check(opt: torch.optim.Optimizer, model: nn.Module, bad: bool) -> None:
    if all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None):
        opt.step()


def skip_by_scaler(opt: torch.optim.Optimizer, model: nn.Module, bad: bool) -> None:
    scaler = opt.scaler  # type: ignore[attr-defined]
    scaler.step(opt)
    scaler.update()


@contextmanager
def nan_in_backward(param: torch.Tensor | None, value: float = float("nan")) -> Iterator[None]:
    """Backward computes `value` into the first entry of param's gradient, as
    an overflow in backward would (a change after backward is another story)."""
    if param is None:
        yield
        return
    handle = param.register_hook(lambda grad: grad.flatten().index_fill(0, torch.tensor([0]), value).view_as(grad))
    try:
        yield
    finally:
        handle.remove()


SKIPPERS = {"guard": skip_by_guard, "own check": skip_by_own_check, "GradScaler": skip_by_scaler}


@pytest.mark.parametrize("set_to_none", [True, False], ids=["let go", "zeroed in place"])
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("skipper", SKIPPERS)
@pytest.mark.parametrize("every", [1, 2])
def test_every_skipped_step_shows_with_where_its_values_were(
    skipper: str, fused: bool, every: int, set_to_none: bool
) -> None:
    """Whether the loop lets its gradients go (read after the reset) or
    zeroes them in place (read when backward ends): monitor/deferred.py."""
    g = fresh_generator()
    model = make_model(g)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
    if skipper == "guard":
        zeroscan.guard(opt, names=model)
    if skipper == "GradScaler":
        opt.scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1000)  # type: ignore[attr-defined]
    steps = 12
    bad_steps = sorted(int(s) * every for s in torch.randperm(steps // every - 2, generator=g)[:3])
    names = list(TARGETS)
    planted = {step: names[k % len(names)] for k, step in enumerate(bad_steps)}
    monitor = Monitor(model, opt, every=every)
    for step, batch in enumerate(batches(g, steps)):
        opt.zero_grad(set_to_none=set_to_none)
        loss = loss_of(model, batch)
        if skipper == "GradScaler":
            loss = opt.scaler.scale(loss)  # type: ignore[attr-defined]
        with nan_in_backward(TARGETS[planted[step]](model) if step in planted else None):
            loss.backward()
        SKIPPERS[skipper](opt, model, step in planted)
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the skips kept the weights finite
    report = monitor.report()
    (finding,) = [f for f in report.findings if f.cause == Cause.SKIPPED_STEPS]
    listed = dict(re.findall(r"step (\d+): ([\w.]+)", finding.message))
    assert {int(step): name for step, name in listed.items()} == planted, finding.message
    assert f"skipped at {len(planted)} of {steps // every} monitored steps" in finding.message
    assert f"first appeared at step {bad_steps[0]}, in {planted[bad_steps[0]]}" in finding.message
    assert finding.severity == Severity.INFO  # a few skips, and training goes on
    # How the step was skipped: a GradScaler steps a fused optimizer with found_inf set.
    ran = skipper == "guard" or (skipper == "GradScaler" and fused)
    assert ("zeroscan.guard" in finding.message) == ran and ("did not run" in finding.message) == (not ran)
    assert [f for f in report.findings if f.severity >= Severity.WARNING and f is not finding] == []


def test_a_guard_skip_among_scaler_skips_is_told_apart() -> None:
    g = fresh_generator()
    model = make_model(g)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    zeroscan.guard(opt, names=model)
    monitor = Monitor(model, opt)
    for step, batch in enumerate(batches(g, 8)):
        opt.zero_grad()
        with nan_in_backward(model[2].bias if step in (2, 5) else None, float("inf")):
            loss_of(model, batch).backward()
        if step == 5:
            continue  # the user's own check skips it; at step 2 the guard does
        opt.step()
    (finding,) = [f for f in monitor.report().findings if f.cause == Cause.SKIPPED_STEPS]
    assert "step 2: 2.bias; step 5: 2.bias" in finding.message
    assert "at 1 of them optimizer.step() did not run" in finding.message
    assert "at 1 of them optimizer.step() ran and the weights stayed finite" in finding.message


@pytest.mark.parametrize("zero_grad", ["before forward", "before backward"])
def test_a_skipped_step_is_read_wherever_zero_grad_runs(zero_grad: str) -> None:
    """The gradients of a step that optimizer.step() skipped are read once
    the loop lets them go: at the next forward pass, or at the next backward
    pass when zero_grad() runs between the two (monitor/deferred.py); the
    Monitor holds them no longer than that."""
    g = fresh_generator()
    model = make_model(g)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = Monitor(model, opt)
    held: list[weakref.ref[torch.Tensor]] = []
    for step, batch in enumerate(batches(g, 6)):
        if zero_grad == "before forward":
            opt.zero_grad()
        loss = loss_of(model, batch)
        if zero_grad == "before backward":
            opt.zero_grad()
        with nan_in_backward(model[2].bias if step == 3 else None):
            loss.backward()
        if step == 4:
            assert held and all(ref() is None for ref in held)  # read, and let go
        if step == 3:  # the user's own check skips it; the Monitor holds its gradients
            held = [weakref.ref(p.grad) for p in model.parameters() if p.grad is not None]
            continue
        opt.step()
    (finding,) = [f for f in monitor.report().findings if f.cause == Cause.SKIPPED_STEPS]
    assert "step 3: 2.bias" in finding.message and "skipped at 1 of 6 monitored steps" in finding.message


def test_a_loop_that_starts_zeroing_gradients_in_place_loses_one_skip() -> None:
    """The blind spot of reading gradients at optimizer.step() (monitor/deferred.py):
    the Monitor has seen the loop let go of its gradients, then the gradients of
    a step that optimizer.step() skips are zeroed in place, and by the time it
    learns the step was skipped, its NaN is gone: step 2 reads as a backward
    pass with no step. From then on it reads them when backward ends as well,
    and sees the next skip."""
    g = fresh_generator()
    model = make_model(g)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = Monitor(model, opt)
    for step, batch in enumerate(batches(g, 6)):
        opt.zero_grad(set_to_none=step < 3)
        with nan_in_backward(model[2].bias if step in (2, 4) else None):
            loss_of(model, batch).backward()
        if step in (2, 4):
            continue  # the user's own check skips it
        opt.step()
    (finding,) = [f for f in monitor.report().findings if f.cause == Cause.SKIPPED_STEPS]
    assert "step 4: 2.bias" in finding.message and "step 2" not in finding.message, finding.message
    assert "skipped at 1 of 5 monitored steps" in finding.message


def test_a_step_that_poisoned_the_weights_is_not_called_skipped() -> None:
    g = fresh_generator()
    model = make_model(g)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = Monitor(model, opt)
    for step, batch in enumerate(batches(g, 4)):
        opt.zero_grad()
        with nan_in_backward(model[2].bias if step == 1 else None):
            loss_of(model, batch).backward()
        opt.step()
    report = monitor.report()
    assert not [f for f in report.findings if f.cause == Cause.SKIPPED_STEPS]
    assert ("2.bias", "weight", Cause.NONFINITE) in {(f.name, f.kind, f.cause) for f in report.detailed}


# ---- a report before anything ran ---------------------------------------------------


def forward_only(model: nn.Module, g: torch.Generator) -> torch.Tensor | None:
    x = torch.randn(4, 6, generator=g)
    model(x)
    return x


def forward_without_grad(model: nn.Module, g: torch.Generator) -> torch.Tensor | None:
    x = torch.randn(4, 6, generator=g)
    with torch.no_grad():
        model(x)
    return x


def nothing(model: nn.Module, g: torch.Generator) -> torch.Tensor | None:
    return None


BEFORE = {"nothing": nothing, "a forward pass": forward_only, "a forward pass under no_grad": forward_without_grad}


def dead_relu_units(model: nn.Sequential, x: torch.Tensor | None) -> int:
    """How many of the ReLU's units (model[3]) are zero for every row of x."""
    if x is None:
        return 0
    with torch.no_grad():
        return int((model[:4](x) == 0).all(dim=0).sum())


@pytest.mark.parametrize("optimizer", [True, False])
@pytest.mark.parametrize("before", BEFORE)
def test_a_report_before_any_step_says_so_once(before: str, optimizer: bool) -> None:
    g = fresh_generator()
    model = make_model(g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer else None
    monitor = Monitor(model, opt, activations=True)
    x = BEFORE[before](model, g)
    report = monitor.report()
    # One warning that nothing trained, and no finding about gradients that never ran.
    # What a forward pass did show stays true: a random batch of 4 can leave half the
    # ReLU's units at zero, and that is told as dead units, counted as the model has them.
    dead = dead_relu_units(model, x)
    expected = [(Cause.NO_STEP, Severity.WARNING)]
    if dead >= 16 * monitor.thresholds.dead_units:
        expected.append((Cause.DEAD_UNITS, Severity.ERROR if dead == 16 else Severity.WARNING))
    assert [(f.cause, f.severity) for f in report.findings] == expected
    assert report.findings[0].message.startswith("nothing has run yet")
    if len(expected) == 2:
        told = f"{dead} of 16 units" if dead < 16 else "all 16 units"
        assert report.findings[1].name == "3" and told in report.findings[1].message


def test_before_any_step_other_facts_still_show() -> None:
    g = fresh_generator()
    model = make_model(g)
    model[4].bias.requires_grad_(False)
    with torch.no_grad():
        model[2].weight[1, 1] = float("nan")  # poisoned before training: never passed over
    monitor = Monitor(model, torch.optim.SGD([model[0].weight, model[0].bias, model[2].weight], lr=0.1))
    got = {(f.name, f.cause) for f in monitor.report().detailed}
    assert got == {
        ("(all parameters)", Cause.NO_STEP),
        ("2.weight", Cause.NONFINITE),
        ("4.bias", Cause.FROZEN),
        ("2.bias", Cause.NOT_IN_OPTIMIZER),
        ("4.weight", Cause.NOT_IN_OPTIMIZER),
    }
