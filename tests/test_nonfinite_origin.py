"""Monitor(trace_nonfinite=True): each planted birth of inf/NaN (nan_plants.py)
is named with its step, pass and module, in a transformer and a CNN, and
compared with what torch.autograd.detect_anomaly says of the same step; a
healthy run gives no finding; the trace reads nothing back during a step,
keeps nothing alive and travels with no saved model.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
import re
import warnings
import weakref

import pytest
import torch
from torch import nn

import zeroscan
from helpers import fresh_generator
from nan_plants import CASES, PLANTS, Plant, arm, batch, loss_of, make_model
from steps import DeviceWaits, host_reads_refused
from zeroscan.monitor.nonfinite_origin import Origin

STEPS = 10


def origin_findings(report: zeroscan.Report) -> list[zeroscan.Finding]:
    return [f for f in report.findings if f.cause == "nonfinite_origin"]


def train(
    model: nn.Module, kind: str, g: torch.Generator, fault: str | None, fault_step: int, *,
    steps: int = STEPS, monitor: dict | None = None, micro_batches: int = 1,
) -> zeroscan.Report:
    """`steps` SGD steps under Monitor(trace_nonfinite=True); the fault is armed
    for step `fault_step` only (its last micro-batch, with several)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = zeroscan.Monitor(model, opt, trace_nonfinite=True, **(monitor or {}))
    for step in range(steps):
        opt.zero_grad()
        for micro in range(micro_batches):
            inputs, targets = batch(kind, g)
            now = fault if step == fault_step and micro == micro_batches - 1 else None
            inputs = arm(model, kind, now, inputs)
            loss_of(model, inputs, targets, outside=now == "loss_outside").backward()
        arm(model, kind, None, inputs)
        opt.step()
    report = mon.report()
    mon.close()
    return report


@pytest.mark.parametrize("fault,kind", CASES)
def test_planted_origin_is_named(fault: str, kind: str) -> None:
    g = fresh_generator()
    fault_step = int(torch.randint(1, STEPS - 1, (), generator=g))
    report = train(make_model(kind, g), kind, g, fault, fault_step)
    want = PLANTS[fault][1][kind]
    origin = report.nonfinite_origin
    assert origin is not None, report
    assert (origin["step"], origin["pass"], origin["name"]) == (fault_step, want.phase, want.name), origin
    found = origin_findings(report)
    assert len(found) == 1 and found[0].name == want.name, found
    assert f"born at step {fault_step}, in the {want.phase} pass" in found[0].message
    # The finding about the gradients themselves points at it instead of repeating it.
    pointing = [f for f in report.findings if f.cause in ("nonfinite", "skipped_steps")]
    assert pointing and all("nonfinite_origin finding" in f.message for f in pointing), report


@pytest.mark.parametrize("kind", ["transformer", "cnn"])
def test_a_healthy_run_has_no_origin(kind: str) -> None:
    g = fresh_generator()
    report = train(make_model(kind, g), kind, g, None, -1)
    assert report.nonfinite_origin is None
    assert not origin_findings(report)
    assert all(f.cause != "nonfinite" for f in report.findings)


@pytest.mark.parametrize("kind", ["transformer", "cnn"])
def test_origin_at_an_unmonitored_step(kind: str) -> None:
    """every=4 scans steps 0, 4, 8: a fault at step 5 is still dated step 5."""
    g = fresh_generator()
    report = train(make_model(kind, g), kind, g, "log_zero", 5, monitor={"every": 4})
    assert report.nonfinite_origin is not None and report.nonfinite_origin["step"] == 5


def test_which_micro_batch() -> None:
    g = fresh_generator()
    report = train(make_model("transformer", g), "transformer", g, "sqrt_at_zero", 3, micro_batches=3)
    origin = report.nonfinite_origin
    assert origin is not None
    assert (origin["step"], origin["micro_batch"], origin["pass"]) == (3, 2, "backward")
    assert "(forward pass 3 of 3)" in origin_findings(report)[0].message


def test_gradscaler_skipped_step_gets_its_origin() -> None:
    g = fresh_generator()
    model = make_model("transformer", g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    mon = zeroscan.Monitor(model, opt, trace_nonfinite=True)
    for step in range(6):
        inputs, targets = batch("transformer", g)
        arm(model, "transformer", "sqrt_at_zero" if step == 2 else None, inputs)
        opt.zero_grad()
        scaler.scale(loss_of(model, inputs, targets)).backward()
        scaler.step(opt)
        scaler.update()
    report = mon.report()
    assert report.nonfinite_origin is not None
    assert (report.nonfinite_origin["step"], report.nonfinite_origin["pass"]) == (2, "backward")
    assert report.nonfinite_origin["name"] == "blocks.1.mlp.0"
    skipped = [f for f in report.findings if f.cause == "skipped_steps"]
    assert skipped and "nonfinite_origin finding" in skipped[0].message
    assert origin_findings(report)[0].severity == zeroscan.Severity.INFO  # skipped, not applied


def test_guarded_step_gets_its_origin() -> None:
    g = fresh_generator()
    model = make_model("cnn", g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = zeroscan.Monitor(model, opt, trace_nonfinite=True)
    zeroscan.guard(opt)
    for step in range(6):
        inputs, targets = batch("cnn", g)
        inputs = arm(model, "cnn", "divide_by_zero_norm" if step == 3 else None, inputs)
        opt.zero_grad()
        loss_of(model, inputs, targets).backward()
        arm(model, "cnn", None, inputs)
        opt.step()
    report = mon.report()
    assert report.nonfinite_origin is not None
    assert (report.nonfinite_origin["step"], report.nonfinite_origin["name"]) == (3, "plant")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def anomaly_site(model: nn.Module, kind: str, fault: str, g: torch.Generator) -> tuple[str, str] | None:
    """What detect_anomaly says of one step with the fault: the backward
    function it names and the forward traceback it prints, or None if it
    raises nothing."""
    inputs, targets = batch(kind, g)
    inputs = arm(model, kind, fault, inputs)
    with warnings.catch_warnings(record=True) as caught, torch.autograd.detect_anomaly():
        warnings.simplefilter("always")
        try:
            loss_of(model, inputs, targets, outside=fault == "loss_outside").backward()
        except RuntimeError as err:
            name = re.search(r"Function '(\w+)' returned", str(err))
            trace = "\n".join(str(w.message) for w in caught if "Traceback of forward call" in str(w.message))
            return (name.group(1) if name else str(err)), trace
        finally:
            arm(model, kind, None, inputs)
    return None


@pytest.mark.parametrize("fault,kind", CASES)
def test_compared_with_detect_anomaly(fault: str, kind: str) -> None:
    """Where a NaN is born in backward, detect_anomaly's culprit was made by
    the module the trace names. Where it is born in forward, detect_anomaly
    (which checks only backward functions' outputs) names a later function,
    outside the planted module: the trace names the module itself."""
    g = fresh_generator()
    model = make_model(kind, g)
    state = copy.deepcopy(model.state_dict())
    want = PLANTS[fault][1][kind]
    site = anomaly_site(model, kind, fault, g)
    model.load_state_dict(state)
    report = train(model, kind, g, fault, 0, steps=1)
    assert report.nonfinite_origin is not None and report.nonfinite_origin["name"] == want.name
    assert site is not None, "detect_anomaly raised nothing"
    function, forward_trace = site
    in_plant = "nan_plants.py" in forward_trace and ("in forward" in forward_trace)
    if fault.startswith("sqrt_at_zero"):
        assert function in ("SqrtBackward0", "PowBackward0"), function
        assert "torch.sqrt((" in forward_trace, forward_trace
    elif fault == "loss_outside":
        assert "loss_of" in forward_trace, forward_trace
    else:  # born in forward: detect_anomaly names a backward function after it
        assert not ("x + torch.log" in forward_trace or "(x - x).norm()" in forward_trace), forward_trace
        assert function not in ("LogBackward0", "DivBackward0"), function
        assert in_plant or "cross_entropy" in forward_trace or function.endswith("Backward0")


def test_flags_are_not_read_during_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    g = fresh_generator()
    model = make_model("transformer", g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = zeroscan.Monitor(model, opt, trace_nonfinite=True)
    with host_reads_refused(monkeypatch) as calls, DeviceWaits() as waits:
        for step in range(3):
            inputs, targets = batch("transformer", g)
            arm(model, "transformer", "log_zero" if step == 1 else None, inputs)
            opt.zero_grad()
            loss_of(model, inputs, targets).backward()
            opt.step()
    arm(model, "transformer", None, inputs)
    assert calls == [] and waits.by_zeroscan() == []
    assert mon.report().nonfinite_origin["step"] == 1


def test_the_monitor_is_freed_and_saves_nothing() -> None:
    g = fresh_generator()
    model = make_model("cnn", g)
    plain = io.BytesIO()
    torch.save(model, plain)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = zeroscan.Monitor(model, opt, trace_nonfinite=True)
    inputs, targets = batch("cnn", g)
    out = loss_of(model, inputs, targets)  # kept alive: its gradient hooks hold no Monitor
    out.backward()
    opt.step()
    saved = io.BytesIO()
    torch.save(model, saved)
    assert b"zeroscan" not in saved.getvalue()
    assert len(pickle.dumps(model.state_dict())) == len(pickle.dumps(torch.load(io.BytesIO(plain.getvalue()), weights_only=False).state_dict()))
    ref = weakref.ref(mon)
    del mon
    gc.collect()
    assert ref() is None
    assert all(not p._backward_hooks for p in model.parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_module_added_mid_run_is_traced() -> None:
    g = fresh_generator()
    model = make_model("cnn", g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = zeroscan.Monitor(model, opt, trace_nonfinite=True)
    for step in range(5):
        if step == 2:
            model.plant = nn.Sequential(Plant(), nn.Identity())  # a new module where the old one was
        inputs, targets = batch("cnn", g)
        if step == 3:
            model.plant[0].fault = "log_zero"
        opt.zero_grad()
        loss_of(model, inputs, targets).backward()
        if step >= 2:
            model.plant[0].fault = None
        opt.step()
    origin = mon.report().nonfinite_origin
    assert origin is not None and (origin["step"], origin["name"]) == (3, "plant.0")


def test_origin_record_words() -> None:
    o = Origin(7, "forward", 0, 1, "blocks.0.attn", "activation", 3, "x")
    assert o.to_dict()["values"] == "NaN and inf" and o.to_dict()["pass"] == "forward"


def test_trace_nonfinite_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="trace_nonfinite must be True or False, got 1"):
        zeroscan.Monitor(nn.Linear(2, 2), trace_nonfinite=1)


def test_the_attention_mask_example() -> None:
    """examples/nan_in_attention_mask.py: a fully masked softmax row at step 7."""
    from helpers import example, fresh_seed

    report = example("nan_in_attention_mask").run(seed=fresh_seed(2**31))
    origin = report.nonfinite_origin
    assert origin is not None
    assert (origin["step"], origin["pass"], origin["name"], origin["values"]) == (7, "forward", "blocks.0.attn", "NaN")
    assert "called blocks.0.attn.proj with NaN" in origin["how"]


class Raises(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("caught by its caller")


class CatchesAndMakesInf(nn.Module):
    """Calls a child that raises and catches it, then makes -inf in its own code."""

    def __init__(self) -> None:
        super().__init__()
        self.raises = Raises()
        self.lin = nn.Linear(4, 4)
        self.fault = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            self.raises(x)
        except ValueError:
            pass
        if self.fault:
            x = x + torch.log(torch.zeros_like(x))
        return self.lin(x)


def test_a_caught_exception_in_a_child_keeps_the_calls_straight() -> None:
    model = nn.Sequential(nn.Linear(4, 4), CatchesAndMakesInf(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = zeroscan.Monitor(model, opt, trace_nonfinite=True)
    for step in range(4):
        model[1].fault = step == 2
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    origin = mon.report().nonfinite_origin
    assert origin is not None
    assert (origin["step"], origin["pass"], origin["name"]) == (2, "forward", "1"), origin
    assert "1 called 1.lin with inf" in origin["how"], origin
