"""Ranks that disagree on what a collective call merges: every rank raises
the same one-line error naming the call, none aborts or hangs, and the
group stays usable (zeroscan/distributed/agreement.py).

Two gloo processes, spawned once by this file (bounded in time: an abort or
a hang fails the run), run every check. Each check makes the ranks pass
different things to one collective call, asserts the error, then makes a
matching call that must still merge right; it returns the error's text,
which tests/world.py requires to be the same on every rank. The issue names
stats_many with 3 tensors on one rank and 2 on the other; the other members
of the family (a dtype, a DTensor's global shape or placements, tol, a rank
that refuses its own argument, the other collective calls, the Monitor's
parameters) are said so in each check's docstring.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroscan
import zeroscan.distributed as zd
from test_monitor_distributed import collectives_counted
from world import Check, World, spawn_world
from zeroscan import Monitor

WORLD = 2
WORLD_TIMEOUT_S = 150.0  # every check together takes ~10 s; past this something hung
COLLECTIVE_TIMEOUT_S = 20.0
DISAGREE = "the ranks disagree on what they merge"


def raised(call: Callable[[], object], error: type[Exception] = ValueError) -> str:
    """The error `call` raises: of type `error`, in one line. (Not
    pytest.raises, whose failure is no Exception: the rank would record none.)"""
    try:
        call()
    except error as e:
        message = str(e)
    else:
        raise AssertionError(f"no {error.__name__} raised")
    assert "\n" not in message, message
    return message


def assert_matches(pattern: str, message: str) -> None:
    assert re.fullmatch(pattern, message), f"{message!r} does not match {pattern!r}"


def still_merges(rank: int, seed: int) -> None:
    """A matching collective call right after the error: the group is usable
    and the merge is right (pieces of one tensor, one per rank)."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(10, generator=g)
    got = zd.stats(full[:4] if rank == 0 else full[4:], group=dist.group.WORLD)
    want = zeroscan.stats(full)
    assert (got.numel, got.max_abs, got.min_abs) == (want.numel, want.max_abs, want.min_abs), (got, want)


def mesh() -> object:
    from torch.distributed.tensor import init_device_mesh

    return init_device_mesh("cpu", (WORLD,))


# ------------------------------------------------------------ the checks
# Each runs on every rank and returns the error's text.


def check_stats_many_count(rank: int, world: int, seed: int) -> str:
    """The issue's example: 3 tensors on rank 0, 2 on rank 1."""
    xs = [torch.randn(5) for _ in range(3 if rank == 0 else 2)]
    message = raised(lambda: zd.stats_many(xs, group=dist.group.WORLD))
    assert_matches(
        rf"zeroscan\.distributed\.stats_many: {DISAGREE} \(rank 0: 3 tensors, rank 1: 2 tensors\); "
        r"every rank must pass as many tensors, in the same order", message,
    )
    still_merges(rank, seed)
    return message


def check_stats_many_dtype(rank: int, world: int, seed: int) -> str:
    """Unnamed member: pieces of one tensor of another dtype on one rank."""
    xs = [torch.randn(5), torch.randn(3 + rank, dtype=torch.float64 if rank else torch.float32)]
    message = raised(lambda: zd.stats_many(xs, group=dist.group.WORLD))
    assert_matches(
        rf"zeroscan\.distributed\.stats_many: {DISAGREE} \(rank 0: tensors\[1\] is a float32 piece, "
        r"rank 1: tensors\[1\] is a float64 piece\); every rank must pass the same tensors, in the same order",
        message,
    )
    still_merges(rank, seed)
    return message


def check_stats_many_dtensor_shape(rank: int, world: int, seed: int) -> str:
    """Unnamed member: DTensors whose global shapes differ (their local
    shards may differ by design; their global shape may not)."""
    from torch.distributed.tensor import DTensor, Shard

    device_mesh = mesh()
    ok = DTensor.from_local(torch.ones(2, 3), device_mesh, [Shard(0)], run_check=False)
    odd = DTensor.from_local(torch.ones(2, 3 + rank), device_mesh, [Shard(0)], run_check=False)
    message = raised(lambda: zd.stats_many([ok, odd]))
    assert_matches(
        rf"zeroscan\.distributed\.stats_many: {DISAGREE} \(rank 0: tensors\[1\] is a float32 \[4, 3\] DTensor "
        r"\(Shard\(dim=0\)\), rank 1: tensors\[1\] is a float32 \[4, 4\] DTensor \(Shard\(dim=0\)\)\); .*",
        message,
    )
    # Uneven shards of the same global shape are what sharding does: merged.
    uneven = DTensor.from_local(
        torch.ones(3 - rank, 2), device_mesh, [Shard(0)], run_check=False, shape=torch.Size([5, 2]),
        stride=(2, 1),
    )
    got = zd.stats_many([ok, uneven])
    assert [(s.mode, s.numel) for s in got] == [("sharded", 12), ("sharded", 10)], got
    still_merges(rank, seed)
    return message


def check_stats_placements(rank: int, world: int, seed: int) -> str:
    """Unnamed member, another call: zd.stats of a DTensor sharded on one
    rank and replicated on the other (the same global shape)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    device_mesh = mesh()
    x = (
        DTensor.from_local(torch.ones(2, 3), device_mesh, [Shard(0)], run_check=False)
        if rank == 0
        else DTensor.from_local(torch.ones(4, 3), device_mesh, [Replicate()], run_check=False)
    )
    message = raised(lambda: zd.stats(x))
    assert_matches(
        rf"zeroscan\.distributed\.stats: {DISAGREE} \(rank 0: x is a float32 \[4, 3\] DTensor \(Shard\(dim=0\)\), "
        r"rank 1: x is a float32 \[4, 3\] DTensor \(Replicate\(\)\)\); .*",
        message,
    )
    still_merges(rank, seed)
    return message


def check_stats_many_tol(rank: int, world: int, seed: int) -> str:
    """Unnamed member: the call's options differ (tol)."""
    message = raised(lambda: zd.stats_many([torch.randn(4)], tol=None if rank == 0 else 1e-3, group=dist.group.WORLD))
    assert_matches(
        rf"zeroscan\.distributed\.stats_many: {DISAGREE} \(rank 0: tol=None, rank 1: tol=0\.001\); "
        r"every rank must pass the same options", message,
    )
    still_merges(rank, seed)
    return message


def check_stats_many_refused_on_one_rank(rank: int, world: int, seed: int) -> str:
    """Unnamed member: one rank refuses its own argument; the other would
    wait in the merge for it, and raises the same error instead."""
    xs: list[object] = [torch.randn(4), "a name" if rank == 1 else torch.randn(4)]
    message = raised(lambda: zd.stats_many(xs, group=dist.group.WORLD), TypeError)  # type: ignore[arg-type]
    assert_matches(
        r"zeroscan\.distributed\.stats_many: tensors\[1\] must be a torch\.Tensor, got str "
        r"\(on rank 1; every rank of the group raises it, none merges\)", message,
    )
    still_merges(rank, seed)
    return message


def check_compare_replicas_count(rank: int, world: int, seed: int) -> str:
    """Another collective call, the issue's count: 3 replicas against 2."""
    xs = [torch.ones(4) for _ in range(3 if rank == 0 else 2)]
    message = raised(lambda: zd.compare_replicas(xs))
    assert_matches(
        rf"zeroscan\.distributed\.compare_replicas: {DISAGREE} \(rank 0: 3 tensors, rank 1: 2 tensors\); .*", message
    )
    assert zd.compare_replicas([torch.ones(4)] * 2).ok
    still_merges(rank, seed)
    return message


def check_compare_replicas_shape(rank: int, world: int, seed: int) -> str:
    """Unnamed member: a replica of another shape on one rank (a list in
    another order, say); Stats, whose rows carry dtype and shape, alike."""
    xs = [torch.ones(3), torch.ones(4 + rank)]
    message = raised(lambda: zd.compare_replicas(xs))
    assert_matches(
        rf"zeroscan\.distributed\.compare_replicas: {DISAGREE} \(rank 0: tensors_or_stats\[1\] is a float32 \[4\], "
        r"rank 1: tensors_or_stats\[1\] is a float32 \[5\]\); .*", message,
    )
    assert raised(lambda: zd.compare_replicas(zeroscan.stats_many(xs))) == message
    assert zd.compare_replicas(xs[:1]).ok
    still_merges(rank, seed)
    return message


def check_gather_rows_count(rank: int, world: int, seed: int) -> str:
    """Another collective call: rows for 3 tensors against 2."""
    rows = torch.stack([s.buffer for s in zeroscan.stats_many([torch.ones(2)] * (3 - rank))])
    message = raised(lambda: zd.gather_rows(rows, async_op=True))
    assert_matches(rf"zeroscan\.distributed\.gather_rows: {DISAGREE} \(rank 0: 3 rows, rank 1: 2 rows\); .*", message)
    assert zd.gather_rows(rows[:2]).rows.shape == (WORLD, 2, 16)  # type: ignore[union-attr]
    still_merges(rank, seed)
    return message


def check_merge_stats_dtype(rank: int, world: int, seed: int) -> str:
    """Unnamed member, another call: Stats of pieces of another dtype."""
    piece = torch.randn(3, dtype=torch.bfloat16 if rank else torch.float32)
    message = raised(lambda: zd.merge_stats(zeroscan.stats(piece)))
    assert_matches(
        rf"zeroscan\.distributed\.merge_stats: {DISAGREE} \(rank 0: stats_or_batch is a float32 piece, "
        r"rank 1: stats_or_batch is a bfloat16 piece\); .*", message,
    )
    still_merges(rank, seed)
    return message


def _monitor_one_step(model: nn.Module) -> zeroscan.Report:
    with Monitor(model, process_group=dist.group.WORLD) as monitor:
        model.zero_grad()
        model(torch.randn(5, 3)).square().mean().backward()
        monitor.step()
    return monitor.report()


def check_monitor_extra_parameter(rank: int, world: int, seed: int) -> str:
    """The Monitor, a model with an extra parameter on rank 1: refused when
    the Monitor is built, on every rank; then the same model works."""
    model = nn.Linear(3, 2)
    if rank == 1:
        model.scale = nn.Parameter(torch.ones(2))
    message = raised(lambda: Monitor(model, process_group=dist.group.WORLD))
    assert_matches(
        r"zeroscan\.Monitor: rank 0 monitors 2 parameters and rank 1 3: every rank of process_group must monitor "
        r"the same model .*", message,
    )
    assert _monitor_one_step(nn.Linear(3, 2)).step == 0
    still_merges(rank, seed)
    return message


def _different_parameter(rank: int, how: str) -> nn.Module:
    if rank == 0:
        return nn.Linear(3, 2)
    return nn.Linear(4, 2) if how == "shape" else nn.Linear(3, 2).double()


def check_monitor_parameter_shape(rank: int, world: int, seed: int) -> str:
    """Unnamed member: the same parameter names and count, but rank 1's
    weight has another shape (a model built with another width)."""
    message = raised(lambda: Monitor(_different_parameter(rank, "shape"), process_group=dist.group.WORLD))
    assert_matches(
        r"zeroscan\.Monitor: parameter weight is float32 \[2, 3\] on rank 0 and float32 \[2, 4\] on rank 1: "
        r"every rank of process_group must monitor the same model", message,
    )
    assert _monitor_one_step(nn.Linear(3, 2)).step == 0
    return message


def check_monitor_parameter_dtype(rank: int, world: int, seed: int) -> str:
    """Unnamed member: rank 1's model is in float64."""
    message = raised(lambda: Monitor(_different_parameter(rank, "dtype"), process_group=dist.group.WORLD))
    assert_matches(
        r"zeroscan\.Monitor: parameter weight is float32 \[2, 3\] on rank 0 and float64 \[2, 3\] on rank 1: .*",
        message,
    )
    still_merges(rank, seed)
    return message


def check_monitor_grows_unevenly(rank: int, world: int, seed: int) -> str:
    """Unnamed member, after a change of the model: every rank adds a
    parameter, of another shape on rank 1. The first step after it checks
    again and raises on every rank (again at the next step, for a caller
    that caught it); the checks cost one all-reduce when the Monitor is
    built and one after the change, none per step."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    g = torch.Generator().manual_seed(seed + 1)

    def step() -> None:
        model.zero_grad()
        (model(torch.randn(5, 3, generator=g)) * getattr(model, "scale", 1.0)).square().mean().backward()
        monitor.step()

    with collectives_counted() as calls:
        monitor = Monitor(model, auto=False, process_group=dist.group.WORLD)
        for _ in range(3):
            step()
    assert calls == ["all_reduce"] * (1 + 5 * 3), calls  # the check once, then the merge's 5 per step
    model.scale = nn.Parameter(torch.ones(2 if rank == 0 else 1))
    with collectives_counted() as calls:
        message = raised(step)
    # The check's all-reduce, then two of its failure path (and an all_gather_object, not counted here).
    assert calls == ["all_reduce"] * 3, calls
    assert_matches(
        r"zeroscan\.Monitor: parameter scale is float32 \[2\] on rank 0 and float32 \[1\] on rank 1: .*", message
    )
    assert raised(step) == message
    monitor.close()
    still_merges(rank, seed)
    return message


CHECKS: dict[str, Check] = {
    "stats_many_count": check_stats_many_count,
    "stats_many_dtype": check_stats_many_dtype,
    "stats_many_dtensor_shape": check_stats_many_dtensor_shape,
    "stats_placements": check_stats_placements,
    "stats_many_tol": check_stats_many_tol,
    "stats_many_refused_on_one_rank": check_stats_many_refused_on_one_rank,
    "compare_replicas_count": check_compare_replicas_count,
    "compare_replicas_shape": check_compare_replicas_shape,
    "gather_rows_count": check_gather_rows_count,
    "merge_stats_dtype": check_merge_stats_dtype,
    "monitor_extra_parameter": check_monitor_extra_parameter,
    "monitor_parameter_shape": check_monitor_parameter_shape,
    "monitor_parameter_dtype": check_monitor_parameter_dtype,
    "monitor_grows_unevenly": check_monitor_grows_unevenly,
}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return spawn_world(
        WORLD, CHECKS, tmp_path_factory, timeout_s=WORLD_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S
    )


@pytest.mark.parametrize("check", list(CHECKS))
def test_every_rank_raises_the_same_error_and_the_group_stays_usable(world: World, check: str) -> None:
    """One check of CHECKS (each check_* function above says which member it is)."""
    world.assert_passed(check)
