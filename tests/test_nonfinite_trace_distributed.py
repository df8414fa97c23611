"""zeroscan.Monitor(trace_nonfinite=True) with a process group: where a NaN
or an infinity was born, on each rank, and which rank made it first.

Two gloo processes, spawned once by this file (bounded in time: a hang fails
the run), run every check. A small model holds a planted module (`Plant`),
part of the model on every rank, that makes a non-finite value only while it
is armed: an infinity in its forward output, or a NaN in the gradient its
backward gives (its forward output stays finite). It is armed on one rank (or
both) at one step. Each rank's origin is its own: the rank that armed it
names the planted module, the pass and the step; a rank whose own passes were
clean, and whose gradients went non-finite through the gradient all-reduce
(DDP) or reduce-scatter (FSDP2), is told they came in after backward. Every
rank's finding ends with the rank(s) that made it first, carried by the rank
exchange of each monitored step (StepRecord.born_ranks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroscan
from zeroscan import Monitor, Report, Severity
from zeroscan.monitor.nonfinite_trace import PARAMETER
from helpers import serious
from world import Check, World, module_world

WORLD = 2
WORLD_TIMEOUT_S = 90.0  # every check together takes ~15 s; past this it is a hang
COLLECTIVE_TIMEOUT_S = 30.0
ORIGIN = "nonfinite_origin"
CAME_IN = "they came in after backward made the gradients (the gradient all-reduce from another rank"
FORWARD_HOW = (
    "module.plant returned inf while its inputs were finite; the NaN that reached the gradients descends from it: "
    "module.fc2 returned NaN from that inf (inf - inf, or 0 * inf)"
)
BACKWARD_HOW = (
    "the gradient module.plant's backward gave its input args[0] held NaN, while the gradients it received were finite"
)


class Plant(nn.Module):
    """Passes its input through, unless armed: then "forward" adds -inf (log
    of zero) to it, and "backward" adds sqrt((x - x)^2), which is 0 in the
    forward pass but whose gradient is inf * 0 = NaN."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        assert fault in ("forward", "backward")
        self.fault = fault
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return x
        if self.fault == "forward":
            return x + torch.log(torch.zeros_like(x[..., :1]))
        return x + torch.sqrt((x - x.detach()) ** 2)


def planted_mlp(seed: int, fault: str) -> nn.Sequential:
    """fc1 -> Tanh -> plant -> fc2, seeded alike on every rank."""
    torch.manual_seed(seed)
    return nn.Sequential(OrderedDict(
        fc1=nn.Linear(8, 16), act=nn.Tanh(), plant=Plant(fault), fc2=nn.Linear(16, 3),
    ))


def origin_findings(report: Report) -> list[zeroscan.Finding]:
    return [f for f in report.findings if f.cause == ORIGIN]


def born_ranks(monitor: Monitor) -> list[tuple[int, int] | None]:
    return [r.born_ranks for r in monitor._log.records]


def train_ddp(
    rank: int, seed: int, *, fault: str, armed: Callable[[int, int], bool], steps: int, guarded: bool = False
) -> tuple[Monitor, Report, nn.Module]:
    """DDP over planted_mlp with SGD and a traced Monitor over the group;
    the plant is armed where armed(rank, step). guarded: zeroscan.guard skips
    a step whose gradients hold inf/NaN. Returns the Monitor, its report
    (read on every rank at the end) and the DDP model."""
    model = planted_mlp(seed, fault)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    if guarded:
        zeroscan.guard(opt, names=ddp)
    g = torch.Generator().manual_seed(seed + 1 + rank)  # every rank its own batches
    monitor = Monitor(ddp, opt, trace_nonfinite=True, process_group=dist.group.WORLD)
    for step in range(steps):
        model.plant.armed = armed(rank, step)
        x = torch.randn(10, 8, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), x[:, :3].cos()).backward()  # DDP all-reduces here
        opt.step()  # the Monitor scans here, and exchanges across ranks
    model.plant.armed = False
    return monitor, monitor.report(), ddp


def assert_came_in(report: Report, step: int, ranks_words: str) -> None:
    """This rank's passes were clean: no origin, and a global finding saying
    the gradients of `step` came in after backward."""
    assert report.nonfinite_origin is None, report.nonfinite_origin
    (finding,) = origin_findings(report)
    assert finding.name == "(all parameters)", finding
    assert finding.message.startswith(f"the gradients of step {step} hold inf/NaN, but in the traced steps that led to them"), (
        finding.message
    )
    assert CAME_IN in finding.message and finding.message.endswith(ranks_words), finding.message


# ------------------------------------------------------------ the checks
# Each runs on every rank of the spawned world; what it returns must be the
# same on every rank.


def check_ddp_forward_fault_on_rank_1(rank: int, world_size: int, seed: int) -> str:
    """DDP, 6 steps; rank 1's plant makes an infinity in its forward output at
    step 3. Rank 1 names the plant, the forward pass and step 3 (then the
    weights, which SGD made non-finite, make NaN at every later step on both
    ranks); both ranks say rank 1 made it first, by step 3."""
    monitor, report, _ = train_ddp(rank, seed, fault="forward", armed=lambda r, s: r == 1 and s == 3, steps=6)
    words = "; across the process group, rank 1 made it first, by step 3"
    # Step 3: rank 1 alone made one; from step 4 on, the poisoned weights make one on both.
    assert born_ranks(monitor) == [None, None, None, (1, 1), (0, 1), (0, 1)], born_ranks(monitor)
    (finding,) = origin_findings(report)
    assert finding.message.endswith(words), finding.message
    assert finding.severity == Severity.ERROR, finding
    (nonfinite,) = [f for f in report.findings if f.cause == "nonfinite"]
    assert "non-finite gradients first appeared at step 3" in nonfinite.message, nonfinite.message
    if rank == 1:
        assert report.nonfinite_origin == {
            "step": 3, "pass": "forward", "micro_batch": 0, "name": "module.plant", "kind": "activation",
            "values": "inf", "how": FORWARD_HOW,
        }, report.nonfinite_origin
        assert finding.name == "module.plant" and finding.kind == "activation", finding
        assert finding.message.startswith(f"inf was born at step 3, in the forward pass: {FORWARD_HOW}; "), (
            finding.message
        )
        assert "from step 4 on, the weights hold inf/NaN" in finding.message, finding.message
        assert nonfinite.message.endswith(
            "; born at step 3 in module.plant (forward): see the nonfinite_origin finding"
        ), nonfinite.message
    return words


def check_ddp_clean_rank_keeps_training(rank: int, world_size: int, seed: int) -> str:
    """As check_ddp_forward_fault_on_rank_1, on rank 0: its own passes were
    clean at step 3, and its gradients went non-finite through DDP's
    all-reduce; SGD then put NaN in its weights, and its later passes make
    NaN from them. Its origin should be none (the gradients came in after
    backward at step 3), not a weight born after the gradients already held
    NaN."""
    _, report, _ = train_ddp(rank, seed, fault="forward", armed=lambda r, s: r == 1 and s == 3, steps=6)
    words = "; across the process group, rank 1 made it first, by step 3"
    if rank == 0:
        assert_came_in(report, 3, words)
    return words


def check_ddp_forward_fault_guarded(rank: int, world_size: int, seed: int) -> str:
    """As check_ddp_forward_fault_on_rank_1, with zeroscan.guard skipping the
    step whose all-reduced gradients hold inf/NaN: the weights stay finite,
    no later pass makes a non-finite value, rank 1 names the plant at step 3
    and nothing born again, and rank 0 is told the gradients came in after
    backward."""
    monitor, report, ddp = train_ddp(
        rank, seed, fault="forward", armed=lambda r, s: r == 1 and s == 3, steps=6, guarded=True
    )
    words = "; across the process group, rank 1 made it first, by step 3"
    assert all(bool(torch.isfinite(p).all()) for p in ddp.parameters())
    assert born_ranks(monitor) == [None, None, None, (1, 1), None, None], born_ranks(monitor)
    if rank == 0:
        assert_came_in(report, 3, words)
    else:
        (finding,) = origin_findings(report)
        assert report.nonfinite_origin is not None
        assert (report.nonfinite_origin["name"], report.nonfinite_origin["pass"], report.nonfinite_origin["step"]) == (
            "module.plant", "forward", 3
        ), report.nonfinite_origin
        assert finding.message == f"inf was born at step 3, in the forward pass: {FORWARD_HOW}{words}", (
            finding.message
        )
    # Every step with inf/NaN gradients was skipped: information, not an error.
    assert origin_findings(report)[0].severity == Severity.INFO, origin_findings(report)
    return words


def check_ddp_backward_fault_on_rank_0(rank: int, world_size: int, seed: int) -> str:
    """DDP, 4 steps; at the last, rank 0's plant gives a NaN gradient in
    backward (its forward output is finite). Rank 0 names the plant's
    backward; rank 1 is told the gradients came in after backward; both say
    rank 0 made it first."""
    last = 3
    monitor, report, _ = train_ddp(
        rank, seed, fault="backward", armed=lambda r, s: r == 0 and s == last, steps=last + 1
    )
    words = f"; across the process group, rank 0 made it first, by step {last}"
    assert born_ranks(monitor) == [None, None, None, (0, 0)], born_ranks(monitor)
    if rank == 0:
        assert report.nonfinite_origin == {
            "step": last, "pass": "backward", "micro_batch": 0, "name": "module.plant", "kind": "grad",
            "values": "NaN", "how": BACKWARD_HOW,
        }, report.nonfinite_origin
        (finding,) = origin_findings(report)
        assert finding.name == "module.plant" and finding.kind == "grad", finding
        assert finding.message == f"NaN was born at step {last}, in the backward pass: {BACKWARD_HOW}{words}", (
            finding.message
        )
    else:
        assert_came_in(report, last, words)
    return words


def check_ddp_fault_on_both_ranks(rank: int, world_size: int, seed: int) -> str:
    """DDP, 3 steps; at the last, both ranks' plants make an infinity in the
    forward pass: each rank names its own plant, and the ranks that made it
    first are a range."""
    monitor, report, _ = train_ddp(rank, seed, fault="forward", armed=lambda r, s: s == 2, steps=3)
    words = "; across the process group, ranks 0 to 1 (at least two) made it first, by step 2"
    assert born_ranks(monitor) == [None, None, (0, 1)], born_ranks(monitor)
    assert report.nonfinite_origin is not None
    assert (report.nonfinite_origin["name"], report.nonfinite_origin["pass"], report.nonfinite_origin["step"]) == (
        "module.plant", "forward", 2
    ), report.nonfinite_origin
    (finding,) = origin_findings(report)
    assert finding.message == f"inf was born at step 2, in the forward pass: {FORWARD_HOW}{words}", finding.message
    return words


def check_fsdp2_forward_fault_on_rank_1(rank: int, world_size: int, seed: int) -> str:
    """FSDP2 (fully_shard on CPU/gloo), 3 steps; at the last, rank 1's plant
    makes an infinity in the forward pass. The parameters are DTensors, which
    the trace leaves unhooked (no parameter gradient arrives in it); the
    activations are plain tensors, so rank 1 names the plant, and rank 0,
    whose shards got the non-finite gradients through the reduce-scatter, is
    told they came in after backward."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, init_device_mesh

    last = 2
    model = planted_mlp(seed, "forward")
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(seed + 2 + rank)
    monitor = Monitor(model, opt, trace_nonfinite=True, process_group=dist.group.WORLD)
    for step in range(last + 1):
        model.plant.armed = rank == 1 and step == last
        x = torch.randn(10, 8, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :3].cos()).backward()
        opt.step()
    model.plant.armed = False
    report = monitor.report()
    assert monitor._trace is not None
    segments = [s for t in monitor._trace.steps for s in t.segments]
    passes = [p for s in segments for p in s.passes]
    assert len(passes) == last + 1 and all(p.reached for p in passes)  # the activations' gradients arrived
    assert not any(what == PARAMETER for s in segments for _, what, _, _ in s.arrivals)  # DTensor parameters: unhooked
    assert {c.name for c in passes[0].calls} == {"(model)", "fc1", "act", "plant", "fc2"}
    words = f"; across the process group, rank 1 made it first, by step {last}"
    assert born_ranks(monitor) == [None, None, (1, 1)], born_ranks(monitor)
    (nonfinite,) = [f for f in report.findings if f.cause == "nonfinite"]
    assert f"step {last}" in nonfinite.message, nonfinite.message
    if rank == 1:
        assert report.nonfinite_origin == {
            "step": last, "pass": "forward", "micro_batch": 0, "name": "plant", "kind": "activation",
            "values": "inf", "how": (
                "plant returned inf while its inputs were finite; the NaN that reached the gradients descends "
                "from it: fc2 returned NaN from that inf (inf - inf, or 0 * inf)"
            ),
        }, report.nonfinite_origin
        (finding,) = origin_findings(report)
        assert finding.name == "plant" and finding.message.endswith(words), finding
    else:
        assert_came_in(report, last, words)
    return words


def check_ddp_healthy_traced(rank: int, world_size: int, seed: int) -> str:
    """DDP, 6 healthy steps with the trace on: every step was traced, every
    module call recorded, and nothing is reported: no nonfinite_origin
    finding, no origin, no rank that made a non-finite value."""
    steps = 6
    monitor, report, _ = train_ddp(rank, seed, fault="forward", armed=lambda r, s: False, steps=steps)
    assert monitor._trace is not None
    traced = list(monitor._trace.steps)
    assert [t.step for t in traced] == list(range(steps)), [t.step for t in traced]
    calls = {c.name for t in traced for s in t.segments for p in s.passes for c in p.calls}
    assert calls == {"(model)", "module", "module.fc1", "module.act", "module.plant", "module.fc2"}, calls
    params = sum(what == PARAMETER for t in traced for s in t.segments for _, what, _, _ in s.arrivals)
    assert params == 4 * steps, params  # every parameter's incoming gradient, at every step
    assert born_ranks(monitor) == [None] * steps, born_ranks(monitor)
    assert origin_findings(report) == [] and report.nonfinite_origin is None, str(report)
    assert serious(report) == [], str(report)
    return "healthy"


CHECKS: dict[str, Callable[[int, int, int], str]] = {
    "ddp_forward_fault_on_rank_1": check_ddp_forward_fault_on_rank_1,
    "ddp_clean_rank_keeps_training": check_ddp_clean_rank_keeps_training,
    "ddp_forward_fault_guarded": check_ddp_forward_fault_guarded,
    "ddp_backward_fault_on_rank_0": check_ddp_backward_fault_on_rank_0,
    "ddp_fault_on_both_ranks": check_ddp_fault_on_both_ranks,
    "fsdp2_forward_fault_on_rank_1": check_fsdp2_forward_fault_on_rank_1,
    "ddp_healthy_traced": check_ddp_healthy_traced,
}
WORLD_CHECKS: dict[str, Check] = dict(CHECKS)


world = module_world(WORLD, WORLD_CHECKS, timeout_s=WORLD_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S)


@pytest.mark.parametrize("check", list(CHECKS))
def test_check_passes_on_every_rank(world: World, check: str) -> None:
    """One check of CHECKS (each check_* function above says what it asserts)."""
    world.assert_passed(check)


def test_plant_makes_what_it_says() -> None:
    """In-process: the forward plant's output holds -inf, the backward
    plant's output is finite and its input's gradient NaN."""
    x = torch.randn(3, 4, requires_grad=True)
    forward, backward = Plant("forward"), Plant("backward")
    forward.armed = backward.armed = True
    assert bool(torch.isneginf(forward(x)).all())
    out = backward(x)
    assert torch.equal(out, x)
    out.sum().backward()
    assert x.grad is not None and bool(torch.isnan(x.grad).all())
    assert Plant("backward")(x) is x and Plant("forward")(x) is x  # unarmed: the input itself
