"""Statistics across ranks by all-reduces: zeroscan.distributed's stats,
stats_many and merge_stats (each result a GlobalStats), and local_part and
drop_uncounted, the parts of a merge by hand.

Each call first checks, in one all-reduce of two words, that the ranks
agree on what they merge (as many tensors, the same dtypes, a DTensor's
global shape, the same tol), and where they do not every rank raises the
same one-line error instead of merging (zeroscan/distributed/agreement.py).

Every rank scans what it holds into result rows (int64 [N, 16], see
zeroscan/result_row.py), and the ranks merge them with two rounds of
all-reduces whose size does not depend on the world size W
(zeroscan/distributed/allreduce.py says what travels, and bounds the
moments' error):

  counts          summed (int64, exact)
  min/max |x|     reduced with MIN on the ordered bits of their float64s (exact)
  mean, m2        sums about a shift every rank knows after the first round;
                  stds are never averaged.

Every rank gets the same bits (the all-reduce gives every rank the same
sums, and the rest is computed from them alike). Each rank sends and
receives a few hundred bytes per tensor, on the device the group's backend
uses (NCCL: CUDA, gloo: CPU); with NCCL the merge's all-reduces do not
wait on the host (the per-tensor flags are copied to the device once per
call), though the agreement check before them reads its two words back
(on the CPU where the group has a CPU backend); with gloo each all-reduce
is waited for before the call returns.

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

The pieces of a merge by hand: per tensor, `local_part(t, grouped=...)` (a
DTensor's local shard and whether this rank's copy counts); scan the parts
with `zeroscan.scan_buffers` (traceable, CUDA-graph safe) into rows [N, 16];
then `gather_rows(drop_uncounted(rows, parts), group)` and
`GatheredRows.merged()` (exact, the native combine; O(W N) memory) or
`GatheredRows.replica_report(names)` (zeroscan/distributed/gather.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zeroscan.distributed import allreduce
from zeroscan.distributed.agreement import Merged, check_agreement, tensor_words
from zeroscan.distributed.common import PendingMerge, check_rows, comm_device, group_for, rows_of, scan_rows
from zeroscan.ops import check_tensor, check_tol, is_dtensor, require_readable
from zeroscan.result_row import NUM_FIELDS, empty_rows
from zeroscan.stats import Readout, Stats, StatsBatch, TensorMeta, check_flag, tensor_list
from zeroscan.words import count_noun

MODE_LOCAL = "local"
MODE_CONCATENATED = "concatenated"
MODE_SHARDED = "sharded"
MODE_REPLICATED = "replicated"


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


# ------------------------------------------------ merging Stats across ranks


def merge_stats(
    stats_or_batch: Stats | StatsBatch, group: dist.ProcessGroup | None = None, *, async_op: bool = False
) -> GlobalStats | StatsBatch | PendingMerge[GlobalStats] | PendingMerge[StatsBatch]:
    """Merges Stats that each rank computed over its piece of the same tensors
    (mode "concatenated"): counts summed, min/max reduced, moments from sums
    about a shared shift; one merge (two rounds of all-reduces) for the whole batch.
    `shape` stays this rank's piece's shape; numel and every other field are
    global. The ranks must pass as many Stats, of the same dtypes and tol
    (checked first, see zeroscan/distributed/agreement.py). async_op=True
    gives a PendingMerge, already merged (see the module doc on what waits)."""
    op = "zeroscan.distributed.merge_stats"
    single = isinstance(stats_or_batch, Stats)
    refusal = None
    items: list[Stats] = []
    if single:
        items = [stats_or_batch]  # type: ignore[list-item]
    elif isinstance(stats_or_batch, StatsBatch):
        items = list(stats_or_batch)
    else:
        refusal = TypeError(f"{op}: stats_or_batch must be a Stats or StatsBatch, got {type(stats_or_batch).__name__}")
    pg = group_for(op, group, refusal)
    described = [
        ("stats_or_batch" if single else f"stats_or_batch[{i}]", f"a {_piece(s.dtype, s.tol)}")
        for i, s in enumerate(items)
    ]
    check_agreement(op, pg, Merged("Stats", len(items), described, refusal=refusal))
    device = items[0].buffer.device if items else torch.device("cpu")
    rows = rows_of(items, comm_device(pg, device))
    readout = Readout(_merge(rows, [True] * len(items), [True] * len(items), pg))
    world = dist.get_world_size(pg)
    out = [
        GlobalStats(readout, i, (s.dtype, s.shape, s.device), s.tol, MODE_CONCATENATED, world)
        for i, s in enumerate(items)
    ]
    result = out[0] if single else StatsBatch(out)  # type: ignore[arg-type]
    return PendingMerge(None, lambda: result) if async_op else result  # type: ignore[return-value]


def _piece(dtype: torch.dtype, tol: float | None) -> str:
    """What the ranks must agree on about a piece of a hand-sharded tensor:
    its dtype and tol (its shape is its own)."""
    return f"{str(dtype).removeprefix('torch.')} piece" + ("" if tol is None else f" (tol={tol!r})")


def _merge(
    rows: torch.Tensor, counted: Sequence[bool], pieces: Sequence[bool], group: dist.ProcessGroup
) -> torch.Tensor:
    """int64 [N, 16]: the merge over `group` of every rank's rows int64 [N, 16]
    (those not `counted` here stay out; `pieces`: the ranks' rows are pieces
    of one tensor, else copies of it), by all-reduces (zeroscan/distributed/allreduce.py)."""
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
    op = "zeroscan.distributed.local_part"
    check_flag(op, "grouped", grouped)
    if not is_dtensor(x):
        # A plain x is the part itself, which the caller scans next: refused
        # now where the scan would refuse it. A DTensor's local shard is
        # checked by the scan that reads it (scan_buffers, the Monitor's).
        require_readable(op, "x", x)
    return _local_part(op, x, grouped)


def _local_part(op: str, x: torch.Tensor, grouped: bool) -> LocalPart:
    """local_part of an x already checked, for the public call `op`."""
    if not is_dtensor(x):
        return LocalPart(x, _mode_of(x, grouped), True)
    from torch.distributed.tensor import Replicate

    placements = tuple(x.placements)
    if any(p.is_partial() for p in placements):
        placements = tuple(Replicate() if p.is_partial() else p for p in placements)
        x = x.redistribute(x.device_mesh, placements)
    mesh = x.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"{op}: this rank is not in the DTensor's device mesh")
    counted = all(c == 0 for c, p in zip(coordinate, placements) if not p.is_shard())
    with torch.no_grad():
        local = x.to_local()
    return LocalPart(local, _mode_of(x, grouped), counted, mesh)


def _mode_of(x: torch.Tensor, grouped: bool) -> str:
    """How x enters a merge (see the module doc), from its placements alone:
    no collective (a Partial placement is reduced to Replicate)."""
    if not is_dtensor(x):
        return MODE_CONCATENATED if grouped else MODE_LOCAL
    return MODE_SHARDED if any(p.is_shard() for p in x.placements) else MODE_REPLICATED  # type: ignore[attr-defined]


def _must_agree(x: torch.Tensor, mode: str) -> str:
    """What every rank must hold alike of x in a merge of `mode`: a
    DTensor's dtype, global shape and placements; a piece's dtype (its shape
    is its own); nothing of a local tensor, which stays out of the merge."""
    if mode == MODE_LOCAL:
        return "a local tensor"
    if mode == MODE_CONCATENATED:
        return f"a {_piece(x.dtype, None)}"
    return f"a {tensor_words(x.dtype, x.shape, x.placements)}"  # type: ignore[attr-defined]


def drop_uncounted(rows: torch.Tensor, parts: Sequence[LocalPart]) -> torch.Tensor:
    """rows int64 [N, 16] (one per part) with the rows of uncounted parts
    replaced by the empty row: what this rank should gather."""
    op = "zeroscan.distributed.drop_uncounted"
    rows = check_rows(op, "rows", rows, f"[N, {NUM_FIELDS}]", (2,))
    if isinstance(parts, (str, bytes)) or not isinstance(parts, Sequence):
        raise TypeError(f"{op}: parts must be a list of LocalPart (one per row), got {type(parts).__name__}")
    if len(parts) != rows.shape[0]:
        given = count_noun(len(parts), "entry", "entries")
        raise ValueError(f"{op}: parts has {given} for {count_noun(rows.shape[0], 'row')}")
    counted: list[bool] = []
    for i, p in enumerate(parts):
        if not isinstance(p, LocalPart):
            raise TypeError(f"{op}: parts[{i}] must be a LocalPart (from local_part), got {type(p).__name__}")
        counted.append(p.counted)
    if all(counted):
        return rows
    mask = torch.tensor(counted, device=rows.device).unsqueeze(1)
    return torch.where(mask, rows, empty_rows(len(parts), rows.device))


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
    One merge for the whole list; every result is a GlobalStats. The ranks
    must pass as many tensors, each of the same dtype (and a DTensor of the
    same global shape and placements), and the same tol: checked first, and
    every rank raises the same error where they differ."""
    op = "zeroscan.distributed.stats_many"
    given: list[object] = []
    not_a_list: TypeError | None = None
    try:
        given = tensor_list(op, tensors, "; use stats(x)")  # type: ignore[assignment]
    except TypeError as e:
        not_a_list = e  # raised on every rank of a group, like any refusal

    def checked() -> list[torch.Tensor]:
        if not_a_list is not None:
            raise not_a_list
        return [check_tensor(op, "tensors", t, i, collective=True) for i, t in enumerate(given)]

    return _stats_many(op, given, checked, lambda i: f"tensors[{i}]", tol=tol, group=group, async_op=async_op)


def _stats_many(
    op: str,
    given: list[object],
    checked: Callable[[], list[torch.Tensor]],
    names: Callable[[int], str],
    *,
    tol: float | None,
    group: dist.ProcessGroup | None,
    async_op: bool,
) -> StatsBatch | PendingMerge[StatsBatch]:
    """stats_many of `given` as the public call `op` makes it: checked() gives
    the tensors or refuses them; a refusal names tensor i as names(i). A
    collective call raises a refusal on every rank (after the agreement check)."""
    refusal: Exception | None = None
    xs: list[torch.Tensor] = []
    try:
        xs = checked()
        tol = check_tol(op, tol)
    except (TypeError, ValueError) as e:
        refusal = e
    meshes: list[object] = []
    for x in given:
        mesh = x.device_mesh if is_dtensor(x) else None  # type: ignore[attr-defined]
        if mesh is not None and all(mesh is not m and mesh != m for m in meshes):
            meshes.append(mesh)
    if len(meshes) > 1:
        raise ValueError(f"{op}: the DTensors live on {len(meshes)} different device meshes; scan each mesh's apart")
    grouped = group is not None
    if not (meshes or grouped):  # this rank's own statistics: no collective
        if refusal is not None:
            raise refusal
        batch = StatsBatch([])
        if xs:
            batch = _batch(xs, [_local_part(op, x, False) for x in xs], scan_rows(op, xs, tol, xs[0].device, names), tol, 1)
        return PendingMerge(None, lambda: batch) if async_op else batch
    pg = group_for(op, _mesh_group(op, meshes[0], group) if meshes else group, refusal)
    modes = [_mode_of(x, grouped) for x in xs]
    described = [(names(i), _must_agree(x, mode)) for i, (x, mode) in enumerate(zip(xs, modes))]
    check_agreement(op, pg, Merged("tensors", len(xs), described, f"tol={tol!r}", refusal))
    # From here on every rank merges as many rows, of the same tensors.
    if not xs:
        empty = StatsBatch([])
        return PendingMerge(None, lambda: empty) if async_op else empty
    parts = [_local_part(op, x, grouped) for x in xs]
    locals_ = [p.tensor for p in parts]
    device = comm_device(pg, locals_[0].device)
    rows = scan_rows(op, locals_, tol, device, names)
    pieces = [p.mode != MODE_REPLICATED for p in parts]
    final = _merge(rows, [p.counted for p in parts], pieces, pg)
    if any(p.mode == MODE_LOCAL for p in parts):
        local = torch.tensor([p.mode == MODE_LOCAL for p in parts], device=device).unsqueeze(1)
        final = torch.where(local, rows, final)
    batch = _batch(xs, parts, final, tol, dist.get_world_size(pg))
    return PendingMerge(None, lambda: batch) if async_op else batch


def _batch(
    xs: list[torch.Tensor], parts: list[LocalPart], rows: torch.Tensor, tol: float | None, world: int
) -> StatsBatch:
    """The GlobalStats of `xs` from their rows int64 [N, 16] (merged over `world` ranks)."""
    readout = Readout(rows)
    return StatsBatch([
        GlobalStats(
            readout, i, (x.dtype, x.shape, p.tensor.device), tol, p.mode, 1 if p.mode == MODE_LOCAL else world
        )
        for i, (x, p) in enumerate(zip(xs, parts))
    ])


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
    zeroscan/distributed/allreduce.py); its `mode` says how it was merged
    (see the module doc)."""
    op = "zeroscan.distributed.stats"
    result = _stats_many(op, [x], lambda: [check_tensor(op, "x", x, collective=True)], lambda i: "x", tol=tol,
                         group=group, async_op=async_op)
    if isinstance(result, PendingMerge):
        return result.then(lambda batch: batch[0])  # type: ignore[return-value]
    return result[0]  # type: ignore[return-value]
