"""zeroscan.distributed: statistics across ranks with torch.distributed.

Every call here that takes a process group (or a DTensor, whose mesh is
one) is a COLLECTIVE: every rank of the group must make it, in the same
order, or the ranks that did wait until the group's timeout. zeroscan.stats
and zeroscan.stats_many never are: they refuse a DTensor and name the calls
here.

Every rank scans what it holds into result rows (int64 [N, 16], see
zeroscan/record.py), and the ranks merge them with two rounds of
all-reduces whose size does not depend on the world size W
(zeroscan/allreduce.py says what travels, and bounds the moments' error):

  counts          summed (int64, exact)
  min/max |x|     reduced with MIN on the ordered bits of their float64s (exact)
  mean, m2        sums about a shift every rank knows after the first round;
                  stds are never averaged.

Every rank gets the same bits (the all-reduce gives every rank the same
sums, and the rest is computed from them alike). Each rank sends and
receives a few hundred bytes per tensor, on the device the group's backend
uses (NCCL: CUDA, gloo: CPU); with NCCL the all-reduces do not wait on
the host (the per-tensor flags are copied to the device once per call),
with gloo each is waited for before the call returns.

What a rank's tensor means decides how its row is used (each result says so
in its `mode`):

  "local"         a plain tensor and no group: this rank's own statistics.
  "concatenated"  a plain tensor with a group: the ranks' tensors are pieces
                  of one tensor (hand-sharded), and the result is the
                  statistics of all pieces together.
  "sharded"       a DTensor with at least one Shard placement: the result
                  equals the statistics of x.full_tensor(). Ranks that hold
                  a replica of a shard (Replicate mesh dims, as in HSDP)
                  contribute it once, not once per replica.
  "replicated"    a DTensor with only Replicate placements: counted once.
  Partial placements are reduced first (redistributed to Replicate).

Data-parallel replicas (DDP) are compared, not merged: `compare_replicas`
reports which rank's gradient differs from the others (a NaN on one rank
only, a replica that diverged), with every rank's values: it gathers the
rows (W x N x 128 bytes), a diagnostic call. The Monitor compares replicas
without gathering (zeroscan/allreduce.py).

The pieces of a merge by hand: per tensor, `local_part(t, grouped=...)` (a
DTensor's local shard and whether this rank's copy counts); scan the parts
with `zeroscan.scan_buffers` (traceable, CUDA-graph safe) into rows [N, 16];
then `gather_rows(drop_uncounted(rows, parts), group)` and
`GatheredRows.merged()` (exact, the native combine; O(W N) memory) or
`GatheredRows.replica_report(names)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

from zeroscan import allreduce
from zeroscan.ops import check_tensor, check_tol, is_dtensor, refused
from zeroscan.record import NUM_FIELDS, empty_rows
from zeroscan.replicas import ReplicaMismatch, ReplicaReport, replica_report, rows_agree

__all__ = [
    "GatheredRows", "GlobalStats", "LocalPart", "PendingMerge", "ReplicaMismatch", "ReplicaReport",
    "combine_rows", "comm_device", "compare_replicas", "drop_uncounted", "empty_rows", "gather_rows",
    "local_part", "merge_stats", "replica_report", "rows_agree", "stats", "stats_many",
]
from zeroscan.stats import Readout, Stats, StatsBatch, TensorMeta, buffers_of, device_groups

MODE_LOCAL = "local"
MODE_CONCATENATED = "concatenated"
MODE_SHARDED = "sharded"
MODE_REPLICATED = "replicated"

T = TypeVar("T")
U = TypeVar("U")


class GlobalStats(Stats):
    """Stats merged across ranks; `mode` says how (see the module doc) and
    `ranks` how many ranks the merge read (1 for "local")."""

    __slots__ = ("mode", "ranks")

    def __init__(
        self, readout: Readout, index: int, meta: TensorMeta, tol: float | None, mode: str, ranks: int
    ) -> None:
        super().__init__(readout, index, meta, tol)
        self.mode = mode
        self.ranks = ranks

    def to_dict(self) -> dict[str, object]:
        out = super().to_dict()
        out["mode"] = self.mode
        out["ranks"] = self.ranks
        return out

    def __repr__(self) -> str:
        inner = super().__repr__().removeprefix("Stats(").removesuffix(")")
        return f"GlobalStats({inner} mode={self.mode} ranks={self.ranks})"


class PendingMerge(Generic[T]):
    """A collective in flight. `wait()` waits for it, finishes the merge and
    returns the result (the same object on every later call)."""

    def __init__(self, work: dist.Work | None, finish: Callable[[], T]) -> None:
        self._work = work
        self._finish: Callable[[], T] | None = finish
        self._result: T | None = None

    def is_completed(self) -> bool:
        """True once the collective has finished (wait() then does not block on it)."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> T:
        if self._finish is not None:
            if self._work is not None:
                self._work.wait()
            self._result = self._finish()
            self._finish = None
        return self._result  # type: ignore[return-value]

    def then(self, fn: Callable[[T], U]) -> PendingMerge[U]:
        """A PendingMerge for fn(this result), waiting on the same collective."""
        return PendingMerge(self._work, lambda: fn(self.wait()))


# ---------------------------------------------------------------- the merge


def combine_rows(gathered: torch.Tensor) -> torch.Tensor:
    """Merges int64 [W, N, 16] rows (W ranks' results for the same N tensors)
    into int64 [N, 16]: the statistics of each tensor over all W parts.

    The native combine of csrc/stats_record.h in a fixed pairwise tree over
    the rank index, hence identical bits on every rank; it runs where the rows
    are, reads nothing back to the host and traces under torch.compile.
    """
    if gathered.dtype != torch.int64 or gathered.dim() != 3 or gathered.shape[-1] != NUM_FIELDS:
        raise ValueError(
            f"combine_rows: gathered must be an int64 [W, N, {NUM_FIELDS}] tensor, "
            f"got {gathered.dtype} of shape {list(gathered.shape)}"
        )
    if gathered.shape[0] == 0:
        raise ValueError("combine_rows: gathered holds no rank (W == 0)")
    try:
        return torch.ops.zeroscan.combine_rows.default(gathered)
    except RuntimeError as e:  # freed memory, say
        refused("combine_rows", [("gathered", gathered)], e)


# ------------------------------------------------------------ the collective


def _member_group(op: str, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{op}: torch.distributed is not initialized; call torch.distributed.init_process_group() "
            "first, or leave group=None for single-process statistics"
        )
    pg = group if group is not None else dist.group.WORLD
    if dist.get_rank(pg) < 0:
        raise ValueError(f"{op}: this rank (global rank {dist.get_rank()}) is not a member of group")
    return pg  # type: ignore[return-value]


def comm_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """The device on which `group`'s backend exchanges tensors, preferring `device`
    (gloo: CPU, NCCL: the current CUDA device)."""
    try:
        config = str(dist.get_backend_config(group))
    except (AttributeError, RuntimeError, ValueError):
        return device
    backends = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
    if not backends:
        return device
    if device.type == "cpu" and "cpu" in backends:
        return device
    if device.type != "cpu" and backends.get(device.type, "gloo") != "gloo":
        return device
    if "cpu" in backends:
        return torch.device("cpu")
    if "cuda" in backends and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass(frozen=True)
class GatheredRows:
    """Every rank's result rows for the same N tensors, from one all_gather.

    rows: int64 [W, N, 16], block r from the group's rank r.
    ranks: the global rank of each block.
    """

    rows: torch.Tensor
    ranks: tuple[int, ...]

    def merged(self) -> torch.Tensor:
        """int64 [N, 16]: each tensor's statistics over all ranks' parts."""
        return combine_rows(self.rows)

    def replica_report(
        self, names: Sequence[str] | None = None, *, rtol: float = 1e-9, indices: Sequence[int] | None = None
    ) -> ReplicaReport:
        """Which ranks' rows differ, per tensor (see compare_replicas);
        `indices` limits the comparison to those tensors (the replicated ones)."""
        return replica_report(self.rows, self.ranks, names, rtol=rtol, indices=indices)


def gather_rows(
    rows: torch.Tensor, group: dist.ProcessGroup | None = None, *, async_op: bool = False
) -> GatheredRows | PendingMerge[GatheredRows]:
    """All-gathers this rank's int64 [N, 16] (or [16]) result rows in ONE
    collective. Every rank must pass the same N, in the same tensor order.
    With async_op=True it returns at once; `.wait()` gives the GatheredRows."""
    op = "zeroscan.distributed.gather_rows"
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.int64 or rows.shape[-1:] != (NUM_FIELDS,):
        got = f"{rows.dtype} {list(rows.shape)}" if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise ValueError(f"{op}: rows must be an int64 [N, {NUM_FIELDS}] tensor of result rows, got {got}")
    pg = _member_group(op, group)
    world = dist.get_world_size(pg)
    ranks = tuple(dist.get_process_group_ranks(pg))
    local = rows.reshape(-1, NUM_FIELDS).to(comm_device(group, rows.device)).contiguous()
    out = local.new_empty((world * local.shape[0], NUM_FIELDS))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(out, local, group=pg, async_op=async_op)

    def finish() -> GatheredRows:
        return GatheredRows(out.view(world, local.shape[0], NUM_FIELDS), ranks)

    return PendingMerge(work, finish) if async_op else finish()


# ------------------------------------------------ merging Stats across ranks


def _rows_of(items: Sequence[Stats], device: torch.device) -> torch.Tensor:
    if not items:
        return torch.empty((0, NUM_FIELDS), dtype=torch.int64, device=device)
    return torch.stack([s.buffer.to(device) for s in items])


def _scan_rows(
    op: str, tensors: list[torch.Tensor], tol: float | None, device: torch.device, names: Callable[[int], str]
) -> torch.Tensor:
    """int64 [N, 16] on `device`: one row per tensor, in order, from one native
    call per device (no copy when all are on `device`); a refusal names
    `op` and the tensor as names(i)."""
    buffers = buffers_of(op, tensors, tol, names)
    groups = device_groups(tensors)
    if len(groups) == 1 and buffers[0].device == device:
        return buffers[0]
    rows = torch.empty((len(tensors), NUM_FIELDS), dtype=torch.int64, device=device)
    for indices, buffer in zip(groups, buffers):
        rows[indices] = buffer.to(device)
    return rows


def merge_stats(
    stats_or_batch: Stats | StatsBatch, group: dist.ProcessGroup | None = None, *, async_op: bool = False
) -> GlobalStats | StatsBatch | PendingMerge[GlobalStats] | PendingMerge[StatsBatch]:
    """Merges Stats that each rank computed over its piece of the same tensors
    (mode "concatenated"): counts summed, min/max reduced, moments from sums
    about a shared shift; one merge (two rounds of all-reduces) for the whole batch.
    `shape` stays this rank's piece's shape; numel and every other field are
    global. async_op=True gives a PendingMerge, already merged (see the
    module doc on what waits)."""
    op = "zeroscan.distributed.merge_stats"
    single = isinstance(stats_or_batch, Stats)
    if not single and not isinstance(stats_or_batch, StatsBatch):
        raise TypeError(f"{op}: stats_or_batch must be a Stats or StatsBatch, got {type(stats_or_batch).__name__}")
    items: list[Stats] = [stats_or_batch] if single else list(stats_or_batch)  # type: ignore[list-item]
    pg = _member_group(op, group)
    device = items[0].buffer.device if items else torch.device("cpu")
    rows = _rows_of(items, comm_device(pg, device))
    readout = Readout(_merge(rows, [True] * len(items), [True] * len(items), pg))
    world = dist.get_world_size(pg)
    out = [
        GlobalStats(readout, i, (s.dtype, s.shape, s.device), s.tol, MODE_CONCATENATED, world)
        for i, s in enumerate(items)
    ]
    result = out[0] if single else StatsBatch(out)  # type: ignore[arg-type]
    return PendingMerge(None, lambda: result) if async_op else result  # type: ignore[return-value]


def _merge(
    rows: torch.Tensor, counted: Sequence[bool], pieces: Sequence[bool], group: dist.ProcessGroup
) -> torch.Tensor:
    """int64 [N, 16]: the merge over `group` of every rank's rows int64 [N, 16]
    (those not `counted` here stay out; `pieces`: the ranks' rows are pieces
    of one tensor, else copies of it), by all-reduces (zeroscan/allreduce.py)."""
    n = rows.shape[0]
    device = rows.device
    local = allreduce.Local(
        rows,
        torch.ones(n, dtype=torch.bool, device=device),
        torch.tensor(list(counted), dtype=torch.bool, device=device).reshape(n),
        torch.tensor(list(pieces), dtype=torch.bool, device=device).reshape(n),
        torch.full((1,), dist.get_rank(group), dtype=torch.int64, device=device),
        torch.zeros(allreduce.NUM_HEADER, dtype=torch.int64, device=device),
    )
    return allreduce.summary_rows(allreduce.start(local, group), n)


# ------------------------------------------------------- DTensor / sharded


@dataclass(frozen=True)
class LocalPart:
    """What this rank scans for one tensor, and how its row enters the merge.

    tensor: the local data (a DTensor's local shard, or the tensor itself).
    mode: see the module doc.
    counted: False for a rank whose data another rank already contributes
    (a replica along a Replicate mesh dim); its row stays out of the merge
    (the empty row, in a gather), so nothing is counted twice.
    mesh: the DTensor's device mesh, or None.
    """

    tensor: torch.Tensor
    mode: str
    counted: bool
    mesh: object | None = None


def local_part(x: torch.Tensor, *, grouped: bool = False) -> LocalPart:
    """This rank's part of `x`: a DTensor's local shard (Partial placements
    are reduced first), or `x` itself, "concatenated" when `grouped` (merged
    across a group) else "local"."""
    if not is_dtensor(x):
        return LocalPart(x, MODE_CONCATENATED if grouped else MODE_LOCAL, True)
    from torch.distributed.tensor import Replicate

    placements = tuple(x.placements)
    if any(p.is_partial() for p in placements):
        placements = tuple(Replicate() if p.is_partial() else p for p in placements)
        x = x.redistribute(x.device_mesh, placements)
    mesh = x.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("zeroscan.distributed: this rank is not in the DTensor's device mesh")
    sharded = any(p.is_shard() for p in placements)
    counted = all(c == 0 for c, p in zip(coordinate, placements) if not p.is_shard())
    with torch.no_grad():
        local = x.to_local()
    return LocalPart(local, MODE_SHARDED if sharded else MODE_REPLICATED, counted, mesh)


def drop_uncounted(rows: torch.Tensor, parts: Sequence[LocalPart]) -> torch.Tensor:
    """rows int64 [N, 16] (one per part) with the rows of uncounted parts
    replaced by the empty row: what this rank should gather."""
    if all(p.counted for p in parts):
        return rows
    counted = torch.tensor([p.counted for p in parts], device=rows.device).unsqueeze(1)
    return torch.where(counted, rows, empty_rows(len(parts), rows.device))


def _mesh_group(op: str, mesh: object, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A group holding exactly the mesh's ranks: `group` if given (checked),
    the mesh's own group for a 1-D mesh, else the world when the mesh spans it."""
    mesh_ranks = sorted(mesh.mesh.flatten().tolist())  # type: ignore[attr-defined]
    if group is not None:
        if sorted(dist.get_process_group_ranks(group)) != mesh_ranks:
            raise ValueError(f"{op}: group must hold exactly the DTensor mesh's ranks {mesh_ranks}")
        return group
    if mesh.ndim == 1:  # type: ignore[attr-defined]
        return mesh.get_group()  # type: ignore[attr-defined]
    if mesh_ranks == list(range(dist.get_world_size())):
        return dist.group.WORLD
    raise ValueError(
        f"{op}: the DTensor's {mesh.ndim}-D mesh does not span the world; "  # type: ignore[attr-defined]
        "pass group=, a process group over exactly the mesh's ranks"
    )


def stats_many(
    tensors: Iterable[torch.Tensor],
    *,
    tol: float | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> StatsBatch | PendingMerge[StatsBatch]:
    """zeroscan.stats_many for tensors spread over ranks: DTensors (FSDP2
    parameters and gradients) by their placements, plain tensors as pieces of
    one tensor when `group` is given, else locally (see the module doc).
    One merge for the whole list; every result is a GlobalStats."""
    op = "zeroscan.distributed.stats_many"
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"{op}: tensors must be a list of tensors, got a single tensor; use stats(x)")
    xs = [check_tensor(op, "tensors", t, i, collective=True) for i, t in enumerate(tensors)]
    return _stats_many(op, xs, lambda i: f"tensors[{i}]", tol=tol, group=group, async_op=async_op)


def _stats_many(
    op: str,
    xs: list[torch.Tensor],
    names: Callable[[int], str],
    *,
    tol: float | None,
    group: dist.ProcessGroup | None,
    async_op: bool,
) -> StatsBatch | PendingMerge[StatsBatch]:
    """stats_many of checked tensors as the public call `op` makes it: a
    refusal names tensor i as names(i)."""
    tol = check_tol(op, tol)
    if not xs:
        empty = StatsBatch([])
        return PendingMerge(None, lambda: empty) if async_op else empty
    parts = [local_part(x, grouped=group is not None) for x in xs]
    meshes: list[object] = []
    for part in parts:
        if part.mesh is not None and all(part.mesh is not m and part.mesh != m for m in meshes):
            meshes.append(part.mesh)
    if len(meshes) > 1:
        raise ValueError(f"{op}: the DTensors live on {len(meshes)} different device meshes; scan each mesh's apart")
    pg = _mesh_group(op, meshes[0], group) if meshes else group
    collective = bool(meshes) or group is not None
    if collective:
        pg = _member_group(op, pg)

    locals_ = [p.tensor for p in parts]
    device = comm_device(pg, locals_[0].device) if collective else locals_[0].device
    rows = _scan_rows(op, locals_, tol, device, names)

    def build(final: torch.Tensor, world: int) -> StatsBatch:
        readout = Readout(final)
        return StatsBatch(
            [
                GlobalStats(
                    readout,
                    i,
                    (x.dtype, x.shape, p.tensor.device),
                    tol,
                    p.mode,
                    1 if p.mode == MODE_LOCAL else world,
                )
                for i, (x, p) in enumerate(zip(xs, parts))
            ]
        )

    if not collective:
        batch = build(rows, 1)
        return PendingMerge(None, lambda: batch) if async_op else batch
    pieces = [p.mode != MODE_REPLICATED for p in parts]
    final = _merge(rows, [p.counted for p in parts], pieces, pg)  # type: ignore[arg-type]
    if any(p.mode == MODE_LOCAL for p in parts):
        local = torch.tensor([p.mode == MODE_LOCAL for p in parts], device=device).unsqueeze(1)
        final = torch.where(local, rows, final)
    batch = build(final, dist.get_world_size(pg))
    return PendingMerge(None, lambda: batch) if async_op else batch


def stats(
    x: torch.Tensor,
    *,
    tol: float | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> GlobalStats | PendingMerge[GlobalStats]:
    """zeroscan.stats for a tensor spread over ranks. For a DTensor the result
    is zeroscan.stats(x.full_tensor()) without gathering the tensor (counts
    and min/max exactly, the moments within the bound of
    zeroscan/allreduce.py); its `mode` says how it was merged (see the module
    doc)."""
    op = "zeroscan.distributed.stats"
    result = _stats_many(op, [check_tensor(op, "x", x, collective=True)], lambda i: "x", tol=tol, group=group,
                         async_op=async_op)
    if isinstance(result, PendingMerge):
        return result.then(lambda batch: batch[0])  # type: ignore[return-value]
    return result[0]  # type: ignore[return-value]


def compare_replicas(
    tensors_or_stats: Sequence[torch.Tensor] | StatsBatch | Stats,
    group: dist.ProcessGroup | None = None,
    *,
    names: Sequence[str] | None = None,
    tol: float | None = None,
    rtol: float = 1e-9,
    async_op: bool = False,
) -> ReplicaReport | PendingMerge[ReplicaReport]:
    """Checks that data-parallel replicas hold the same tensors (DDP gradients
    after their all-reduce, replicated parameters): one all_gather of the
    statistics rows, then a per-tensor comparison of every rank's row.

    Counts and min/max |x| must be equal; mean and m2 may differ by `rtol`
    relative to their scale (reduction order). A rank that disagrees, for
    instance with a NaN only it has, is reported by its global rank.
    `tensors_or_stats`: the tensors themselves (scanned here) or their Stats.
    """
    op = "zeroscan.distributed.compare_replicas"
    pg = _member_group(op, group)
    if isinstance(tensors_or_stats, (Stats, StatsBatch)):
        items = [tensors_or_stats] if isinstance(tensors_or_stats, Stats) else list(tensors_or_stats)
        device = items[0].buffer.device if items else torch.device("cpu")
        rows = _rows_of(items, comm_device(pg, device))
    elif isinstance(tensors_or_stats, torch.Tensor):
        raise TypeError(f"{op}: pass a list of tensors (or their Stats), got a single tensor; wrap it in a list")
    else:
        tol = check_tol(op, tol)
        xs = [check_tensor(op, "tensors_or_stats", t, i, collective=True) for i, t in enumerate(tensors_or_stats)]
        device = comm_device(pg, xs[0].device if xs else torch.device("cpu"))
        rows = _scan_rows(op, xs, tol, device, lambda i: f"tensors_or_stats[{i}]") if xs else torch.empty((0, NUM_FIELDS), dtype=torch.int64, device=device)
    pending = gather_rows(rows, pg, async_op=True)
    report = pending.then(lambda gathered: gathered.replica_report(names, rtol=rtol))  # type: ignore[union-attr]
    return report if async_op else report.wait()
