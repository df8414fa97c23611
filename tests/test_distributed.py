"""zeroscan.distributed: exact merging across ranks, replica comparison, DTensor.

The merge itself is pure torch and is checked in-process against one scan of
the whole tensor. The collectives are checked on a world of 4 gloo processes
(tests/world.py), and on a 2-rank subgroup of them, spawned once: every rank
runs every check, and one test per check reads what the ranks recorded. The
sharded checks use torch's own DTensor and FSDP2 (fully_shard) on CPU/gloo.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import zeroscan
import zeroscan.distributed as zd
from helpers import (
    FLOAT_DTYPES,
    INT_DTYPES,
    assert_matches_reference,
    assert_same_stats,
    fresh_generator,
    make_values,
    stats_of_row,
)
from world import Check, World, spawn_world

WORLD_TIMEOUT_S = 120.0  # a run of all checks takes ~10 s; past this it is a hang
COLLECTIVE_TIMEOUT_S = 60.0
MOMENT_RTOL = 1e-12  # float64 moments of the merge vs one scan of the whole tensor


def moment_rtol(dtype: torch.dtype) -> float:
    """float64 and integer tensors are accumulated in float64 by the kernel, so
    the merge must match one scan to 1e-12; narrower floats are accumulated in
    float32 per chunk, and the chunks of a piece differ from those of the whole."""
    return MOMENT_RTOL if dtype == torch.float64 or not dtype.is_floating_point else 1e-6


# ------------------------------------------------------------ in-process


def split_points(n: int, parts: int, g: torch.Generator) -> list[int]:
    cuts = sorted(torch.randint(0, n + 1, (parts - 1,), generator=g).tolist())
    return [0] + cuts + [n]


@pytest.mark.parametrize("parts", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.int32])
def test_combine_rows_equals_one_scan_of_the_whole(parts: int, dtype: torch.dtype) -> None:
    g = fresh_generator()
    full = make_values(int(torch.randint(0, 50_000, (), generator=g)), dtype, g)
    if dtype.is_floating_point and full.numel():
        full = (full.double() + 1000.0 * float(torch.rand((), generator=g))).to(dtype)  # offset: Chan's formula matters
    cuts = split_points(full.numel(), parts, g)
    rows = torch.stack([zeroscan.stats(full[a:b]).buffer for a, b in zip(cuts, cuts[1:])])
    merged = zd.combine_rows(rows.unsqueeze(1))
    got = stats_of_row(merged, full)
    assert_same_stats(got, zeroscan.stats(full), moment_rtol(dtype), what=f"{dtype} in {parts} parts")
    assert_matches_reference(got, full)
    assert torch.equal(merged[0], zd.combine_rows(rows.unsqueeze(1))[0])  # deterministic bits


def test_combine_rows_of_empty_parts_is_the_empty_row() -> None:
    g = fresh_generator()
    x = make_values(1000, torch.float32, g)
    rows = torch.stack([zeroscan.stats(x[:0]).buffer, zeroscan.stats(x).buffer, zeroscan.stats(x[:0]).buffer])
    assert torch.equal(zd.combine_rows(rows.unsqueeze(1))[0], zeroscan.stats(x).buffer)
    assert torch.equal(zd.combine_rows(zd.empty_rows(4).unsqueeze(1))[0], zeroscan.stats(x[:0]).buffer)


def test_combine_rows_rejects_a_wrong_shape() -> None:
    with pytest.raises(ValueError, match=r"gathered must be an int64 \[W, N, 16\]"):
        zd.combine_rows(torch.zeros(3, 16, dtype=torch.int64))


def gathered_from(tensors_per_rank: list[list[torch.Tensor]]) -> zd.GatheredRows:
    rows = torch.stack([_rows(ts) for ts in tensors_per_rank])
    return zd.GatheredRows(rows, tuple(range(len(tensors_per_rank))))


def _rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([s.buffer for s in zeroscan.stats_many(tensors)])


@pytest.mark.parametrize("world", [2, 3, 5])
def test_replica_report_names_the_rank_with_a_nan(world: int) -> None:
    g = fresh_generator()
    grads = [make_values(n, torch.float32, g, specials=False) for n in (300, 1, 4000)]
    bad_rank = int(torch.randint(0, world, (), generator=g))
    per_rank = [[t.clone() for t in grads] for _ in range(world)]
    per_rank[bad_rank][2][17] = math.nan
    report = gathered_from(per_rank).replica_report(names=["a", "b", "c"])
    assert not report.ok
    assert report.offending_ranks == (bad_rank,)
    (m,) = report.mismatches
    assert (m.index, m.name, m.ranks, m.ambiguous) == (2, "c", (bad_rank,), False)
    assert m.fields["nan"] == tuple(1 if r == bad_rank else 0 for r in range(world))
    assert "c: rank(s)" in str(report)
    assert gathered_from([grads] * world).replica_report().ok


def test_replica_report_breaks_a_two_rank_tie_by_lowest_rank_and_says_so() -> None:
    g = fresh_generator()
    x = make_values(5000, torch.float64, g, specials=False)
    report = gathered_from([[x], [x * (1 + 1e-6)]]).replica_report()
    (m,) = report.mismatches
    assert (m.ranks, m.reference_ranks, m.ambiguous) == ((1,), (0,), True)
    assert "mean" in m.fields and "numel" not in m.fields


def test_rows_agree_tolerates_reduction_order_only() -> None:
    g = fresh_generator()
    x = make_values(10_000, torch.float64, g, specials=False)
    a = zeroscan.stats(x).buffer
    b = zeroscan.stats(x.flip(0)).buffer  # same values, another summation order
    assert bool(zd.rows_agree(a, b, 1e-9))
    y = x.clone()
    y[0] = y[0] * 1.01  # a real change keeps counts and perhaps min/max
    assert not bool(zd.rows_agree(a, zeroscan.stats(y).buffer, 1e-9))


def test_without_a_group_stats_are_local() -> None:
    g = fresh_generator()
    x = make_values(777, torch.float32, g)
    s = zd.stats(x)
    assert isinstance(s, zd.GlobalStats) and (s.mode, s.ranks) == ("local", 1)
    assert torch.equal(s.buffer, zeroscan.stats(x).buffer)
    assert "mode=local" in repr(s) and s.to_dict()["mode"] == "local"
    pending = zd.stats_many([x, x[::3]], async_op=True)
    assert [t.mode for t in pending.wait()] == ["local", "local"]


@pytest.mark.skipif(dist.is_available() and dist.is_initialized(), reason="a process group is already initialized")
def test_merge_without_torch_distributed_says_so() -> None:
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        zd.merge_stats(zeroscan.stats(torch.ones(3)))
    with pytest.raises(ValueError, match=r"rows must be an int64 \[N, 16\]"):
        zd.gather_rows(torch.zeros(3, 16))


# --------------------------------------------------------- spawned worlds


def _full_tensors(seed: int) -> list[torch.Tensor]:
    """The same list on every rank: mixed dtypes, sizes and layouts."""
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float64, *FLOAT_DTYPES, *INT_DTYPES[2:]]
    out = []
    for i, dtype in enumerate(dtypes):
        n = int(torch.randint(0, 8_000, (), generator=g)) if i % 5 else 0
        x = make_values(n, dtype, g)
        if i % 3 == 1 and n >= 8:  # a non-contiguous 2-D view, split along its rows
            cols = 4
            x = x[: n - n % cols].reshape(cols, -1).t()
        out.append(x)
    return out


def _pieces(full: list[torch.Tensor], rank: int, world: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for x in full:
        cuts = split_points(x.shape[0] if x.dim() else 0, world, g)
        out.append(x[cuts[rank] : cuts[rank + 1]])
    return out


def _all_equal_across_ranks(t: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, t, group=group)
    return all(torch.equal(gathered[0], x) for x in gathered)


def _subgroup() -> dist.ProcessGroup:
    """Global ranks 1 and 2 (every rank must create it): a group whose ranks
    are not 0..k-1, so results must name global ranks."""
    return dist.new_group([1, 2])


def check_concatenated_merge(rank: int, world: int, seed: int) -> None:
    sub = _subgroup()
    for group in (None, sub):
        if dist.get_rank(group) < 0:
            continue
        size, index = dist.get_world_size(group), dist.get_rank(group)
        full = _full_tensors(seed)
        pieces = _pieces(full, index, size, seed)
        local = zeroscan.stats_many(pieces)
        merged = zd.merge_stats(local, group)
        pending = zd.merge_stats(local, group, async_op=True)
        via_stats_many = zd.stats_many(pieces, group=group if group is not None else dist.group.WORLD)
        one = zd.merge_stats(zeroscan.stats(pieces[1]), group)
        async_merged = pending.wait()
        rows = torch.stack([s.buffer for s in merged])
        same_everywhere = _all_equal_across_ranks(rows, group)

        want = zeroscan.stats_many(full)
        for i, (x, got, w) in enumerate(zip(full, merged, want)):
            assert isinstance(got, zd.GlobalStats) and (got.mode, got.ranks) == ("concatenated", size)
            assert_same_stats(got, w, moment_rtol(x.dtype), what=f"tensor {i} ({x.dtype}) over {size} ranks")
            assert_matches_reference(got, x)
            assert torch.equal(got.buffer, async_merged[i].buffer)
            assert torch.equal(got.buffer, via_stats_many[i].buffer)
        assert torch.equal(one.buffer, merged[1].buffer)
        assert same_everywhere, "ranks hold different merged bits"


def check_replicas(rank: int, world: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 2)
    grads = [make_values(n, torch.float32, g, specials=False) for n in (1000, 1, 5000, 64, 2048, 300)]
    names = [f"layer{i}.grad" for i in range(len(grads))]
    clean = zd.compare_replicas(grads, names=names)

    nan_rank = (seed % (world - 1)) + 1
    with_nan = [t.clone() for t in grads]
    if rank == nan_rank:
        with_nan[2][123] = math.nan
    nan_report = zd.compare_replicas(zeroscan.stats_many(with_nan), names=names)

    diverged = [t.clone() for t in grads]
    if rank == world - 1:
        diverged[4] = diverged[4] * 1.001
    div_report = zd.compare_replicas(diverged, async_op=True).wait()

    sub = _subgroup()  # global ranks 1 and 2; rank 2 alone has a -inf
    sub_grads = [t.clone() for t in grads]
    if rank == 2:
        sub_grads[0][5] = -math.inf
    sub_report = zd.compare_replicas(sub_grads, sub) if rank in (1, 2) else None

    assert clean.ok, str(clean)
    assert nan_report.offending_ranks == (nan_rank,), str(nan_report)
    (m,) = nan_report.mismatches
    assert (m.index, m.name, m.ambiguous) == (2, "layer2.grad", False)
    assert m.fields["nan"][nan_rank] == 1
    assert div_report.offending_ranks == (world - 1,), str(div_report)
    assert div_report.mismatches[0].index == 4
    assert div_report.mismatches[0].ambiguous == (world == 2)
    if sub_report is not None:
        assert sub_report.ranks == (1, 2)
        assert sub_report.offending_ranks == (2,), str(sub_report)
        assert sub_report.mismatches[0].fields["neginf"] == (0, 1)


def check_dtensor_1d(rank: int, world: int, seed: int) -> None:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed + 3)
    full = make_values((2 * world + 1) * 3, torch.float64, g).reshape(2 * world + 1, 3)  # uneven shards
    cases = {
        "Shard(0)": distribute_tensor(full, mesh, [Shard(0)]),
        "Shard(1)": distribute_tensor(full, mesh, [Shard(1)]),  # 3 columns: some ranks hold none
        "Replicate": distribute_tensor(full, mesh, [Replicate()]),
    }
    results = {name: zd.stats(d) for name, d in cases.items()}
    batch = zd.stats_many([cases["Shard(0)"], cases["Replicate"], full[1:]])  # one collective
    # zeroscan.stats / stats_many hand DTensors to the distributed merge themselves.
    # zeroscan.stats is never a collective: it refuses a DTensor and names the call that is.
    with pytest.raises(ValueError, match=r"x is a DTensor.*zeroscan\.distributed\.stats"):
        zeroscan.stats(cases["Shard(1)"])
    with pytest.raises(ValueError, match=r"tensors\[0\] is a DTensor.*zeroscan\.distributed\.stats"):
        zeroscan.stats_many([cases["Shard(0)"], full[1:]])
    with pytest.raises(ValueError, match=r"tensors\[0\] is a DTensor"):
        zeroscan.scan_buffers([cases["Shard(0)"]])
    via_batch = zd.stats_many([cases["Shard(1)"], full[1:]])
    assert [s.mode for s in via_batch] == ["sharded", "local"]
    assert torch.equal(via_batch[0].buffer, results["Shard(1)"].buffer)

    locals_ = [torch.randint(-9, 10, (5, 4), generator=g).double() for _ in range(world)]
    locals_[0][1, 1] = math.nan
    partial = DTensor.from_local(locals_[rank], mesh, [Partial()])
    partial_stats = zd.stats(partial, async_op=True).wait()

    want = zeroscan.stats(full)
    for name, s in results.items():
        mode = "replicated" if name == "Replicate" else "sharded"
        assert (s.mode, s.ranks, s.shape) == (mode, world, full.shape), name
        assert_same_stats(s, want, MOMENT_RTOL, what=name)
    assert [s.mode for s in batch] == ["sharded", "replicated", "local"]
    assert_same_stats(batch[0], want, MOMENT_RTOL, what="batch Shard(0)")
    assert_same_stats(batch[1], want, MOMENT_RTOL, what="batch Replicate")
    assert torch.equal(batch[2].buffer, zeroscan.stats(full[1:]).buffer)
    summed = torch.stack(locals_).sum(0)  # integer-valued: every summation order agrees
    assert partial_stats.mode == "replicated"
    assert_same_stats(partial_stats, zeroscan.stats(summed), MOMENT_RTOL, what="Partial")


def check_fsdp2(rank: int, world: int, seed: int) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed % 2**31)
    model = torch.nn.Sequential(torch.nn.Linear(6, 2 * world + 3), torch.nn.ReLU(), torch.nn.Linear(2 * world + 3, 3))
    fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(seed + rank)
    model(torch.randn(8, 6, generator=g)).square().mean().backward()
    names = [n for n, _ in model.named_parameters()]
    grads = [p.grad for p in model.parameters()]
    params = [p.detach() for p in model.parameters()]
    got = zd.stats_many(grads + params, async_op=True).wait()
    full = [t.full_tensor() for t in grads + params]

    for name, s, x in zip(names + names, got, full):
        assert (s.mode, s.shape) == ("sharded", x.shape), name
        assert_same_stats(s, zeroscan.stats(x), 1e-6, what=name)


def check_dtensor_2d(rank: int, world: int, seed: int) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(seed + 4)
    full = make_values(9 * 5, torch.float64, g).reshape(9, 5)
    cases = [(Replicate(), Shard(0)), (Shard(0), Shard(1)), (Shard(1), Replicate()), (Replicate(), Replicate())]
    dts = [distribute_tensor(full, mesh, list(p)) for p in cases]
    batch = zd.stats_many(dts)
    want = zeroscan.stats(full)
    for placements, s in zip(cases, batch):
        mode = "replicated" if all(isinstance(p, Replicate) for p in placements) else "sharded"
        assert (s.mode, s.ranks) == (mode, 4), placements
        assert_same_stats(s, want, MOMENT_RTOL, what=str(placements))


def check_monitor_recipe(rank: int, world: int, seed: int) -> None:
    """The per-step path a Monitor takes: sharded DTensor gradients and DDP-style
    replicas in one gather; the first merged, the second compared."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed + 5)
    full = [make_values(n, torch.float32, g).reshape(-1, 3) for n in (3 * world + 3, 30, 3)]
    sharded = [distribute_tensor(x, mesh, [Shard(0)]) for x in full]
    replicas = [make_values(n, torch.bfloat16, g, specials=False) for n in (100, 7)]
    if rank == world - 2:
        replicas[1][3] = math.inf
    tensors = sharded + replicas
    parts = [zd.local_part(t) for t in tensors]
    step = torch.compile(zeroscan.scan_buffers, backend="eager", fullgraph=True)
    (rows,) = step([p.tensor for p in parts])
    pending = zd.gather_rows(zd.drop_uncounted(rows, parts), async_op=True)
    gathered = pending.wait()
    merged = gathered.merged()
    report = gathered.replica_report(indices=[3, 4])

    assert [p.mode for p in parts] == ["sharded"] * 3 + ["local"] * 2
    for i, x in enumerate(full):
        assert_same_stats(stats_of_row(merged, x, i), zeroscan.stats(x), 1e-6, what=f"grad {i}")
    assert report.offending_ranks == (world - 2,), str(report)
    assert [m.index for m in report.mismatches] == [4]


CHECKS: dict[str, Check] = {
    "concatenated_merge": check_concatenated_merge,
    "replicas": check_replicas,
    "dtensor_1d": check_dtensor_1d,
    "fsdp2": check_fsdp2,
    "dtensor_2d": check_dtensor_2d,
    "monitor_recipe": check_monitor_recipe,
}


@pytest.fixture(scope="module", params=[4], ids=lambda w: f"world{w}")
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> World:
    return spawn_world(
        request.param, CHECKS, tmp_path_factory, timeout_s=WORLD_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S
    )


@pytest.mark.parametrize("check", list(CHECKS))
def test_check_passes_on_every_rank(world: World, check: str) -> None:
    """One check of CHECKS (each check_* function above says what it asserts)."""
    world.assert_passed(check)
