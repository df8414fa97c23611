"""The Monitor and the guard where a GPU is what tells: no host sync in a
monitored training step, a training step captured in a CUDA graph with the
Monitor or the guard on and replayed like eager, and a float16 GradScaler's
skipped step.

The GPU tests (marked `cuda_only`) are skipped without CUDA. The CPU tests
check here what can be checked without a GPU: that the Monitor's step path
reads nothing on the host and calls no op that makes a CUDA host wait for
its device (host_reads_refused at the Python level, DeviceWaits at the aten
level), and that a step with a NaN gradient issues exactly the ops of a
clean one, which is what a captured step, replayed on any data, relies on.

What capture means for the Monitor: its Python side (hooks, step count,
records) runs once, while the step is captured; the captured step's record
holds device buffers from the graph's pool, which every replay overwrites
with that replay's scans. Neither the step count nor the ring moves on a
replay.
"""

from __future__ import annotations

import copy
import functools
import math
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import zeroscan
from helpers import DEVICES, fresh_generator, serious
from steps import (
    Batch, DeviceWaits, assert_moved, assert_same, backward, batches, everything, host_reads_refused, loss_of,
    make_model,
)
from zeroscan.guard import GuardReport, SkippedStep, guard
from zeroscan.monitor import Cause, Monitor, Report, Severity, Slot, scanner, step_record
from zeroscan.result_row import Column, decode

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


MONITOR_OPTIONS: dict[str, dict[str, bool]] = {
    "plain": {},
    "activations": {"activations": True},
    "histogram": {"histogram": True},
}
SYNC_STEPS = 4  # steps checked for host reads and syncs: the first (probed) one and three after it
WARMUP, REPLAYS = 3, 3  # the CUDA-graph recipe's eager warm-up steps, then replays of the captured step
# Captured and eager steps run the same kernels on the same data and are expected to agree bit for
# bit; they are compared within a tolerance 1000 times below one SGD/AdamW update, so that a cuBLAS
# algorithm choice that differs on the capture stream cannot fail a test that a skipped, repeated or
# stale step fails by far.
RTOL, ATOL = 1e-5, 1e-6


# ---- models, data, steps ---------------------------------------------------------


def make_net(g: torch.Generator) -> nn.Sequential:
    """Linear, LayerNorm and ReLU layers on the CPU; the Linear weights and
    biases drawn from `g`, LayerNorm at its own init (ones and zeros)."""
    model = nn.Sequential(nn.Linear(6, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.4)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
    return model


def on(device: str, data: list[Batch]) -> list[Batch]:
    return [(x.to(device), y.to(device)) for x, y in data]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> None:
    backward(model, opt, batch)
    opt.step()


def plant_nan(model: nn.Sequential, g: torch.Generator) -> str:
    """A NaN at a random entry of the gradient of 3.weight (the middle Linear); its name."""
    grad = model[3].weight.grad
    assert grad is not None
    grad.view(-1)[int(torch.randint(0, grad.numel(), (), generator=g))] = math.nan
    return "3.weight"


def judged(report: Report) -> list[tuple[str, str, str]]:
    """The WARNING-or-worse findings about parameters, gradients and weights.
    Activation findings are left out: whether a random small net has dead
    ReLU units is no business of these tests."""
    return [(f.name, f.kind, f.cause) for f in serious(report) if f.kind != "activation"]


def swallowed(monitor: Monitor) -> list[tuple[int, list[tuple[str, str]]]]:
    """Errors the Monitor kept as notes instead of raising, per recorded step:
    a scan that raises (a sync refused by the sync debug mode, an op refused
    while capturing) falls back to one scan per device and then becomes a
    "not scanned" note (scanner.py Scanner._run, scanner.scan_by_device), and
    so does one raised in an activation hook (monitor.py Monitor._on_activation)."""
    return [
        (r.step, [*r.notes, *((u.label, u.why) for u in r.unscanned)])
        for r in monitor._log.records
        if r.notes or r.unscanned
    ]


def scanned(params: list[nn.Parameter], slots: list[int], weights: list[Tensor]) -> list[Tensor]:
    """The tensors that a scan group's Slot rows name: a parameter's .grad,
    or its weight as given in `weights` (a copy taken before the update)."""
    out = []
    for slot in map(Slot.at_row, slots):
        grad = params[slot.param].grad
        assert grad is not None or slot.kind == "weight"
        out.append(grad if slot.kind == "grad" else weights[slot.param])
    return out


def assert_rows_like(got: Tensor, want: Tensor, what: str) -> None:
    """Two scans (int64 [N, 16] rows) of tensors that agree to rounding: the
    counts that rounding cannot move exactly, the moments and max |x| within
    RTOL of the tensor's scale (see RTOL)."""
    got_rows, want_rows = decode(got), decode(want)
    assert len(got_rows) == len(want_rows), what
    for k, (a, b) in enumerate(zip(got_rows, want_rows)):
        for field in ("numel", "zeros", "nan", "posinf", "neginf"):
            assert a[field] == b[field], f"{what}, row {k}, {field}: {a[field]} != {b[field]}"
        scale = float(b["norm"]) / math.sqrt(max(1, int(b["finite"])))
        for field in ("norm", "mean", "std", "max_abs"):
            assert abs(float(a[field]) - float(b[field])) <= RTOL * (abs(float(b[field])) + scale), (
                f"{what}, row {k}, {field}: {a[field]!r} != {b[field]!r}"
            )


def assert_all_close(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    """steps.everything() of a captured run and of an eager twin agree (see RTOL)."""
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


# ---- the detectors ---------------------------------------------------------------


class OpLog(TorchDispatchMode):
    """Every aten (and zeroscan) op that runs while it is active, with the
    shapes, dtypes and devices of its outputs: what a CUDA graph captures."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[tuple[tuple[int, ...], torch.dtype, str], ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outputs = tuple((tuple(t.shape), t.dtype, t.device.type) for t in tree_leaves(out) if isinstance(t, Tensor))
        self.ops.append((str(func), outputs))
        return out


def first_difference(a: list[Any], b: list[Any]) -> str:
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"op {k}: {x} != {y}"
    return f"{len(a)} ops != {len(b)} ops"


def sync_error(fn: Callable[[], None]) -> str | None:
    """Runs fn with CUDA's sync debug mode at "error": None, or where fn
    made its first synchronizing call (the error and its innermost frames)."""
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as err:
        if "synchroniz" not in str(err):
            raise
        frames = traceback.extract_tb(err.__traceback__)[-4:]
        return str(err).splitlines()[0] + " at " + " <- ".join(f"{f.filename}:{f.lineno}" for f in reversed(frames))
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return None


# ---- 1. no host sync in a monitored step -------------------------------------------


@pytest.mark.parametrize("options", MONITOR_OPTIONS)
def test_the_monitor_step_path_reads_nothing_on_the_host(options: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward, backward and a fused AdamW step (torch's own fused step reads
    nothing) with the Monitor's hooks, from the first step on: the probed
    forward pass of step 0, its lazy optimizer state, and steps after it."""
    g = fresh_generator()
    model = make_net(g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    data = batches(g, SYNC_STEPS + 1)
    with Monitor(model, opt, **MONITOR_OPTIONS[options]) as monitor:
        for step, batch in enumerate(data[:SYNC_STEPS]):
            with host_reads_refused(monkeypatch) as calls, DeviceWaits() as waits:
                train_step(model, opt, batch)
            assert calls == [], f"step {step}: host reads {calls}"  # also those a probe or hook swallowed
            assert waits.by_zeroscan() == [], f"step {step}: the Monitor waits for the device: {waits.by_zeroscan()}"
            assert waits.seen == [], f"step {step}: the training step waits for the device: {waits.seen}"
        assert swallowed(monitor) == []
        opt.zero_grad()
        loss_of(model, data[-1]).backward()
        name = plant_nan(model, g)
        opt.step()
    report = monitor.report()
    assert report.history["steps"] == list(range(SYNC_STEPS + 1))  # every checked step was scanned
    assert judged(report) == [(name, "grad", Cause.NONFINITE)], str(report)
    assert [(t["name"], t["nan"]) for t in report.tensors if t["kind"] == "grad" and t["nan"]] == [(name, 1)]


@cuda_only
@pytest.mark.parametrize("options", MONITOR_OPTIONS)
def test_a_monitored_cuda_step_adds_no_host_sync(options: str) -> None:
    """Each step runs under CUDA's sync debug mode "error", once for a model
    without a Monitor and once for its copy with one: a sync the Monitor
    adds fails. After step 0, fused AdamW's step itself must not sync (a
    precondition); step 0 (the probed forward, the lazy state) is judged the
    same way wherever the unmonitored step 0 does not sync."""
    g = fresh_generator()
    model = make_net(g).cuda()
    bare = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    bare_opt = torch.optim.AdamW(bare.parameters(), lr=1e-2, fused=True)
    data = on("cuda", batches(g, SYNC_STEPS + 1))
    monitor = Monitor(model, opt, **MONITOR_OPTIONS[options])
    bare_syncs, monitored_syncs = [], []
    for batch in data[:SYNC_STEPS]:
        bare_syncs.append(sync_error(functools.partial(train_step, bare, bare_opt, batch)))
        monitored_syncs.append(sync_error(functools.partial(train_step, model, opt, batch)))
    assert bare_syncs[1:] == [None] * (SYNC_STEPS - 1), f"the step without a Monitor synchronizes: {bare_syncs}"
    added = [(step, m) for step, (b, m) in enumerate(zip(bare_syncs, monitored_syncs)) if b is None and m is not None]
    assert added == [], f"the Monitor synchronizes: {added}"
    assert swallowed(monitor) == [], "an error (a sync?) was kept as a note instead of raised"
    # report() is the one read; it names a NaN planted in one gradient between backward and step.
    opt.zero_grad()
    loss_of(model, data[-1]).backward()
    name = plant_nan(model, g)
    opt.step()
    report = monitor.report()
    monitor.close()
    assert report.history["steps"] == list(range(SYNC_STEPS + 1))  # every checked step was scanned
    assert judged(report) == [(name, "grad", Cause.NONFINITE)], str(report)
    assert [(t["name"], t["nan"]) for t in report.tensors if t["kind"] == "grad" and t["nan"]] == [(name, 1)]


# ---- 2. a captured training step (CPU: the ops it replays) -------------------------


@pytest.mark.parametrize("variant", ["fused", "foreach"])
def test_a_nan_step_issues_the_ops_of_a_clean_one(variant: str) -> None:
    """A CUDA graph replays the ops of the step it captured, whatever the
    data: the Monitor's and the guard's step path must issue the same ops,
    with the same output shapes, for a step whose gradient holds a NaN as for
    a clean one (no branch on values, no allocation sized by values)."""
    g = fresh_generator()
    model = make_net(g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **{variant: True})
    monitor = Monitor(model, opt, activations=True, histogram=True)
    guarded = guard(opt, names=model)
    logs: list[tuple[list[Any], list[Any]]] = []
    name = ""
    for step, batch in enumerate(batches(g, 3)):  # step 0 warms up: it probes the forward, makes the state
        with OpLog() as backward:
            opt.zero_grad()
            loss_of(model, batch).backward()
        if step == 2:
            name = plant_nan(model, g)
        with OpLog() as stepped:
            opt.step()
        logs.append((backward.ops, stepped.ops))
    monitor.close()
    (clean_backward, clean_step), (nan_backward, nan_step) = logs[1], logs[2]
    assert nan_backward == clean_backward, first_difference(nan_backward, clean_backward)
    assert nan_step == clean_step, first_difference(nan_step, clean_step)
    # The logs see the scans: each ReLU's output in forward and, at the end of backward, the witness
    # of a few gradients' first values (no histograms: the gradients themselves wait for the step,
    # monitor/deferred.py); at the step, the Monitor's of every gradient and weight and the guard's
    # of the gradients.
    assert [op for op, _ in clean_backward if op.startswith("zeroscan.")] == [
        "zeroscan.stats_many.default", "zeroscan.stats_many.default", "zeroscan.stats_many.default",
    ]
    assert sorted(op for op, _ in clean_step if op.startswith("zeroscan.")) == [
        "zeroscan.stats_many.default", "zeroscan.stats_many_hist.default",
    ]
    assert guarded.report().skipped_steps == [SkippedStep(2, [name])]
    assert judged(monitor.report()) == [(name, "grad", Cause.NONFINITE)]


@pytest.mark.parametrize("plant", ["item", "nonzero"])
def test_the_checks_see_a_host_read_planted_in_the_monitor(plant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The detectors above are not vacuous: a host read (.item()) or a
    value-sized op (nonzero) put into the Monitor's scan is caught by each of
    them, inside backward's end-of-pass callback and the step's pre-hook."""
    original = scanner.scan_one_device

    def planted(tensors: list[Tensor], slots: list[int], histogram: bool) -> step_record.Scan:
        scan = original(tensors, slots, histogram)
        if plant == "item":
            scan.rows[0, Column.NAN].item()
        else:
            scan.rows[:, Column.NAN].nonzero()
        return scan

    g = fresh_generator()
    model = make_net(g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    data = batches(g, 3)
    with Monitor(model, opt):
        train_step(model, opt, data[0])
        monkeypatch.setattr(scanner, "scan_one_device", planted)
        with DeviceWaits() as waits:
            train_step(model, opt, data[1])
        op = "aten._local_scalar_dense.default" if plant == "item" else "aten.nonzero.default"
        assert [seen for seen, _ in waits.by_zeroscan()] == [op, op]  # backward's (the witness), then the step's
        assert all(where is not None and where.startswith("zeroscan/") for _, where in waits.by_zeroscan())
        if plant == "item":
            with host_reads_refused(monkeypatch) as calls:
                with pytest.raises(AssertionError, match="host read Tensor.item"):
                    train_step(model, opt, data[2])
            assert calls == ["item"]
        else:  # a value-sized output: a NaN step no longer issues the ops of a clean one
            logs = []
            for batch, nan in ((data[1], False), (data[2], True)):
                opt.zero_grad()
                loss_of(model, batch).backward()
                if nan:
                    plant_nan(model, g)
                with OpLog() as log:
                    opt.step()
                logs.append(log.ops)
            assert logs[0] != logs[1]


@cuda_only
@pytest.mark.parametrize("options", ["plain", "activations_histogram"])
def test_a_captured_step_with_the_monitor_replays_like_eager(options: str) -> None:
    """The whole-network capture recipe (torch.cuda.graphs docs: static
    inputs, warm-up on a side stream, forward + backward + optimizer.step()
    in torch.cuda.graph) with a Monitor attached, beside an eager twin with
    its own Monitor on the same data. Each replay reruns the captured scans on
    that replay's tensors, and they equal the eager Monitor's for the same
    step; the weights equal eager's; report() reads the last replay."""
    monitor_options = {"plain": {}, "activations_histogram": {"activations": True, "histogram": True}}[options]
    g = fresh_generator()
    model = make_net(g).cuda()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # capturable as it is: no CPU state
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    data = on("cuda", batches(g, WARMUP + REPLAYS))
    static_x, static_y = data[0][0].clone(), data[0][1].clone()
    monitor = Monitor(model, opt, **monitor_options)
    eager = Monitor(twin, twin_opt, **monitor_options)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in data[:WARMUP]:
            static_x.copy_(x)
            static_y.copy_(y)
            train_step(model, opt, (static_x, static_y))
    torch.cuda.current_stream().wait_stream(side)
    for batch in data[:WARMUP]:
        train_step(twin, twin_opt, batch)
    opt.zero_grad(set_to_none=True)  # backward in the capture then allocates .grad from the graph's pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss_of(model, (static_x, static_y)).backward()
        opt.step()
    # The Monitor's Python side ran once, while capturing: one more step, recorded into the graph's
    # buffers with one scan of every gradient and weight at the step and, at the end of backward, the
    # witness of a few gradients' first values (the warm-up steps let their gradients go, so the
    # gradients wait for the step: monitor/deferred.py).
    assert monitor.steps_seen == WARMUP + 1
    captured = monitor._log.records[-1]
    assert captured.step == WARMUP and captured.stepped is True and len(captured.groups) == 1
    assert captured.witness is not None
    assert [tag for _, tag, _ in captured.activations] == (["relu", "relu"] if monitor_options else [])
    assert swallowed(monitor) == [], "a scan failed while capturing and was kept as a note"
    params = list(model.parameters())
    previous: Tensor | None = None
    for k, (x, y) in enumerate(data[WARMUP:]):
        static_x.copy_(x)
        static_y.copy_(y)
        weights = [p.detach().clone() for p in params]  # what the step's scan sees: the weights before the update
        graph.replay()
        train_step(twin, twin_opt, (x, y))
        assert monitor.steps_seen == WARMUP + 1 and monitor._log.records[-1] is captured  # a replay runs no Python
        # The captured scans were rerun on this replay's gradients and weights, bit for bit.
        for (slots, rows), block in zip(captured.groups, captured.fields, strict=True):
            tensors = scanned(params, slots, weights)
            assert torch.equal(rows, torch.ops.zeroscan.stats_many.default(tensors, None)), f"replay {k}"
            if monitor_options:
                assert block is not None, f"replay {k}: no histogram fields"
                assert torch.equal(block.fields, torch.ops.zeroscan.stats_many_hist.default(tensors, None)[1])
        witness = [params[Slot.at_row(row).param].grad.reshape(-1)[:64] for row in captured.witness.slots]
        assert torch.equal(captured.witness.rows, torch.ops.zeroscan.stats_many.default(witness, None))
        # ... and hold what the eager Monitor recorded for the same step.
        twin_record = eager._log.records[-1]
        assert twin_record.step == WARMUP + k
        for (slots, rows), (twin_slots, twin_rows) in zip(captured.groups, twin_record.groups, strict=True):
            assert slots == twin_slots
            assert_rows_like(rows, twin_rows, f"replay {k}")
        assert [a[:2] for a in captured.activations] == [a[:2] for a in twin_record.activations]
        for (act, _, buffer), (_, _, twin_buffer) in zip(captured.activations, twin_record.activations):
            assert_rows_like(buffer, twin_buffer, f"replay {k}, activation {act}")
        # ... and the training step is eager's.
        for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=lambda m, n=name, r=k: f"replay {r}, {n}: {m}")
        rows_now = captured.groups[0][1].clone()
        assert previous is None or not torch.equal(rows_now, previous)  # new data, new rows
        previous = rows_now
    report = monitor.report()
    eager.close()
    monitor.close()
    assert report.step == WARMUP  # the captured step, as the last replay left it
    assert judged(report) == [], str(report)
    grads = {t["name"]: t for t in report.tensors if t["kind"] == "grad"}
    for name, p in model.named_parameters():
        assert p.grad is not None
        assert grads[name]["norm"] == pytest.approx(zeroscan.stats(p.grad).norm, rel=1e-12), name


# ---- 3. the guard under capture --------------------------------------------------

GUARDED_ADAMW = {"fused": {"fused": True}, "foreach": {"foreach": True}}


@cuda_only
@pytest.mark.parametrize("variant", GUARDED_ADAMW)
def test_a_guarded_adamw_step_captured_in_a_cuda_graph(variant: str) -> None:
    """One clean warm-up step, then a guarded capturable AdamW step captured
    (fused: the guard's found_inf reaches the fused CUDA kernel; foreach: the
    snapshot-and-select path). A clean replay updates like an unguarded eager
    twin; a replay whose gradient of 2.weight holds a NaN (planted through a
    static tensor added to that gradient inside the graph) leaves weights,
    moments and `step` bit-identical; the next clean replay equals the twin
    that never saw the bad batch; report() counts the replays."""
    g = fresh_generator()
    model = make_model(g).cuda()
    twin = copy.deepcopy(model)

    def adamw(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1, capturable=True, **GUARDED_ADAMW[variant])

    opt, twin_opt = adamw(model), adamw(twin)
    guarded = guard(opt, names=model)
    assert guarded.fused == (variant == "fused")
    data = on("cuda", batches(g, 4))
    static_x, static_y = data[0][0].clone(), data[0][1].clone()
    # Added to the gradient of 2.weight: zero, or a NaN at one entry. The twin has its own, always
    # zero, so that both run the same ops.
    poison, twin_poison = torch.zeros_like(model[2].weight), torch.zeros_like(model[2].weight)
    entry = int(torch.randint(0, poison.numel(), (), generator=g))

    def loss(m: nn.Sequential, added: Tensor, x: Tensor, y: Tensor) -> Tensor:
        return (m(x) - y).square().mean() + (added * m[2].weight).sum()

    def twin_step(batch: Batch) -> None:
        twin_opt.zero_grad()
        loss(twin, twin_poison, *batch).backward()
        twin_opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up step makes the optimizer's state
        opt.zero_grad(set_to_none=True)
        loss(model, poison, static_x, static_y).backward()
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    twin_step(data[0])
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss(model, poison, static_x, static_y).backward()
        opt.step()
    assert not hasattr(opt, "found_inf")  # put back by the post hook while capturing
    assert guarded.report() == GuardReport(1, 0, [])  # capturing ran nothing

    def replay(batch: Batch, planted: float | None) -> None:
        static_x.copy_(batch[0])
        static_y.copy_(batch[1])
        poison.zero_()
        if planted is not None:
            poison.view(-1)[entry] = planted
        graph.replay()

    before = everything(model, opt)
    replay(data[1], None)
    twin_step(data[1])
    assert_moved(before, everything(model, opt))
    assert_all_close(everything(model, opt), everything(twin, twin_opt))
    before = everything(model, opt)
    replay(data[2], math.nan)
    grad = model[2].weight.grad
    assert grad is not None and int(grad.isnan().sum()) == 1  # the plant reached the gradient in the graph
    assert_same(everything(model, opt), before)  # bit for bit, `step` included
    replay(data[3], None)
    twin_step(data[3])  # the twin never saw batch 2
    assert_all_close(everything(model, opt), everything(twin, twin_opt))
    assert all(bool(p.isfinite().all()) for p in model.parameters())
    report = guarded.report()
    assert (report.steps, report.skipped) == (4, 1)
    assert report.skipped_steps == [SkippedStep(2, ["2.weight"])]
    assert not hasattr(opt, "found_inf")


# ---- 4. a float16 GradScaler's skipped step ----------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_the_fp16_grad_scaler_skips_is_recorded_as_skipped(device: str) -> None:
    """autocast float16 and a GradScaler: an inf in the input of step 1 makes
    every gradient non-finite, the scaler skips that step (and halves its
    scale), and the Monitor records it as skipped, at INFO."""
    g = fresh_generator()
    model = make_net(g).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
    data = on(device, batches(g, 3))
    data[1][0][0, 0] = math.inf
    scales = []
    with Monitor(model, opt) as monitor:
        for batch in data:
            opt.zero_grad()
            with torch.autocast(device, dtype=torch.float16):
                loss = loss_of(model, batch)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    assert scales == [2.0**10, 2.0**9, 2.0**9]  # step 1, and only it, was skipped
    report = monitor.report()
    (skip,) = [f for f in report.findings if f.cause == Cause.SKIPPED_STEPS]
    assert skip.severity == Severity.INFO and "skipped at 1 of 3 monitored steps" in skip.message, skip.message
    assert "non-finite gradients first appeared at step 1" in skip.message, skip.message
    assert report.step == 2 and report.history["steps"] == [0, 1, 2]
    assert serious(report) == [], str(report)
