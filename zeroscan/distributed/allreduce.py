"""Result rows merged across ranks by all-reduces whose size is independent of W.

Every rank holds one int64 [N, 16] result row per tensor (zeroscan/result_row.py)
and says, per row, whether it holds the tensor at all (`present`), whether
its row enters the merge (`counted`) and whether the ranks' rows are pieces
of one tensor (`sharded`: shards, each counted on one rank) or copies of it
(replicas, compared, of which one copy is counted: rank 0's in the Monitor).
Two rounds of all-reduces give every rank the same int64 [N, 24] summary
(columns: `Col`); what each rank sends, receives and keeps does not grow
with the world size W:

round one  SUM int64    the counts of the counted rows; how many ranks hold
                        the tensor, and hold a non-finite value in it
           SUM float64  n_i * mean_i of the counted rows (n_i finite values)
           MIN int64    min |x|, min nonzero |x| and (as ~key) max |x| of the
                        counted rows, by the ordered bits of their float64s;
                        each rank's mean and m2 range; the least and greatest
                        fingerprint of the ranks' exact words (counts, min/max
                        |x|) and the counted copy's, with its mean; the lowest
                        and highest rank with a non-finite value, and without
                        the tensor; the header words' range
round two  SUM float64  the moments about a shift c known to every rank from
                        round one: sum of (n_i / n)(mean_i - c) and of
                        m2_i + n_i (mean_i - c)^2; the sizes of the replica
                        classes (zeroscan/distributed/allreduce_replicas.py)
           MIN int64    the lowest and highest rank outside each class

That is 320 bytes per row plus 64 per merge in five all-reduces, and 192
bytes per row plus 64 kept (`payload_bytes`, `summary_bytes`).

Counts and min/max |x| are bit for bit those of the exact merge
(zeroscan.distributed.combine_rows). For shards c = sum(n_i mean_i) / n, the
mean; with the unit roundoff u = 2^-53,

    |mean - exact mean| <= u |mean| + (W + 2) u * sum((n_i / n) |mean_i - c|)
    |m2 - exact m2|     <= (W + 3) u * (m2 + n (mean - c)^2)

where c, a float64 quotient of W-term sums, lies within (W + 1) u *
sum((n_i / n) |mean_i|) of the mean: m2 is good to (W + 3) u relative (1e-12
at W = 4,096) but for a term of order u^3 n mean^2. The bounds are relative
to normal floats: values whose mean is subnormal can differ by a few of the
2^-1074 steps (a sum n_i mean_i that overflows float64, from |x| near 1e308
in float64 data, makes c the least mean of a rank instead). For replicas c
is the counted copy's mean, so its moments come back exactly.

Replicas (data-parallel copies that should hold the same tensor) are
compared without gathering them, in the same two rounds: the ranks outside
the largest class of equal copies are named, or the summary marks that no
majority is sure (zeroscan/distributed/allreduce_replicas.py says how). Floats, maxima
and ranks travel as int64 words (zeroscan/distributed/allreduce_words.py).

`start` runs the rounds over a process group; `simulate` runs the same code
over the stacked inputs of W ranks (or of blocks of identical ranks) in one
process, for tests and benchmarks.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from zeroscan.distributed import allreduce_replicas
from zeroscan.distributed.allreduce_words import as_words, fingerprint, key_value, last_rank, neither, ordered
from zeroscan.result_row import (
    EXACT, EXTREME_COLUMNS, NONFINITE, NUM_COUNTS, NUM_FIELDS, NUM_SCANNED, SCANNED, Merge, empty_rows, finite_count,
    moments,
)

NUM_HEADER = 6  # header words each rank adds: int64s whose least and greatest value every rank learns


class Col(enum.IntEnum):
    """Columns of the summary: int64 [N, SUMMARY_WIDTH], the same on every rank.
    Its first NUM_SCANNED columns are a result row (zeroscan.result_row.Column,
    its spare columns left out) of the merged counted rows; these follow them.
    Ranks are group ranks (0..W-1); a "last" rank is -1 and a "first" rank is
    W when there is none."""

    PRESENT = NUM_SCANNED  # ranks that hold the tensor
    NONFINITE_RANKS = enum.auto()  # ranks whose own row holds a NaN or an infinity
    FIRST_NONFINITE = enum.auto()
    LAST_NONFINITE = enum.auto()
    FIRST_ABSENT = enum.auto()  # the lowest rank without the tensor
    LAST_ABSENT = enum.auto()
    REFERENCE = enum.auto()  # replicas: ranks in the reference class (W: all agree); negative: no sure majority
    FIRST_OTHER = enum.auto()  # replicas: the lowest rank outside the reference class
    LAST_OTHER = enum.auto()
    MEAN_LO = enum.auto()  # replicas: float64 bits, the least and greatest mean of any rank holding it
    MEAN_HI = enum.auto()


SUMMARY_WIDTH = len(Col) + Col.PRESENT


# ---------------------------------------------------------------- the rounds


class Local(NamedTuple):
    """One rank's input (a leading batch dim of W ranks in `simulate`).

    rows: int64 [..., N, 16] this rank's rows (any words where absent).
    present: bool [..., N] this rank holds the tensor.
    counted: bool [..., N] its row enters the merge.
    sharded: bool [..., N] the ranks' rows are pieces of one tensor (merged);
        False: replicas (compared), of which one copy is counted: group rank
        0's, which the comparison takes as that of the counted copy. The same
        on every rank.
    rank: int64 [..., 1] this rank's group rank.
    header: int64 [..., NUM_HEADER].
    """

    rows: torch.Tensor
    present: torch.Tensor
    counted: torch.Tensor
    sharded: torch.Tensor
    rank: torch.Tensor
    header: torch.Tensor


class Prepared(NamedTuple):
    """What both rounds read of one rank's input, computed once."""

    mine: torch.Tensor  # int64 [..., N, 16]: the row this rank adds to the merge (empty unless counted)
    n: torch.Tensor  # float64 [..., N]: finite values in `mine`
    mean: torch.Tensor  # float64 [..., N]: of `mine`
    m2: torch.Tensor
    own_mean: torch.Tensor  # float64 [..., N]: of this rank's own row, counted or not
    own_m2: torch.Tensor
    own_n: torch.Tensor
    nonfinite: torch.Tensor  # bool [..., N]: this rank holds the tensor and a NaN or infinity in it
    fingerprint: torch.Tensor  # int64 [..., N]: a hash of the exact words (counts, min/max |x|) and `present`


def prepare(local: Local) -> Prepared:
    empty = empty_rows(1, local.rows.device)[0]
    mine = torch.where((local.present & local.counted).unsqueeze(-1), local.rows, empty)
    mean, m2 = moments(mine)
    own_mean, own_m2 = moments(local.rows)
    held = local.present.unsqueeze(-1)
    exact = torch.cat([local.rows[..., EXACT], held.to(torch.int64)], -1)
    return Prepared(
        mine, finite_count(mine), mean, m2, own_mean, own_m2, finite_count(local.rows),
        local.present & (local.rows[..., NONFINITE].sum(-1) > 0),
        fingerprint(torch.where(held, exact, torch.zeros_like(exact))),
    )


class RoundOne(NamedTuple):
    sums: torch.Tensor  # int64 [..., N, 10]: counts (8), ranks holding it, ranks with non-finite values
    fsums: torch.Tensor  # float64 [..., N, 1]: n_i mean_i of the counted rows
    mins: torch.Tensor  # int64 [..., N * ONE_MINS + 2 * NUM_HEADER]


class RoundTwo(NamedTuple):
    # The replica classes' words (allreduce_replicas.class_words): fsums from |L| on, and mins.
    fsums: torch.Tensor  # float64 [..., N, 8]: mean correction, m2, |L|, |H|, |C|, |none|, non-finite in L, in H
    mins: torch.Tensor  # int64 [..., N, 6]: first and ~last rank outside L, outside H, outside C


# Columns of RoundOne.mins (per row, before the header words): a key of each
# extreme of the row (extreme_keys), then these.
(M_PRINT_LO, M_PRINT_HI, M_PRINT_COPY, M_MEAN_LO, M_MEAN_HI, M_MEAN_COPY, M_M2_LO, M_M2_HI, M_FIRST_NONFINITE,
 M_LAST_NONFINITE, M_FIRST_ABSENT, M_LAST_ABSENT) = range(len(EXTREME_COLUMNS), len(EXTREME_COLUMNS) + 12)
ONE_MINS = M_LAST_ABSENT + 1
S_PRESENT, S_NONFINITE = NUM_COUNTS, NUM_COUNTS + 1


def extreme_keys(rows: torch.Tensor) -> list[torch.Tensor]:
    """The MIN words of the extremes of int64 [..., 16] rows, one per extreme
    column: a MIN column's ordered key, a MAX column's complement of it (the
    least ~key is the greatest value's)."""
    keys = [ordered(rows[..., c]) for c in EXTREME_COLUMNS]
    return [k if c.merge is Merge.MIN else ~k for c, k in zip(EXTREME_COLUMNS, keys)]


def extreme_words(mins: torch.Tensor) -> list[torch.Tensor]:
    """The float64 bits of the merged extremes from the reduced MIN words of
    extreme_keys (int64 [..., N, ONE_MINS])."""
    return [ordered(mins[..., k] if c.merge is Merge.MIN else ~mins[..., k]) for k, c in enumerate(EXTREME_COLUMNS)]


def round_one(local: Local, prep: Prepared, world: int) -> RoundOne:
    mine, n, mean = prep.mine, prep.n, prep.mean
    nonfinite, held = prep.nonfinite, local.present
    sums = torch.cat([mine[..., :NUM_COUNTS], torch.stack([held, nonfinite], -1).to(torch.int64)], -1)
    fsums = torch.where(n > 0, n * mean, 0.0).unsqueeze(-1)
    fp = prep.fingerprint
    rank = local.rank.expand_as(fp)
    counted = local.counted
    mean_key, m2_key = ordered(as_words(prep.own_mean)), ordered(as_words(prep.own_m2))
    mins = torch.stack([
        *extreme_keys(mine),
        fp,
        ~fp,
        neither(counted, fp),
        neither(held, mean_key),
        neither(held, ~mean_key),
        neither(counted & held, mean_key),
        neither(held, m2_key),
        neither(held, ~m2_key),
        torch.where(nonfinite, rank, world),
        neither(nonfinite, ~rank),
        torch.where(held, world, rank),
        neither(~held, ~rank),
    ], -1)
    header = torch.cat([local.header, ~local.header], -1)
    return RoundOne(sums, fsums, torch.cat([mins.flatten(-2), header], -1))


def _one_mins(one_mins: torch.Tensor, rows: int) -> torch.Tensor:
    return one_mins[..., : rows * ONE_MINS].unflatten(-1, (rows, ONE_MINS))


def _shift(sums: torch.Tensor, fsums: torch.Tensor, mins: torch.Tensor, sharded: torch.Tensor) -> torch.Tensor:
    """float64 [N]: the shift c of round two, the same on every rank: for
    replicas the mean of the counted copy (the least, were there several), so
    that its moments come back exactly; for shards the mean, or where n_i
    mean_i overflowed the least mean of a rank."""
    total = finite_count(sums)
    mean = fsums[..., 0] / total.clamp_min(1.0)
    merged = torch.where(mean.isfinite(), mean, key_value(mins[..., M_MEAN_LO]))
    c = torch.where(sharded, merged, key_value(mins[..., M_MEAN_COPY]))
    return torch.where((total > 0) & c.isfinite(), c, 0.0)


def _candidates(mins: torch.Tensor, n: torch.Tensor, rtol: float) -> allreduce_replicas.Candidates:
    """The replica candidates from round one's MIN words; n: float64 [..., N],
    the finite values of a replica (the ranks whose fingerprints agree hold
    as many)."""
    prints = torch.stack([mins[..., M_PRINT_LO], ~mins[..., M_PRINT_HI], mins[..., M_PRINT_COPY]], -1)
    means = torch.stack([
        key_value(mins[..., M_MEAN_LO]), key_value(~mins[..., M_MEAN_HI]), key_value(mins[..., M_MEAN_COPY]),
    ], -1)
    m2s = torch.stack([key_value(mins[..., M_M2_LO]), key_value(~mins[..., M_M2_HI])], -1)
    return allreduce_replicas.candidates(prints, means, m2s, n, rtol)


def round_two(local: Local, prep: Prepared, one: RoundOne, rtol: float, world: int) -> RoundTwo:
    """Round two's words; `one` holds round one's reduced results."""
    rows = local.rows.shape[-2]
    mins = _one_mins(one.mins, rows)
    c = _shift(one.sums, one.fsums, mins, local.sharded)
    total = finite_count(one.sums)
    n, mean, m2 = prep.n, prep.mean, prep.m2
    d = mean - c
    weight = n / total.clamp_min(1.0)
    correction = torch.where(n > 0, weight * (0.5 * mean - 0.5 * c), 0.0)
    spread = torch.where(n > 0, m2 + n * d * d, 0.0)
    candidates = _candidates(mins, prep.own_n, rtol)
    classes = allreduce_replicas.classes(
        candidates, local.present, prep.fingerprint, prep.own_mean, prep.own_m2, rtol
    )
    sizes, outside = allreduce_replicas.class_words(classes, prep.nonfinite, local.rank, world)
    return RoundTwo(torch.cat([torch.stack([correction, spread], -1), sizes], -1), outside)


def summarize(one: RoundOne, two: RoundTwo, world: int, sharded: torch.Tensor, rtol: float) -> torch.Tensor:
    """int64 [N * SUMMARY_WIDTH + 2 * NUM_HEADER]: the summary rows (see Col)
    then the header's least and (as ~) greatest words, from both rounds'
    reduced results."""
    rows = one.sums.shape[-2]
    mins = _one_mins(one.mins, rows)
    c = _shift(one.sums, one.fsums, mins, sharded)
    total = finite_count(one.sums)
    shift = 2.0 * two.fsums[..., 0]
    spread = two.fsums[..., 1]
    largest = torch.finfo(torch.float64).max  # rounding may carry a mean near it past it
    mean = torch.where(total > 0, (c + shift).clamp(-largest, largest), 0.0)
    # An m2 past the float64 range stays +inf (its correction may overflow too: inf - inf).
    m2 = torch.where(spread.isinf(), spread, (spread - total * shift * shift).clamp_min(0.0))
    m2 = torch.where(total > 0, m2, 0.0)
    keys = _candidates(mins, total, rtol).keys(rtol)
    reference, first_other, last_other = allreduce_replicas.reference(
        two.fsums[..., 2:], two.mins, mins[..., M_FIRST_NONFINITE], keys, world
    )
    columns = [
        *extreme_words(mins),
        as_words(mean),
        as_words(m2),
        one.sums[..., S_PRESENT],
        one.sums[..., S_NONFINITE],
        mins[..., M_FIRST_NONFINITE],
        last_rank(mins[..., M_LAST_NONFINITE]),
        mins[..., M_FIRST_ABSENT],
        last_rank(mins[..., M_LAST_ABSENT]),
        reference,
        first_other,
        last_other,
        ordered(mins[..., M_MEAN_LO]),
        ordered(~mins[..., M_MEAN_HI]),
    ]
    out = torch.cat([one.sums[..., :NUM_COUNTS], torch.stack(columns, -1)], -1)
    return torch.cat([out.flatten(), one.mins[..., rows * ONE_MINS :]])


# ---------------------------------------------------------------- running them


def payload_bytes(rows: int) -> int:
    """Bytes each rank all-reduces per merge of `rows` rows: the same at every W."""
    one = rows * (S_NONFINITE + 1) + rows + rows * ONE_MINS + 2 * NUM_HEADER
    two = rows * 8 + rows * 6
    return (one + two) * 8


def summary_bytes(rows: int) -> int:
    """Bytes of the summary a merge of `rows` rows leaves (what a Monitor keeps per step)."""
    return (rows * SUMMARY_WIDTH + 2 * NUM_HEADER) * 8


def start(local: Local, group: dist.ProcessGroup, *, rtol: float = 1e-9) -> torch.Tensor:
    """Both rounds over `group` (every rank must call it with the same N):
    the summary, on the rows' device. With NCCL nothing waits on the host
    (a synchronous all_reduce only orders the device's streams); with gloo
    each all_reduce is waited for."""
    world = dist.get_world_size(group)

    def reduce(parts: Sequence[tuple[torch.Tensor, dist.ReduceOp]]) -> list[torch.Tensor]:
        # One after another: gloo runs concurrent small collectives ten times slower
        # than the same ones in sequence (measured: 3 at once 6.5 ms, one 0.39 ms, on
        # 2 cores); NCCL's synchronous call only orders the streams.
        buffers = [t.contiguous() for t, _ in parts]
        for buffer, (_, op) in zip(buffers, parts):
            dist.all_reduce(buffer, op=op, group=group)
        return buffers

    prep = prepare(local)
    one = round_one(local, prep, world)
    sums, fsums, mins = reduce([(one.sums, dist.ReduceOp.SUM), (one.fsums, dist.ReduceOp.SUM),
                                (one.mins, dist.ReduceOp.MIN)])
    one = RoundOne(sums, fsums, mins)
    two = round_two(local, prep, one, rtol, world)
    two_fsums, two_mins = reduce([(two.fsums, dist.ReduceOp.SUM), (two.mins, dist.ReduceOp.MIN)])
    return summarize(one, RoundTwo(two_fsums, two_mins), world, local.sharded, rtol)


def simulate(
    local: Local, *, rtol: float = 1e-9, copies: Sequence[int] | None = None, chunk: int | None = None
) -> torch.Tensor:
    """Both rounds in one process over W ranks' inputs stacked along dim 0
    (rows int64 [R, N, 16], rank int64 [R, 1], ...): the summary every rank
    would get. `copies`: input r stands for copies[r] ranks with the same
    input, ranks rank[r] .. rank[r] + copies[r] - 1 (so a world of 16,384
    replicas is a handful of inputs): its sums count copies[r] times, and
    its MIN words are taken at both end ranks (every MIN word is monotone in
    the rank, so an end rank holds the block's least). `chunk` inputs at a
    time bound the memory."""
    blocks = local.rows.shape[0]
    if copies is not None and (
        len(copies) != blocks or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in copies)
    ):
        raise ValueError(f"simulate: copies must hold {blocks} ints >= 1 (one per input), got {copies!r}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"simulate: chunk must be an int >= 1 or None, got {chunk!r}")
    sizes = torch.tensor([1] * blocks if copies is None else list(copies), dtype=torch.int64)
    world = int(sizes.sum())
    step = chunk or blocks

    Make = Callable[[Local, Prepared], tuple[torch.Tensor, ...]]

    def reduced(make: Make, ops: tuple[str, ...]) -> list[torch.Tensor]:
        acc: list[torch.Tensor] | None = None
        for k in range(0, blocks, step):
            piece = Local(*(t[k : k + step] for t in local))
            size = sizes[k : k + step].to(local.rows.device)
            prep = prepare(piece)
            first = make(piece, prep)
            last = make(piece._replace(rank=piece.rank + (size - 1).unsqueeze(1)), prep)
            folded = []
            for a, b, op in zip(first, last, ops):
                if op == "sum":
                    folded.append((a * size.view(-1, *([1] * (a.dim() - 1))).to(a.dtype)).sum(0))
                else:
                    folded.append(torch.minimum(a, b).amin(0))
            acc = folded if acc is None else [
                a + f if op == "sum" else torch.minimum(a, f) for a, f, op in zip(acc, folded, ops)
            ]
        assert acc is not None
        return acc

    one = RoundOne(*reduced(lambda p, prep: tuple(round_one(p, prep, world)), ("sum", "sum", "min")))
    two = RoundTwo(*reduced(lambda p, prep: tuple(round_two(p, prep, one, rtol, world)), ("sum", "min")))
    return summarize(one, two, world, local.sharded[0], rtol)


def summary_rows(summary: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 [rows, 16]: the merged result rows of a summary (spare columns zero)."""
    body = summary[: rows * SUMMARY_WIDTH].view(rows, SUMMARY_WIDTH)
    out = torch.zeros((rows, NUM_FIELDS), dtype=torch.int64, device=summary.device)
    out[:, SCANNED] = body[:, SCANNED]
    return out


def header_range(summary: torch.Tensor) -> tuple[list[int], list[int]]:
    """The header words' least and greatest values over the ranks (host ints;
    a read back when the summary is on a device)."""
    words = summary[-2 * NUM_HEADER :].tolist()
    return words[:NUM_HEADER], [~w for w in words[NUM_HEADER:]]
