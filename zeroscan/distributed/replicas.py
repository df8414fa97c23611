"""Comparing data-parallel replicas: which rank's copy of a tensor differs.

DDP gradients after their all-reduce, and replicated weights, should be the
same on every rank. Given every rank's result rows for the same tensors (one
all_gather, zeroscan.distributed.compare_replicas), `replica_report` finds
the tensors whose rows disagree and names the ranks outside the majority: a
NaN on one rank only, a replica that diverged. Pure torch on the gathered
rows; no collective here.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from zeroscan.result_row import EXACT, FIELDS, MOMENTS, NONFINITE, decode, finite_count, moments
from zeroscan.words import brief, count_noun


@dataclass(frozen=True)
class ReplicaMismatch:
    """One tensor whose statistics are not the same on every rank.

    ranks: the (global) ranks that differ from the reference ranks, the
    largest group of agreeing ranks; on a tie the group with fewer non-finite
    values, and if that ties too the lowest rank's group (`ambiguous` is then
    True: with two ranks that diverged, nothing says which one is right).
    fields: for each field that differs, its value on every rank, rank order.
    """

    index: int
    name: str | None
    ranks: tuple[int, ...]
    reference_ranks: tuple[int, ...]
    ambiguous: bool
    fields: dict[str, tuple[float | int, ...]]

    def __str__(self) -> str:
        what = self.name if self.name is not None else f"tensor {self.index}"
        diffs = "; ".join(f"{k}: {', '.join(_show(v) for v in vs)}" for k, vs in self.fields.items())
        tie = " (tie: no majority)" if self.ambiguous else ""
        return f"{what}: rank(s) {list(self.ranks)} differ from {list(self.reference_ranks)}{tie} [{diffs}]"


@dataclass(frozen=True)
class ReplicaReport:
    """The outcome of comparing replicas: `ok` when every tensor agrees."""

    world_size: int
    ranks: tuple[int, ...]  # the global rank of each position
    mismatches: tuple[ReplicaMismatch, ...]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def offending_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r for m in self.mismatches for r in m.ranks}))

    def __str__(self) -> str:
        if self.ok:
            return f"ReplicaReport: all {self.world_size} ranks agree"
        lines = [f"ReplicaReport: {len(self.mismatches)} tensor(s) differ; ranks {list(self.offending_ranks)}"]
        lines += [f"  {m}" for m in self.mismatches]
        return "\n".join(lines)


def _show(v: float | int) -> str:
    return str(v) if isinstance(v, int) else f"{v:.6g}"


def rows_agree(a: torch.Tensor, b: torch.Tensor, rtol: float) -> torch.Tensor:
    """Elementwise over leading dims of int64 [..., 16] rows: True where counts
    and min/max |x| are equal and mean and m2 agree within rtol of the
    values' scale (root mean square and sum of squares)."""
    same = (a[..., EXACT] == b[..., EXACT]).all(-1)  # the counts and min/max |x|
    n = finite_count(a).clamp_min(1.0)
    (ma, m2a), (mb, m2b) = moments(a), moments(b)
    mean_sq = torch.maximum(ma * ma, mb * mb)
    m2 = torch.maximum(m2a, m2b)
    mean_ok = (ma - mb).abs() <= rtol * torch.sqrt(m2 / n + mean_sq)
    m2_ok = (m2a - m2b).abs() <= rtol * (m2 + n * mean_sq)
    same_bits = (a[..., MOMENTS] == b[..., MOMENTS]).all(-1)
    return same & ((mean_ok & m2_ok) | same_bits)


def _nonfinite(row: torch.Tensor) -> int:
    return int(row[NONFINITE].sum())


def check_report_options(op: str, n: int, names: object, rtol: object) -> None:
    """`names` (None, or one str per tensor of `n`) and `rtol` (a number >= 0)
    as a replica comparison takes them; else the error naming the public call `op`."""
    if names is not None:
        if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
            raise TypeError(f"{op}: names must be a list of str (one per tensor) or None, got {type(names).__name__}")
        if len(names) != n:
            given = count_noun(len(names), "entry", "entries")
            raise ValueError(f"{op}: names has {given} for {count_noun(n, 'tensor')}")
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)):
        raise TypeError(f"{op}: rtol must be a number, got {type(rtol).__name__}")
    if not rtol >= 0:
        raise ValueError(f"{op}: rtol must be a non-negative number, got {rtol!r}")


def chosen_indices(op: str, n: int, indices: object) -> list[int]:
    """The tensors to compare: `indices` (ints in [0, n), a list or an int
    tensor), or all n when None."""
    if indices is None:
        return list(range(n))
    if isinstance(indices, (str, bytes)) or not isinstance(indices, Iterable):
        raise TypeError(f"{op}: indices must be a list of ints or None, got {type(indices).__name__}")
    given = list(indices)
    try:
        chosen = [operator.index(i) for i in given]
    except TypeError:
        kinds = sorted({type(i).__name__ for i in given})
        raise TypeError(f"{op}: indices must be a list of ints or None, got one holding {', '.join(kinds)}") from None
    outside = [i for i in chosen if not 0 <= i < n]
    if outside:
        raise ValueError(f"{op}: indices must lie in [0, {n}), got {brief(outside)}")
    return chosen


def replica_report(
    gathered: torch.Tensor,
    ranks: tuple[int, ...],
    names: Sequence[str] | None = None,
    *,
    rtol: float = 1e-9,
    indices: Sequence[int] | None = None,
    op: str = "zeroscan.distributed.GatheredRows.replica_report",
) -> ReplicaReport:
    """Compares every rank's rows with every other's (gathered: int64
    [W, N, 16], block r from global rank ranks[r]); see
    zeroscan.distributed.compare_replicas. `indices`: compare only these
    tensors (default: all). Reads back only an agreement mask, plus the rows
    of tensors that differ. The rows and ranks come from an all_gather
    (GatheredRows); names, rtol and indices from the user, refused in
    errors naming `op`, the public call that passed them on."""
    rows = gathered
    world, n = rows.shape[0], rows.shape[1]
    check_report_options(op, n, names, rtol)
    chosen = chosen_indices(op, n, indices)
    if indices is not None:
        rows = rows[:, chosen]
    agree = rows_agree(rows, rows[:1], rtol).all(0)  # every rank agrees with rank 0
    bad = (~agree).nonzero().flatten().tolist()
    mismatches = []
    for j in bad:
        i = chosen[j]
        host = rows[:, j].cpu()  # [W, 16]
        classes: list[list[int]] = []
        for r in range(world):
            for members in classes:
                if bool(rows_agree(host[r], host[members[0]], rtol)):
                    members.append(r)
                    break
            else:
                classes.append([r])
        rank_key = [(-len(c), _nonfinite(host[c[0]])) for c in classes]
        best_key = min(rank_key)
        best = classes[rank_key.index(best_key)]  # classes are in order of their lowest rank
        ambiguous = rank_key.count(best_key) > 1
        decoded = decode(host)
        fields = {}
        for field in FIELDS:
            values = tuple(d[field] for d in decoded)
            if any(not _same(v, values[best[0]]) for v in values):
                fields[field] = values
        mismatches.append(
            ReplicaMismatch(
                index=i,
                name=names[i] if names is not None else None,
                ranks=tuple(ranks[r] for r in range(world) if r not in best),
                reference_ranks=tuple(ranks[r] for r in best),
                ambiguous=ambiguous,
                fields=fields,
            )
        )
    return ReplicaReport(world, ranks, tuple(mismatches))


def _same(a: float | int, b: float | int) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
