"""zeroscan.Monitor with a process group: global findings across ranks.

Two gloo processes, spawned once by this file (bounded in time: a hang fails
the run), run every check; each records "ok" or its traceback, and the report
it produced. One test per check reads the records and compares the ranks'
reports, which must be identical. Data-parallel replicas use torch's
DistributedDataParallel (and plain replicas), the sharded model torch's FSDP2
(fully_shard) on CPU/gloo, whose merged statistics are checked against one
scan of the full tensors.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import json
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroscan
import zeroscan.distributed.gather
import zeroscan.monitor.step_record as monitor_records
from zeroscan.monitor import Slot
from helpers import assert_same_stats, example, fresh_generator, serious
from steps import DeviceWaits
from world import Check, World, module_world
from zeroscan import Finding, Monitor, Report, Severity, Thresholds

WORLD = 2
WORLD_TIMEOUT_S = 90.0  # every check together takes ~15 s; past this it is a hang
COLLECTIVE_TIMEOUT_S = 30.0
MOMENT_RTOL = 1e-12  # float64 moments merged from shards vs one scan of the full tensor
EMPTY_HISTORY: dict[str, list[Any]] = {
    "steps": [], "names": [], "grad_norm": [], "zero_fraction": [], "subnormal_fraction": [],
}


def summary(report: Report) -> list[tuple[str, str, str, tuple[int, ...] | None]]:
    return sorted((f.name, f.kind, f.cause, f.ranks) for f in serious(report))  # type: ignore[type-var]


@contextlib.contextmanager
def collectives_counted() -> Iterator[list[str]]:
    """The names of the torch.distributed collectives called inside the block, in order."""
    names = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "all_gather", "broadcast")
    real = {name: getattr(dist, name) for name in names}
    calls: list[str] = []

    def counting(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, counting(name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


# ------------------------------------------------------------ the checks
# Each runs on every rank of the spawned world and returns its report.


def tanh_ddp(
    seed: int, inputs: int, hidden: int, outputs: int
) -> tuple[nn.Sequential, nn.parallel.DistributedDataParallel, torch.optim.SGD]:
    """A two-layer Tanh MLP seeded alike on every rank, wrapped in DDP, with SGD."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, outputs))
    ddp = nn.parallel.DistributedDataParallel(model)
    return model, ddp, torch.optim.SGD(ddp.parameters(), lr=0.05)


def check_ddp_nan_on_one_rank(rank: int, seed: int) -> Report:
    """DDP; after the all-reduce rank 1 alone writes a NaN into one gradient."""
    names = ["module.0.weight", "module.0.bias", "module.2.weight", "module.2.bias"]
    nan_param = names[seed % len(names)]
    steps = 5
    real_decode = monitor_records.decode

    def no_decode(*args: Any) -> Any:
        raise AssertionError("the Monitor read results back during training")

    monitor_records.decode = no_decode  # type: ignore[assignment]
    try:
        with collectives_counted() as calls:
            monitor = example("monitor_ddp").train(seed, steps=steps, nan_rank=1, nan_param=nan_param)
    finally:
        monitor_records.decode = real_decode  # type: ignore[assignment]
    records = list(monitor._log.records)
    # One all_reduce when the Monitor is built (the ranks' parameters), then 3 + 2 per step.
    assert calls == ["all_reduce"] * (1 + 5 * steps), f"{calls} in {steps} steps"
    assert len(records) == steps and all(r.rows is None and r.exchange is not None for r in records)

    report = monitor.report()
    assert summary(report) == [(nan_param, "grad", "replica_mismatch", (1,))], str(report)
    (finding,) = serious(report)
    assert finding.severity == Severity.ERROR and "rank 1 holds NaN" in finding.message, finding.message
    assert report.to_dict()["findings"][0]["ranks"] == [1]
    grad_row = next(t for t in report.tensors if (t["name"], t["kind"]) == (nan_param, "grad"))
    model = monitor.model
    assert grad_row["nan"] == 0 and grad_row["numel"] == dict(model.named_parameters())[nan_param].numel()
    assert all(r.exchange is None for r in monitor._log.records)  # read once, kept as global rows
    assert monitor.report().to_json_lines() == report.to_json_lines()
    return report


def check_ddp_healthy(rank: int, seed: int) -> Report:
    """DDP training with nothing wrong: no findings, and the global rows are
    this rank's own (replicas agree), as a Monitor without a group sees them.
    After the first two steps (which build the packings it reuses: from the
    second on, the gradients are read at the step only, one scan group
    instead of two, see monitor/deferred.py) the step path, merge included,
    calls no op after which a CUDA host would wait for its device
    (DeviceWaits: the CPU's stand-in for CUDA's sync debug mode)."""
    model, ddp, opt = tanh_ddp(seed, 12, 24, 3)
    g = torch.Generator().manual_seed(seed + 1 + rank)
    across = Monitor(ddp, opt, process_group=dist.group.WORLD)
    alone = Monitor(ddp, opt)
    for step in range(6):
        x = torch.randn(16, 12, generator=g)
        with DeviceWaits() as waits:
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), x[:, :3].cos()).backward()
            opt.step()
        assert step <= 1 or waits.by_zeroscan() == [], f"step {step}: {waits.by_zeroscan()}"
    across.close()
    alone.close()
    report, local = across.report(), alone.report()
    assert serious(report) == [], str(report)
    assert report.tensors == local.tensors
    assert report.history == local.history
    assert report.to_dict()["findings"] == local.to_dict()["findings"]
    assert all("ranks" not in f for f in report.to_dict()["findings"])
    for name, p in ddp.named_parameters():
        row = next(t for t in report.tensors if (t["name"], t["kind"]) == (name, "grad"))
        want = zeroscan.stats(p.grad)
        assert (row["numel"], row["nan"], row["norm"], row["max_abs"]) == (
            want.numel, want.nan, want.norm, want.max_abs
        ), name
    return report


def check_replicas_diverge(rank: int, seed: int) -> Report:
    """Plain replicas fed the same batches (so equal gradients); at the last
    step rank 1 changes a weight outside the optimizer and drops a gradient."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(seed + 11)  # the same on every rank
    with Monitor(model, opt, process_group=dist.group.WORLD) as monitor:
        for step in range(3):
            x = torch.randn(10, 8, generator=g)
            opt.zero_grad()
            model(x).square().mean().backward()
            if step == 2 and rank == 1:
                with torch.no_grad():
                    model[0].weight.mul_(1 + 1e-3)
                model[2].bias.grad = None
            opt.step()
    report = monitor.report()
    assert summary(report) == [
        ("0.weight", "weight", "replica_mismatch", (1,)),
        ("2.bias", "grad", "replica_mismatch", (1,)),
    ], str(report)
    found = {f.name: f for f in serious(report)}
    assert "no majority" in found["0.weight"].message and "the mean is" in found["0.weight"].message
    assert "rank 1 has no gradient" in found["2.bias"].message
    bias_grad = next(t for t in report.tensors if (t["name"], t["kind"]) == ("2.bias", "grad"))
    assert bias_grad["numel"] == 2  # rank 0's gradient, the reference
    return report


def check_fsdp2(rank: int, seed: int) -> Report:
    """FSDP2 (fully_shard) in float64 with uneven shards, one of them empty:
    merged rows equal zeroscan.stats of the full tensors; a NaN in rank 1's
    shard of a gradient is reported with rank 1."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = [n for n, _ in model.named_parameters()]
    g = torch.Generator().manual_seed(seed + 100 + rank)
    monitor = Monitor(model, opt, auto=False, process_group=dist.group.WORLD)
    full: list[tuple[torch.Tensor, torch.Tensor]] = []
    for step in range(2):
        opt.zero_grad()
        model(torch.randn(7, 6, generator=g, dtype=torch.float64)).square().mean().backward()
        if step == 1 and rank == 1:
            shard = model[0].weight.grad.to_local()
            assert shard.numel() > 0
            shard.view(-1)[int(torch.randint(0, shard.numel(), (), generator=g))] = math.nan
        monitor.step()
        if step == 0:
            full = [(p.grad.full_tensor(), p.detach().full_tensor()) for p in model.parameters()]
        opt.step()
    monitor.close()
    report = monitor.report()
    assert model[4].weight.to_local().numel() == (3 if rank == 0 else 0)  # an empty shard on rank 1
    first = monitor._log.records[0].rows
    assert first is not None
    for i, (name, (grad, weight)) in enumerate(zip(names, full)):
        assert_same_stats(first[Slot.grad(i)][0], zeroscan.stats(grad), MOMENT_RTOL, what=f"{name} grad")
        assert_same_stats(first[Slot.weight(i)][0], zeroscan.stats(weight), MOMENT_RTOL, what=f"{name} weight")
    assert summary(report) == [("0.weight", "grad", "nonfinite", (1,))], str(report)
    assert "rank 1's shard" in serious(report)[0].message
    numels = {(t["name"], t["kind"]): t["numel"] for t in report.tensors}
    assert numels == {(n, k): p.numel() for n, p in model.named_parameters() for k in ("grad", "weight")}
    assert next(t for t in report.tensors if (t["name"], t["kind"]) == ("0.weight", "grad"))["nan"] == 1
    return report


def check_misuse(rank: int, seed: int) -> Report:
    """A group that is not the parameters' mesh, a rank outside the group, and
    ranks that monitored different steps."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    sub = dist.new_group([0])
    sharded = nn.Linear(4, 4)
    fully_shard(sharded, mesh=init_device_mesh("cpu", (WORLD,)))
    if rank == 0:
        with pytest.raises(ValueError, match=r"weight is a DTensor on a device mesh of ranks \[0, 1\]"):
            Monitor(sharded, process_group=sub)
    else:
        with pytest.raises(ValueError, match="is not a member of process_group"):
            Monitor(nn.Linear(2, 2), process_group=sub)

    model = nn.Linear(3, 2)
    every = 1 if rank == 0 else 2  # rank 0 monitors steps 0, 1; rank 1 steps 0, 2
    with Monitor(model, every=every, process_group=dist.group.WORLD) as monitor:
        for _ in range(2 if rank == 0 else 3):
            model.zero_grad()
            model(torch.randn(4, 3)).sum().backward()
            monitor.step()
    with pytest.raises(RuntimeError, match="recorded monitored step"):
        monitor.report()
    return Report(-1, [], [], EMPTY_HISTORY)


def saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def check_ddp_guard_skips_and_lifetime(rank: int, seed: int) -> Report:
    """DDP with zeroscan.guard: a step whose all-reduced gradients hold NaN
    (computed in backward on one rank) is skipped on both ranks, and the
    Monitor lists it with its step number; the wrapped model saves the bytes
    it saves without zeroscan, and a dropped Monitor is freed."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    zeroscan.guard(opt, names=ddp)
    g = torch.Generator().manual_seed(seed + 7 + rank)
    monitor = Monitor(ddp, opt, activations=True, process_group=dist.group.WORLD)
    for step in range(5):
        opt.zero_grad()
        x = torch.randn(4, 6, generator=g)
        if step == 2 and rank == 1:
            x[0, 0] = math.nan  # NaN through backward into 0.weight and 0.bias, then the all-reduce
        ddp(x).square().mean().backward()
        opt.step()
    assert all(bool(torch.isfinite(p).all()) for p in ddp.parameters())
    report = monitor.report()
    (skip,) = [f for f in report.findings if f.cause == "skipped_steps"]
    assert "skipped at 1 of 5 monitored steps" in skip.message and "step 2: module.0.weight" in skip.message, skip
    with_monitor = saved(ddp)  # DDP's own __getstate__ still makes the state
    monitor_ref = weakref.ref(monitor)
    del monitor
    gc.collect()
    assert monitor_ref() is None
    assert saved(ddp) == with_monitor
    return Report(-1, [], [], EMPTY_HISTORY)  # activation findings are each rank's own: checked above


def check_fsdp2_lifetime(rank: int, seed: int) -> Report:
    """FSDP2 (fully_shard, whose classes and pre-forward hooks are its own; it
    refuses pickling and deepcopy itself): a Monitor dropped without close()
    is freed, and takes its hooks and only its hooks with it."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    own_hooks = len(model._forward_pre_hooks)
    monitor = Monitor(model, opt, activations=True, process_group=dist.group.WORLD)
    g = torch.Generator().manual_seed(seed + 3 + rank)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 6, generator=g)).square().mean().backward()
        opt.step()
    assert monitor.report().step == 2
    assert len(model._forward_pre_hooks) > own_hooks
    monitor_ref = weakref.ref(monitor)
    del monitor
    gc.collect()
    assert monitor_ref() is None and len(model._forward_pre_hooks) == own_hooks
    assert all("__getstate__" not in m.__dict__ for m in model.modules())
    return Report(-1, [], [], EMPTY_HISTORY)


def check_report_mid_step_alone(rank: int, seed: int) -> Report:
    """DDP; rank 0 alone calls report() between backward and optimizer.step()
    at every step (a logger on rank 0), rank 1 at step 2 only: the report
    makes no collective, so training goes on (a collective there would pair
    with DDP's and hang until the group's timeout); every step's merge is
    read later all the same (the first one too, which a report read while
    it was open), and the final reports agree on every rank."""
    model, ddp, opt = tanh_ddp(seed, 6, 8, 2)
    g = torch.Generator().manual_seed(seed + 5 + rank)
    monitor = Monitor(ddp, opt, process_group=dist.group.WORLD)
    steps = 4
    for step in range(steps):
        opt.zero_grad()
        ddp(torch.randn(5, 6, generator=g)).square().mean().backward()
        if rank == 0 or step == 2:
            with collectives_counted() as calls:
                mid = monitor.report()
            assert calls == [], f"report() between backward and step made collectives {calls}"
            # The steps before this one; at the first, the open step as this rank scanned it.
            assert mid.step == max(step - 1, 0), (step, mid.step)
        opt.step()
    report = monitor.report()
    monitor.close()
    assert report.step == steps - 1 and serious(report) == [], str(report)
    assert all(r.exchange is None for r in monitor._log.records), "a step's merge was never read"
    first = monitor._log.records[0]
    assert first.step == 0 and all(first.row(Slot.weight(i)) is not None for i in range(4)), "step 0 lost its weights"
    return report


def check_model_grows_on_every_rank(rank: int, seed: int) -> Report:
    """A parameter added to the model on every rank between two steps: the
    next step checks the ranks again, merges the new parameter with the
    rest, and the report shows it."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    g = torch.Generator().manual_seed(seed + 9)  # the same batches everywhere: replicas agree
    with Monitor(model, auto=False, process_group=dist.group.WORLD) as monitor:
        for step in range(3):
            if step == 2:
                model.scale = nn.Parameter(torch.ones(2))
            model.zero_grad()
            out = model(torch.randn(5, 4, generator=g))
            (out * getattr(model, "scale", 1.0)).square().mean().backward()
            monitor.step()
    report = monitor.report()
    assert report.step == 2 and [f for f in report.findings if f.ranks is not None] == [], str(report)
    grad = next(t for t in report.tensors if (t["name"], t["kind"]) == ("scale", "grad"))
    want = zeroscan.stats(model.scale.grad)
    assert (grad["numel"], grad["norm"], grad["max_abs"]) == (want.numel, want.norm, want.max_abs), grad
    return report


def check_ranks_monitor_different_models(rank: int, seed: int) -> Report:
    """Ranks whose Monitors hold different parameters: every rank raises one
    error naming the ranks and their counts when the Monitor is built, before
    any merge; pipeline stages, each with a Monitor over its own group, are
    fine."""
    stage = [dist.new_group([0]), dist.new_group([1])]  # every rank makes every group, in order
    two = nn.Linear(3, 2)  # 2 parameters
    four = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))  # 4 parameters
    with pytest.raises(ValueError, match=r"^zeroscan.Monitor: rank 0 monitors 2 parameters and rank 1 4: ") as info:
        Monitor(two if rank == 0 else four, process_group=dist.group.WORLD)
    assert "\n" not in str(info.value)
    renamed = nn.Module()
    renamed.a = nn.Linear(3, 2) if rank == 0 else nn.Linear(2, 3)
    with pytest.raises(ValueError, match=r"monitor 2 parameters under different names") as info:
        Monitor(two if rank == 0 else renamed, process_group=dist.group.WORLD)
    assert "\n" not in str(info.value)
    model = two if rank == 0 else four
    with Monitor(model, process_group=stage[rank]) as monitor:
        model.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        monitor.step()
    assert monitor.report().step == 0
    return Report(-1, [], [], EMPTY_HISTORY)


def check_dtensors_on_two_meshes(rank: int, seed: int) -> Report:
    """Parameters on two device meshes (expert parallel beside data
    parallel) are refused in one line that says what to pass."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    everyone = DeviceMesh("cpu", [0, 1], _init_backend=False)
    alone = DeviceMesh("cpu", [rank], _init_backend=False)
    model = nn.Module()
    model.dense = nn.Parameter(DTensor.from_local(torch.ones(2, 3), everyone, [Shard(0)], run_check=False))
    model.expert = nn.Parameter(DTensor.from_local(torch.ones(2, 3), alone, [Shard(0)], run_check=False))
    with pytest.raises(ValueError, match=(
        r"^zeroscan.Monitor: the DTensor parameters live on 2 device meshes \(dense on ranks \[0, 1\]; expert on "
        r"rank \d\); a Monitor merges over one group: .*Monitor\(submodule, process_group="
    )):
        Monitor(model, process_group=dist.group.WORLD)
    return Report(-1, [], [], EMPTY_HISTORY)


CHECKS: dict[str, Callable[[int, int], Report]] = {
    "fsdp2_lifetime": check_fsdp2_lifetime,
    "ddp_guard_skips_and_lifetime": check_ddp_guard_skips_and_lifetime,
    "ddp_nan_on_one_rank": check_ddp_nan_on_one_rank,
    "ddp_healthy": check_ddp_healthy,
    "replicas_diverge": check_replicas_diverge,
    "fsdp2": check_fsdp2,
    "misuse": check_misuse,
    "report_mid_step_alone": check_report_mid_step_alone,
    "model_grows_on_every_rank": check_model_grows_on_every_rank,
    "ranks_monitor_different_models": check_ranks_monitor_different_models,
    "dtensors_on_two_meshes": check_dtensors_on_two_meshes,
}


def _report_lines(check: Callable[[int, int], Report], rank: int, world_size: int, seed: int) -> str:
    """A check's report as JSON lines: the world requires every rank's to be the same."""
    return check(rank, seed).to_json_lines()


WORLD_CHECKS: dict[str, Check] = {name: functools.partial(_report_lines, check) for name, check in CHECKS.items()}


world = module_world(WORLD, WORLD_CHECKS, timeout_s=WORLD_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S)


@pytest.mark.parametrize("check", list(CHECKS))
def test_check_passes_on_every_rank(world: World, check: str) -> None:
    """One check of CHECKS (each check_* function above says what it asserts)."""
    world.assert_passed(check)


# ------------------------------------------------------------ in-process


def test_finding_ranks_appear_in_to_dict_only_when_known() -> None:
    plain = Finding("w", "grad", Severity.ERROR, "nonfinite", "m")
    assert plain.ranks is None and set(plain.to_dict()) == {"name", "kind", "severity", "cause", "message"}
    ranked = Finding("w", "grad", Severity.ERROR, "replica_mismatch", "m", (1, 3))
    assert ranked.to_dict()["ranks"] == [1, 3]
    line = json.loads(Report(0, [ranked], [], EMPTY_HISTORY).to_json_lines())
    assert line["ranks"] == [1, 3] and line["cause"] == "replica_mismatch"


def test_without_a_group_nothing_is_gathered(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_gather(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a Monitor without a process group gathered")

    monkeypatch.setattr(zeroscan.distributed.gather, "gather_rows", no_gather)  # where compare_replicas looks it up
    monkeypatch.setattr(zeroscan.distributed, "start_merge", no_gather)  # where the Monitor looks it up
    g = fresh_generator()
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    with Monitor(model) as monitor:
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(5, 4, generator=g)).sum().backward()
            monitor.step()
    report = monitor.report()
    assert all(r.exchange is None and not r.rank_findings for r in monitor._log.records)
    grad = next(t for t in report.tensors if (t["name"], t["kind"]) == ("0.weight", "grad"))
    assert grad["norm"] == zeroscan.stats(model[0].weight.grad).norm


def test_process_group_and_replica_rtol_are_checked() -> None:
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        Monitor(nn.Linear(2, 2), process_group="world")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="replica_rtol must be a number in"):
        Thresholds(replica_rtol=-1e-9)
