"""Every rank's result rows, gathered: the exact merge and the replica comparison.

The diagnostic path of zeroscan.distributed, beside its all-reduces (and
importable from there): `gather_rows` all-gathers every rank's int64
[N, 16] rows in one collective (W x N x 128 bytes); `GatheredRows.merged()`
(`combine_rows`) merges them exactly with the native combine, in O(W N)
memory; `compare_replicas` reports which rank's copy of a tensor differs,
with every rank's values (zeroscan/distributed/replicas.py). Every call here that takes
a group is a COLLECTIVE (see zeroscan.distributed), which first checks that
the ranks agree on what they gather (zeroscan/distributed/agreement.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zeroscan import ops
from zeroscan.distributed.agreement import Merged, check_agreement, tensor_words
from zeroscan.distributed.common import PendingMerge, check_rows, comm_device, group_for, rows_of, scan_rows
from zeroscan.distributed.replicas import ReplicaReport, check_report_options, replica_report
from zeroscan.ops import check_tensor, check_tol, refused
from zeroscan.result_row import NUM_FIELDS
from zeroscan.stats import Stats, StatsBatch


def combine_rows(gathered: torch.Tensor) -> torch.Tensor:
    """Merges int64 [W, N, 16] rows (W ranks' results for the same N tensors)
    into int64 [N, 16]: the statistics of each tensor over all W parts.

    The native combine of csrc/stats_record.h in a fixed pairwise tree over
    the rank index, hence identical bits on every rank; it runs where the rows
    are, reads nothing back to the host and traces under torch.compile.
    """
    op = "zeroscan.distributed.combine_rows"
    gathered = check_rows(op, "gathered", gathered, f"[W, N, {NUM_FIELDS}]", (3,))
    if gathered.shape[0] == 0:
        raise ValueError(f"{op}: gathered holds no rank (W == 0)")
    try:
        return ops.combine_rows(gathered)
    except RuntimeError as e:  # freed memory, say
        refused(op, [("gathered", gathered)], e)


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
        op = "zeroscan.distributed.GatheredRows.replica_report"
        return replica_report(self.rows, self.ranks, names, rtol=rtol, indices=indices, op=op)


def gather_rows(
    rows: torch.Tensor, group: dist.ProcessGroup | None = None, *, async_op: bool = False
) -> GatheredRows | PendingMerge[GatheredRows]:
    """All-gathers this rank's int64 [N, 16] (or [16]) result rows in ONE
    collective. Every rank must pass the same N, in the same tensor order
    (checked first: every rank raises the same error where N differs). With
    async_op=True it returns at once; `.wait()` gives the GatheredRows."""
    op = "zeroscan.distributed.gather_rows"
    refusal = None
    try:
        rows = check_rows(op, "rows", rows, f"[N, {NUM_FIELDS}]", (1, 2))
    except (TypeError, ValueError) as e:
        refusal = e
    pg = group_for(op, group, refusal)
    check_agreement(op, pg, Merged("rows", 0 if refusal else rows.reshape(-1, NUM_FIELDS).shape[0], refusal=refusal))
    return _gather(rows, pg, async_op)


def _gather(rows: torch.Tensor, pg: dist.ProcessGroup, async_op: bool) -> GatheredRows | PendingMerge[GatheredRows]:
    """gather_rows once the ranks agree on N."""
    world = dist.get_world_size(pg)
    ranks = tuple(dist.get_process_group_ranks(pg))
    local = rows.reshape(-1, NUM_FIELDS).to(comm_device(pg, rows.device)).contiguous()
    out = local.new_empty((world * local.shape[0], NUM_FIELDS))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(out, local, group=pg, async_op=async_op)

    def finish() -> GatheredRows:
        return GatheredRows(out.view(world, local.shape[0], NUM_FIELDS), ranks)

    return PendingMerge(work, finish) if async_op else finish()


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
    The ranks must pass as many, of the same dtypes and shapes (and tol):
    checked first, and every rank raises the same error where they differ.
    """
    op = "zeroscan.distributed.compare_replicas"
    what = "tensors_or_stats"
    refusal: Exception | None = None
    items: list[Stats] = []
    xs: list[torch.Tensor] = []
    shown: list[tuple[torch.dtype, torch.Size, float | None]] = []
    # The arguments first: a refusal is this rank's own error, shared with the
    # others once there is a group to share it over, and raised here without one.
    try:
        if isinstance(tensors_or_stats, (Stats, StatsBatch)):
            items = [tensors_or_stats] if isinstance(tensors_or_stats, Stats) else list(tensors_or_stats)
            shown = [(s.dtype, s.shape, s.tol) for s in items]
        elif isinstance(tensors_or_stats, torch.Tensor):
            raise TypeError(f"{op}: pass a list of tensors (or their Stats), got a single tensor; wrap it in a list")
        elif isinstance(tensors_or_stats, (str, bytes)) or not isinstance(tensors_or_stats, Iterable):
            got = type(tensors_or_stats).__name__
            raise TypeError(f"{op}: {what} must be a list of tensors, a StatsBatch or a Stats, got {got}")
        else:
            tol = check_tol(op, tol)
            xs = [check_tensor(op, what, t, i, collective=True) for i, t in enumerate(tensors_or_stats)]
            shown = [(x.dtype, x.shape, tol) for x in xs]
        check_report_options(op, len(shown), names, rtol)
    except (TypeError, ValueError) as e:
        refusal, shown = e, []
    pg = group_for(op, group, refusal)
    described = [(f"{what}[{i}]", _replica(*s)) for i, s in enumerate(shown)]
    check_agreement(op, pg, Merged("tensors", len(shown), described, refusal=refusal))
    if isinstance(tensors_or_stats, (Stats, StatsBatch)):
        device = items[0].buffer.device if items else torch.device("cpu")
        rows = rows_of(items, comm_device(pg, device))
    else:
        device = comm_device(pg, xs[0].device if xs else torch.device("cpu"))
        rows = scan_rows(op, xs, tol, device, lambda i: f"{what}[{i}]") if xs else torch.empty(
            (0, NUM_FIELDS), dtype=torch.int64, device=device
        )
    pending = _gather(rows, pg, async_op=True)

    def report_of(gathered: GatheredRows) -> ReplicaReport:
        return replica_report(gathered.rows, gathered.ranks, names, rtol=rtol, op=op)

    report = pending.then(report_of)  # type: ignore[union-attr]
    return report if async_op else report.wait()


def _replica(dtype: torch.dtype, shape: torch.Size, tol: float | None) -> str:
    """What every rank must hold alike of a replica: its dtype and shape, and the tol it is scanned with."""
    return f"a {tensor_words(dtype, shape)}" + ("" if tol is None else f" (tol={tol!r})")
