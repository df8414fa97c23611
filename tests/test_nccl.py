"""zeroscan.distributed and Monitor(process_group=...) on NCCL equal the same work on gloo.

Every rank of an NCCL world (one GPU per rank: world min(cuda devices, 4))
also creates a gloo group over the same ranks, and every check does one piece
of work twice: on CUDA tensors over the NCCL group, and on the same values
on the CPU over the gloo group. The results must agree: counts and min/max
|x| exactly, moments within what the CUDA and CPU kernels' summation orders
allow, the exchanged rows bit for bit, and the same ranks named wherever a
rank is blamed. Checked so: merge_stats (also async and through
zeroscan.distributed.stats_many), gather_rows and combine_rows, the replica
reports of compare_replicas, and a Monitor's whole report of a small model
trained a few steps with a NaN gradient, a frozen layer and a parameter
outside the optimizer.

The checks know only a device: the same checks run on a 2-rank gloo world on
the CPU, where the "device" group is the default gloo group. That variant
compares gloo with gloo, so it proves little about NCCL, but it runs the
checks themselves wherever the tests run; the NCCL variant is skipped
without CUDA and NCCL and says so.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroscan
import zeroscan.distributed as zd
from helpers import FLOAT_DTYPES, assert_same_stats, close, make_values, rtol_for, stats_of_row
from world import Check, World, spawn_world
from zeroscan import Cause, Report

WORLD_TIMEOUT_S = 120.0  # the gloo world takes ~10 s; an NCCL world adds CUDA and NCCL start-up
COLLECTIVE_TIMEOUT_S = 60.0
COMBINE_RTOL = 1e-12  # the same rows merged by the CUDA and the CPU combine (float64; nvcc may fuse multiply-adds)
ROWS_RTOL = 1e-6  # rows_agree between the CUDA and the CPU scan of the same values (float32 chunk sums)
MESSAGE_RTOL = 2e-5  # numbers in a finding's message: printed to 6 significant digits
PIECE_DTYPES = (*FLOAT_DTYPES, torch.int32)
BACKEND_OF_DEVICE = {"cpu": "gloo", "cuda": "nccl"}


class Variant(NamedTuple):
    backend: str
    size: int
    device: str


VARIANTS = [
    Variant("gloo", 2, "cpu"),
    # NCCL refuses two ranks on one GPU: as many ranks as GPUs, up to 4.
    Variant("nccl", max(1, min(torch.cuda.device_count(), 4)), "cuda"),
]


# ------------------------------------------------------------ the data


def _groups(device: str) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The group whose backend goes with `device` (the world's default group)
    and a new gloo group over the same ranks. A collective: every check calls
    it first, so every rank creates the gloo group at the same point."""
    gloo_group = dist.new_group(backend="gloo")
    device_group = dist.group.WORLD
    assert dist.get_backend(device_group) == BACKEND_OF_DEVICE[device], (
        f"the world's backend is {dist.get_backend(device_group)}, but {device} tensors go with "
        f"{BACKEND_OF_DEVICE[device]}"
    )
    exchanged_on = zd.comm_device(device_group, torch.device("cpu")).type
    assert exchanged_on == device, f"{dist.get_backend(device_group)} exchanges rows on {exchanged_on}, not {device}"
    return device_group, gloo_group  # type: ignore[return-value]


def _strided(values: torch.Tensor) -> torch.Tensor:
    """Every other column of values as a 4-row matrix: a view no kernel can read as one run."""
    n = values.numel() - values.numel() % 8
    return values[:n].reshape(4, -1)[:, ::2]


def _pieces(rank: int, seed: int, device: str) -> list[torch.Tensor]:
    """This rank's own pieces of the merged tensors (mixed dtypes, with
    NaN/Inf/zeros/subnormals planted; every other one a strided view, one of
    them empty on some rank), built on `device` from the same values for
    every device."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    out = []
    for i, dtype in enumerate(PIECE_DTYPES):
        n = int(torch.randint(1, 6_000, (), generator=g)) if (i + rank) % 5 else 0
        values = make_values(n, dtype, g).to(device)  # the view is taken on the device: .to() would compact it
        out.append(_strided(values) if i % 2 else values)
    return out


def _rows(batch: zeroscan.StatsBatch) -> torch.Tensor:
    return torch.stack([s.buffer for s in batch])


# ------------------------------------------------------------ the checks
# check(device, rank, world, seed): module-level, since spawned ranks unpickle
# them; spawn_world calls them through functools.partial(check, device).


def check_merge_stats(device: str, rank: int, world: int, seed: int) -> None:
    """merge_stats of this rank's pieces scanned on `device`, over the device's
    group, equals merge_stats of the same pieces scanned on the CPU over
    gloo; so do its async form, zeroscan.distributed.stats_many and the
    merge of one Stats. The CPU rows merged over the device's group differ
    from gloo's merge only by the combine's rounding."""
    device_group, gloo_group = _groups(device)
    on_device, on_cpu = _pieces(rank, seed, device), _pieces(rank, seed, "cpu")
    cpu_stats = zeroscan.stats_many(on_cpu)
    want = zd.merge_stats(cpu_stats, gloo_group)
    local = zeroscan.stats_many(on_device)
    pending = zd.merge_stats(local, device_group, async_op=True)
    got = zd.merge_stats(local, device_group)
    via_stats_many = zd.stats_many(on_device, group=device_group)
    one = zd.merge_stats(zeroscan.stats(on_device[1]), device_group)
    cpu_rows_over_device_group = zd.merge_stats(cpu_stats, device_group)
    got_async = pending.wait()

    backend = dist.get_backend(device_group)
    for i, (x, g, w) in enumerate(zip(on_device, got, want)):
        what = f"piece {i} ({x.dtype}, {x.shape[0]} rows here)"
        assert isinstance(g, zd.GlobalStats) and (g.mode, g.ranks) == ("concatenated", world), (
            f"{what}: mode {g.mode!r} over {g.ranks} ranks, want 'concatenated' over {world}"
        )
        assert g.buffer.device.type == device, f"{what}: merged on {g.buffer.device}, not where {backend} exchanges"
        assert_same_stats(g, w, rtol_for(x.dtype), what=f"{what}: {device} over {backend} vs cpu over gloo:")
        assert_same_stats(
            cpu_rows_over_device_group[i], w, COMBINE_RTOL, what=f"{what}: cpu rows over {backend} vs over gloo:"
        )
        assert torch.equal(got_async[i].buffer, g.buffer), f"{what}: async_op=True merged other bits"
        assert torch.equal(via_stats_many[i].buffer, g.buffer), f"{what}: zd.stats_many merged other bits"
    assert torch.equal(one.buffer, got[1].buffer), "merging one Stats gave other bits than merging the batch"


def check_gather_rows(device: str, rank: int, world: int, seed: int) -> str:
    """gather_rows over the device's group moves the same bits as over gloo
    (rows given on the device, or on the CPU and moved by zeroscan), names the
    same ranks, and combine_rows merges them alike; the device's own scans
    gather to rows that agree with the CPU's. Returns a digest of the merged
    rows: the world checks that every rank merged the same bits."""
    device_group, gloo_group = _groups(device)
    on_device, on_cpu = _pieces(rank, seed, device), _pieces(rank, seed, "cpu")
    cpu_rows = _rows(zeroscan.stats_many(on_cpu))
    want = zd.gather_rows(cpu_rows, gloo_group)
    same_rows = zd.gather_rows(cpu_rows.to(device), device_group)
    moved_by_zeroscan = zd.gather_rows(cpu_rows, device_group, async_op=True).wait()
    scanned_here = zd.gather_rows(_rows(zeroscan.stats_many(on_device)), device_group)

    backend = dist.get_backend(device_group)
    assert isinstance(want, zd.GatheredRows) and want.ranks == tuple(range(world)), f"gloo gathered ranks {want.ranks}"
    for name, gathered in (("rows on the device", same_rows), ("cpu rows", moved_by_zeroscan), ("scans", scanned_here)):
        assert isinstance(gathered, zd.GatheredRows) and gathered.ranks == want.ranks, (
            f"{name} over {backend}: ranks {gathered.ranks}, over gloo {want.ranks}"
        )
        assert gathered.rows.device.type == device, f"{name} over {backend} arrived on {gathered.rows.device}"
        assert gathered.rows.shape == want.rows.shape, (
            f"{name}: shape {list(gathered.rows.shape)} vs {list(want.rows.shape)}"
        )
    for name, gathered in (("rows on the device", same_rows), ("cpu rows", moved_by_zeroscan)):
        differ = (gathered.rows.cpu() != want.rows).any(-1).nonzero().tolist()
        assert not differ, f"{name}: [rank, piece] {differ} gathered over {backend} differ from gloo's bits"
    disagree = (~zd.rows_agree(scanned_here.rows.cpu(), want.rows, ROWS_RTOL)).nonzero().tolist()
    assert not disagree, f"[rank, piece] {disagree}: the {device} scan's rows disagree with the cpu scan's"

    want_merged = want.merged()
    same_merged = same_rows.merged()
    scanned_merged = scanned_here.merged()
    for i, x in enumerate(on_cpu):
        what = f"piece {i} ({x.dtype})"
        reference = stats_of_row(want_merged, x, i)
        combined = stats_of_row(same_merged, x, i)
        # Read as the device's scan, so that the mean is held to that kernel's
        # bound (helpers.mean_floor), not the CPU's.
        scanned = stats_of_row(scanned_merged, on_device[i], i)
        assert_same_stats(combined, reference, COMBINE_RTOL, what=f"{what} combined over {backend}:")
        assert_same_stats(scanned, reference, rtol_for(x.dtype), what=f"{what} scanned on {device}:")
    return "merged rows " + hashlib.sha256(same_merged.cpu().numpy().tobytes()).hexdigest()


def _replica_grads(seed: int) -> list[torch.Tensor]:
    """The same gradients on every rank (a seed shared by the ranks)."""
    g = torch.Generator().manual_seed(seed + 2)
    return [make_values(n, torch.float32, g, specials=False) for n in (1000, 1, 5000, 64, 2048, 300)]


def _mismatch_key(m: zd.ReplicaMismatch) -> tuple[Any, ...]:
    return (m.index, m.name, m.ranks, m.reference_ranks, m.ambiguous, sorted(m.fields))


def assert_same_replica_report(got: zd.ReplicaReport, want: zd.ReplicaReport, what: str) -> None:
    """The same tensors blame the same ranks for the same fields; the fields'
    values agree (counts exactly, moments within ROWS_RTOL)."""
    assert (got.world_size, got.ranks) == (want.world_size, want.ranks), f"{what}: {got} vs {want}"
    assert [_mismatch_key(m) for m in got.mismatches] == [_mismatch_key(m) for m in want.mismatches], (
        f"{what}:\n{got}\nvs\n{want}"
    )
    for g, w in zip(got.mismatches, want.mismatches):
        for field, want_values in w.fields.items():
            for rank, a, b in zip(want.ranks, g.fields[field], want_values):
                assert close(float(a), float(b), ROWS_RTOL, 0.0), f"{what}: {g.name} {field} on rank {rank}: {a} vs {b}"


def check_replica_reports(device: str, rank: int, world: int, seed: int) -> str:
    """compare_replicas over the device's group reports what it reports over
    gloo: with two ranks or more, the last rank's NaN in one gradient and its
    diverged copy of another, naming that rank; with one rank, nothing."""
    device_group, gloo_group = _groups(device)
    grads = _replica_grads(seed)
    names = [f"layer{i}.grad" for i in range(len(grads))]
    bad_rank = world - 1 if world >= 2 else None
    if rank == bad_rank:
        grads[2][123] = math.nan
        grads[4] = grads[4] * 1.001
    on_device = [t.to(device) for t in grads]
    want = zd.compare_replicas(grads, gloo_group, names=names)
    got = zd.compare_replicas(on_device, device_group, names=names)
    got_async = zd.compare_replicas(zeroscan.stats_many(on_device), device_group, names=names, async_op=True).wait()

    backend = dist.get_backend(device_group)
    assert_same_replica_report(got, want, f"compare_replicas over {backend} vs gloo")
    assert_same_replica_report(got_async, want, f"compare_replicas(async_op=True) over {backend} vs gloo")
    if bad_rank is None:
        assert want.ok and got.ok, f"a lone rank has no replica to differ from:\n{got}"
    else:
        assert got.offending_ranks == (bad_rank,), str(got)
        assert [m.index for m in got.mismatches] == [2, 4], str(got)
        assert got.mismatches[0].fields["nan"][bad_rank] == 1, str(got)
    return str(want)


MONITOR_STEPS = 4
MONITOR_LR = 2.0**-4  # a power of two: lr * grad is exact, so no device rounds an update differently
NOT_IN_OPTIMIZER = "4.bias"
NAN_PARAM = "2.weight"


def _mlp(seed: int) -> nn.Sequential:
    """A small float32 MLP whose first layer is frozen (its gradients stay None)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    model[0].requires_grad_(False)
    return model


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    """SGD over the trainable parameters but NOT_IN_OPTIMIZER, which gets gradients and never changes."""
    trained = [p for n, p in model.named_parameters() if p.requires_grad and n != NOT_IN_OPTIMIZER]
    return torch.optim.SGD(trained, lr=MONITOR_LR)


def _take_gradients_from(model: nn.Module, source: nn.Module) -> None:
    """Each backward pass through `model` computes the gradients of the last
    backward pass through `source` (which must run first) in place of its
    own, and accumulates them as usual. The check is about zeroscan, not
    about torch's matmuls, which round differently per device: this way both
    Monitors see the same bits, with every hook of a real backward pass
    still firing."""
    for p, q in zip(model.parameters(), source.parameters()):
        if p.requires_grad:
            computed: dict[str, torch.Tensor] = {}  # not q.grad: a parameter outside the optimizer accumulates
            q.register_hook(functools.partial(computed.__setitem__, "grad"))
            p.register_hook(lambda grad, computed=computed: computed["grad"].to(grad.device, copy=True))


def _train_in_step(
    cpu_model: nn.Module, device_model: nn.Module, device: str, seed: int, nan_rank: int
) -> tuple[Report, Report]:
    """MONITOR_STEPS steps of both models under Monitors over their groups;
    at the last step `nan_rank` writes a NaN into NAN_PARAM's gradient after
    backward (in both). Returns the device's report and the CPU's."""
    device_group, gloo_group = _groups(device)
    cpu_opt, device_opt = _sgd(cpu_model), _sgd(device_model)
    _take_gradients_from(device_model, cpu_model)
    g = torch.Generator().manual_seed(seed + 3)  # the same batches on every rank: the replicas agree
    with (
        zeroscan.Monitor(cpu_model, cpu_opt, process_group=gloo_group) as cpu_monitor,
        zeroscan.Monitor(device_model, device_opt, process_group=device_group) as device_monitor,
    ):
        for step in range(MONITOR_STEPS):
            x = torch.randn(16, 8, generator=g)
            for model, opt, batch in ((cpu_model, cpu_opt, x), (device_model, device_opt, x.to(device))):
                opt.zero_grad()
                model(batch).square().mean().backward()
            if step == MONITOR_STEPS - 1 and dist.get_rank() == nan_rank:
                for model in (cpu_model, device_model):
                    dict(model.named_parameters())[NAN_PARAM].grad.view(-1)[37] = math.nan
            cpu_opt.step()
            device_opt.step()
            with torch.no_grad():  # torch's own update need not round alike on both devices
                for p, q in zip(device_model.parameters(), cpu_model.parameters()):
                    p.copy_(q)
    return device_monitor.report(), cpu_monitor.report()


NUMBER = re.compile(r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)")


def assert_same_message(got: str, want: str, what: str) -> None:
    """The same words; the same numbers up to the last printed digit."""
    got_parts, want_parts = NUMBER.split(got), NUMBER.split(want)
    same = len(got_parts) == len(want_parts) and all(
        (a == b) if k % 2 == 0 else close(float(a), float(b), MESSAGE_RTOL, 0.0)
        for k, (a, b) in enumerate(zip(got_parts, want_parts))
    )
    assert same, f"{what}: message\n  {got}\nvs\n  {want}"


def _same_value(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


MOMENT_KEYS = ("mean", "std", "norm")  # of a report's tensor rows: sums, in an order the kernel chooses


def assert_same_report(got: Report, want: Report, rtol: float, what: str) -> None:
    """The same findings (cause, severity, ranks; messages as in
    assert_same_message), the same tensor rows and history: counts,
    fractions and min/max exactly, moments within rtol."""
    g, w = got.to_dict(), want.to_dict()
    assert g["step"] == w["step"], f"{what}: report of step {g['step']} vs {w['step']}"

    def finding_key(f: dict[str, Any]) -> tuple[Any, ...]:
        return (f["name"], f["kind"], f["severity"], f["cause"], f.get("ranks"))

    assert [finding_key(f) for f in g["findings"]] == [finding_key(f) for f in w["findings"]], (
        f"{what}: findings\n{got}\nvs\n{want}"
    )
    for gf, wf in zip(g["findings"], w["findings"]):
        assert_same_message(gf["message"], wf["message"], f"{what}: {wf['name']} {wf['cause']}")

    assert [(t["name"], t["kind"]) for t in g["tensors"]] == [(t["name"], t["kind"]) for t in w["tensors"]], what
    for gt, wt in zip(g["tensors"], w["tensors"]):
        label = f"{what}: {wt['name']} {wt['kind']}"
        assert gt.keys() == wt.keys() and set(MOMENT_KEYS) <= wt.keys(), f"{label}: fields {sorted(gt)} vs {sorted(wt)}"
        finite = max(1, wt["numel"] - wt["nan"] - wt["inf"])
        scale = wt["norm"] / math.sqrt(finite)  # the floor of a mean that cancels (see helpers.close)
        for key, want_value in wt.items():
            got_value = gt[key]
            ok = close(got_value, want_value, rtol, scale) if key in MOMENT_KEYS else _same_value(got_value, want_value)
            assert ok, f"{label}: {key} {got_value!r} vs {want_value!r}"

    gh, wh = g["history"], w["history"]
    assert (gh["steps"], gh["names"]) == (wh["steps"], wh["names"]), f"{what}: history of other steps or tensors"
    for key in ("zero_fraction", "subnormal_fraction"):
        same = all(_same_value(x, y) for x, y in zip(sum(gh[key], []), sum(wh[key], []), strict=True))
        assert same, f"{what}: history {key} {gh[key]} vs {wh[key]}"
    for got_row, want_row in zip(gh["grad_norm"], wh["grad_norm"], strict=True):
        assert all(close(a, b, rtol, 0.0) for a, b in zip(got_row, want_row, strict=True)), (
            f"{what}: history grad_norm {got_row} vs {want_row}"
        )


def check_monitor_report(device: str, rank: int, world: int, seed: int) -> str:
    """A Monitor over the device's group of a model on `device` reports what a
    Monitor over gloo of the same model on the CPU reports, fed the same
    values. The scenario is real: the NaN gradient is a replica_mismatch
    naming its rank (with one rank: nonfinite), the frozen layer and the
    parameter outside the optimizer are found."""
    cpu_model = _mlp(seed)
    device_model = _mlp(seed).to(device)
    nan_rank = world - 1
    got, want = _train_in_step(cpu_model, device_model, device, seed, nan_rank)

    backend = dist.get_backend()
    assert_same_report(got, want, rtol_for(torch.float32), f"Monitor on {device} over {backend} vs on cpu over gloo")
    causes = {(f.name, f.cause): f.ranks for f in want.detailed}
    nan_finding = (NAN_PARAM, Cause.REPLICA_MISMATCH if world >= 2 else Cause.NONFINITE)
    assert nan_finding in causes, f"no {nan_finding} finding:\n{want}"
    if world >= 2:
        assert causes[nan_finding] == (nan_rank,), f"the NaN was blamed on ranks {causes[nan_finding]}:\n{want}"
    assert {("0.weight", Cause.FROZEN), ("0.bias", Cause.FROZEN), (NOT_IN_OPTIMIZER, Cause.NOT_IN_OPTIMIZER)} <= set(
        causes
    ), f"the frozen layer or the parameter outside the optimizer was not found:\n{want}"
    return "\n".join(f"{f.name} {f.kind} {f.cause.value} {f.ranks}" for f in want.findings)


CHECKS = {
    "merge_stats": check_merge_stats,
    "gather_rows": check_gather_rows,
    "replica_reports": check_replica_reports,
    "monitor_report": check_monitor_report,
}


def checks_on(device: str) -> dict[str, Check]:
    return {name: functools.partial(check, device) for name, check in CHECKS.items()}


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: f"{v.backend}-world{v.size}-{v.device}")
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> World:
    variant: Variant = request.param
    return spawn_world(
        variant.size,
        checks_on(variant.device),
        tmp_path_factory,
        timeout_s=WORLD_TIMEOUT_S,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        backend=variant.backend,
    )


@pytest.mark.parametrize("check", list(CHECKS))
def test_check_passes_on_every_rank(world: World, check: str) -> None:
    """One check of CHECKS (each check_* function above says what it asserts)."""
    world.assert_passed(check)
