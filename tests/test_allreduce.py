"""zeroscan.distributed.allreduce: result rows merged by W-independent all-reduces, in one process.

`allreduce.simulate` runs both rounds over W ranks' inputs stacked on dim 0
and returns the summary every rank would get. Checked here against the exact
merge (zeroscan.distributed.combine_rows) and the float64 reference of the
whole tensor: counts and min/max |x| bit for bit, the moments to 1e-12, the
documented exact cases (one counted copy, a constant tensor), rows that stay
out of the merge (uncounted, absent), the replica comparison (reference class,
dissenting, non-finite and absent ranks), the per-rank counts and header
words, the ordered keys of float64 bits, chunked simulation, the bytes that
travel, and float64 data whose sums overflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch

import zeroscan
from helpers import assert_matches_reference, close, fresh_seed, make_values, stats_of_row
from zeroscan.distributed import allreduce, combine_rows
from zeroscan.distributed.allreduce import Col
from zeroscan.result_row import Column, Row, decode, empty_rows

EXACT_WORDS = slice(0, Column.MAX_ABS + 1)  # counts and min/max |x|: bit for bit
ROW_WORDS = slice(0, Column.M2 + 1)  # the 13 words of a result row
MERGE_RTOL = 1e-12  # mean and std of the merge vs combine_rows (float64 sums of W terms)
REPLICA_RTOL = 1e-9  # simulate's default rtol for comparing replicas' moments
WORLDS = (1, 2, 5, 16)
SUBNORMAL_STEP = math.ulp(0.0)  # 2^-1074, the spacing of float64 subnormals

Maker = Callable[[int, torch.dtype, torch.Generator], torch.Tensor]


# ------------------------------------------------------------ helpers


def seeded() -> tuple[int, torch.Generator]:
    """A fresh seed (printed, replayable with ZEROSCAN_TEST_SEED) and its generator."""
    seed = fresh_seed()
    return seed, torch.Generator().manual_seed(seed)


def local_of(
    rows: torch.Tensor,
    *,
    present: torch.Tensor | None = None,
    counted: torch.Tensor | None = None,
    sharded: torch.Tensor | None = None,
    header: torch.Tensor | None = None,
) -> allreduce.Local:
    """The stacked input of W ranks holding rows int64 [W, N, 16]: present,
    counted and pieces of one tensor (sharded) unless told, group ranks
    0..W-1, zero headers."""
    world, n = rows.shape[:2]
    every = torch.ones((world, n), dtype=torch.bool)
    return allreduce.Local(
        rows,
        every if present is None else present,
        every if counted is None else counted,
        every if sharded is None else sharded,
        torch.arange(world, dtype=torch.int64).unsqueeze(1),
        torch.zeros((world, allreduce.NUM_HEADER), dtype=torch.int64) if header is None else header,
    )


def body(summary: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [n, SUMMARY_WIDTH]: the summary's rows (columns: Col)."""
    return summary[: n * allreduce.SUMMARY_WIDTH].view(n, allreduce.SUMMARY_WIDTH)


def rows_of(pieces_per_tensor: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """int64 [W, N, 16]: rank r's row of tensor i scans pieces_per_tensor[i][r]."""
    return torch.stack([torch.stack([zeroscan.stats(p).buffer for p in pieces]) for pieces in pieces_per_tensor], 1)


def split(x: torch.Tensor, world: int, g: torch.Generator, *, empty_ranks: bool = False) -> list[torch.Tensor]:
    """x cut into `world` uneven pieces at random points; with empty_ranks
    about half the ranks (at least one when world > 1) hold nothing."""
    holders = list(range(world))
    if empty_ranks and world > 1:
        keep = torch.rand(world, generator=g) < 0.5
        keep[int(torch.randint(0, world, (), generator=g))] = False
        holders = [r for r in range(world) if keep[r]] or [int(torch.randint(0, world, (), generator=g))]
    cuts = sorted(torch.randint(0, x.numel() + 1, (len(holders) - 1,), generator=g).tolist())
    parts = iter(torch.tensor_split(x, cuts))
    return [next(parts) if r in holders else x[:0] for r in range(world)]


def garbage_rows(shape: Sequence[int], g: torch.Generator) -> torch.Tensor:
    """int64 [..., 16] of random words: rows that must not reach the merge."""
    return torch.randint(-(2**63), 2**63 - 1, (*shape, 16), generator=g)


def scaled(row: torch.Tensor, word: Column, factor: float) -> torch.Tensor:
    """row int64 [16] with its float64 `word` (mean or m2) scaled by `factor`, every other word kept."""
    out = row.clone()
    value = out[word : word + 1].view(torch.float64)
    value *= factor
    return out


def assert_moments_close(got: Row, want: Row, rtol: float, what: str, *, world: int = 1) -> None:
    """mean and std within rtol (NaN to NaN), with close()'s floor at want's rms,
    or within (W + 4) spacings of the float64 subnormals: the sums of W terms of
    subnormal means round in absolute steps of 2^-1074, not relatively."""
    scale = float(want["norm"]) / math.sqrt(max(1, int(want["finite"])))
    subnormal_floor = (world + 4) * SUBNORMAL_STEP
    for field in ("mean", "std"):
        g, w = float(got[field]), float(want[field])
        assert close(g, w, rtol, scale) or abs(g - w) <= subnormal_floor, (
            f"{what} {field}: got {g!r}, want {w!r} (rtol {rtol})"
        )


# ------------------------------------------------------------ distributions


_MANTISSA_BITS = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
_SAME_WIDTH_INT = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
                   torch.bfloat16: torch.int16}


def _with_zeros(fraction: float) -> Maker:
    def make(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
        x = make_values(n, dtype, g, specials=False)
        x[torch.rand(n, generator=g) < fraction] = 0
        return x

    return make


def _subnormals(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Only subnormals of `dtype`, both signs: exponent bits 0, mantissa nonzero."""
    bits, width = _MANTISSA_BITS[dtype], torch.finfo(dtype).bits
    mantissa = torch.randint(1, 2**bits, (n,), generator=g)
    words = torch.where(torch.rand(n, generator=g) < 0.5, mantissa, mantissa - 2 ** (width - 1))  # sign bit set
    return words.to(_SAME_WIDTH_INT[dtype]).view(dtype)


DISTRIBUTIONS: dict[str, Maker] = {
    "specials": make_values,
    "zeros_50": _with_zeros(0.5),
    "zeros_99": _with_zeros(0.99),
    "all_zeros": lambda n, dtype, g: torch.zeros(n, dtype=dtype),
    "subnormal": _subnormals,
    "constant_one": lambda n, dtype, g: torch.ones(n, dtype=dtype),
    "empty_pieces": make_values,
}
MERGE_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int32)
MERGE_CASES = [
    (dtype, name)
    for dtype in MERGE_DTYPES
    for name in DISTRIBUTIONS
    if dtype.is_floating_point or name != "subnormal"
]


# ------------------------------------------------------------ the merge


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(("dtype", "distribution"), MERGE_CASES, ids=[f"{d}-{n}" for d, n in MERGE_CASES])
def test_merge_equals_combine_rows_and_the_reference(dtype: torch.dtype, distribution: str, world: int) -> None:
    """Counts and min/max |x| are combine_rows's bit for bit; mean and std within 1e-12 of it and of the reference."""
    seed, g = seeded()
    make = DISTRIBUTIONS[distribution]
    empty = distribution == "empty_pieces"
    sizes = [int(torch.randint(0, 20_000, (), generator=g)) for _ in range(3)]
    if empty:
        sizes[0] = 0  # one tensor that no rank holds any of
    full = [make(n, dtype, g) for n in sizes]
    rows = rows_of([split(x, world, g, empty_ranks=empty) for x in full])
    merged = allreduce.summary_rows(allreduce.simulate(local_of(rows)), len(full))
    want = combine_rows(rows)
    what = f"seed {seed}: {dtype} {distribution} over {world} ranks"
    assert torch.equal(merged[:, EXACT_WORDS], want[:, EXACT_WORDS]), (
        f"{what}: {merged[:, EXACT_WORDS]} != {want[:, EXACT_WORDS]}"
    )
    for i, (got_row, want_row) in enumerate(zip(decode(merged), decode(want))):
        assert_moments_close(got_row, want_row, MERGE_RTOL, f"{what}, tensor {i}:", world=world)
    for i, x in enumerate(full):
        assert_matches_reference(stats_of_row(merged, x, i), x)


@pytest.mark.parametrize("world", (2, 5, 16))
@pytest.mark.parametrize(
    "kind", ("float32_specials", "float64_offset", "bfloat16_zeros", "int32", "all_nan", "one_value", "empty")
)
def test_one_counted_copy_is_merged_bit_for_bit(kind: str, world: int) -> None:
    """When one rank's row alone is counted, the merged row is that row, all 13 words."""
    seed, g = seeded()

    def tensor() -> torch.Tensor:
        n = int(torch.randint(1, 5000, (), generator=g))
        if kind == "float32_specials":
            return make_values(n, torch.float32, g)
        if kind == "float64_offset":
            return make_values(n, torch.float64, g, specials=False) + 1000.0 * float(torch.rand((), generator=g))
        if kind == "bfloat16_zeros":
            return _with_zeros(0.5)(n, torch.bfloat16, g)
        if kind == "int32":
            return make_values(n, torch.int32, g)
        if kind == "all_nan":
            return torch.full((n,), math.nan)
        if kind == "one_value":
            return make_values(1, torch.float64, g, specials=False)
        return torch.empty(0)

    speaker = int(torch.randint(0, world, (), generator=g))
    rows = rows_of([[tensor() for _ in range(world)], [make_values(100, torch.float32, g) for _ in range(world)]])
    counted = torch.zeros((world, 2), dtype=torch.bool)
    counted[speaker] = True
    merged = allreduce.summary_rows(allreduce.simulate(local_of(rows, counted=counted)), 2)
    for i in range(2):
        assert merged[i, ROW_WORDS].tolist() == rows[speaker, i, ROW_WORDS].tolist(), (
            f"seed {seed}: tensor {i} of rank {speaker} of {world} ({kind})"
        )
    assert not merged[:, Column.M2 + 1 :].any(), "the spare columns are zero"


@pytest.mark.parametrize("world", (2, 5, 16))
@pytest.mark.parametrize("value", (1.0, -3.5, 0.1, 1000.0))
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int32))
def test_constant_tensor_has_its_mean_exactly_and_zero_m2(dtype: torch.dtype, value: float, world: int) -> None:
    """A constant tensor split over ranks has mean exactly the constant and m2 exactly 0."""
    seed, g = seeded()
    x = torch.full((int(torch.randint(1, 30_000, (), generator=g)),), value).to(dtype)
    rows = rows_of([split(x, world, g)])
    merged = allreduce.summary_rows(allreduce.simulate(local_of(rows)), 1)
    mean, m2 = merged[0, Column.MEAN : Column.M2 + 1].view(torch.float64).tolist()
    assert (mean, m2) == (float(x[0]), 0.0), f"seed {seed}: {x.numel()} x {float(x[0])} ({dtype}) over {world} ranks"
    assert merged[0, Column.M2] == 0, "m2 is +0.0, not -0.0"


@pytest.mark.parametrize("world", (2, 5, 16))
@pytest.mark.parametrize("how", ("uncounted", "absent", "absent_but_counted"))
def test_rows_outside_the_merge_do_not_change_it(how: str, world: int) -> None:
    """Rows of uncounted or absent ranks, whatever they hold, leave the merged rows' bits unchanged."""
    seed, g = seeded()
    full = [make_values(int(torch.randint(0, 10_000, (), generator=g)), torch.float32, g) for _ in range(3)]
    rows = rows_of([split(x, world, g) for x in full])
    outside = torch.rand((world, len(full)), generator=g) < 0.4
    inside_only = torch.where(outside.unsqueeze(-1), empty_rows(1)[0], rows)
    counted = ~outside if how == "uncounted" else torch.ones_like(outside)
    present = torch.ones_like(outside) if how == "uncounted" else ~outside
    merges = []
    for _ in range(2):  # two different sets of garbage in the rows outside
        noisy = torch.where(outside.unsqueeze(-1), garbage_rows(rows.shape[:2], g), rows)
        summary = allreduce.simulate(local_of(noisy, present=present, counted=counted))
        merges.append(allreduce.summary_rows(summary, len(full)))
    clean = allreduce.summary_rows(allreduce.simulate(local_of(inside_only)), len(full))
    what = f"seed {seed}: {how} ranks {outside.nonzero().tolist()} of {world}"
    assert torch.equal(merges[0], merges[1]), f"{what}: the garbage reached the merge"
    assert torch.equal(merges[0], clean), f"{what}: differs from the merge of the counted rows alone"
    want = combine_rows(inside_only)
    assert torch.equal(merges[0][:, EXACT_WORDS], want[:, EXACT_WORDS]), what
    for i, (got_row, want_row) in enumerate(zip(decode(merges[0]), decode(want))):
        assert_moments_close(got_row, want_row, MERGE_RTOL, f"{what}, tensor {i}:", world=world)


# ------------------------------------------------------------ replicas


def _replica(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A gradient with no special values, its mean of the order of its rms
    (so that a relative change of the mean shows), and its row int64 [16]."""
    x = make_values(int(torch.randint(100, 4000, (), generator=g)), torch.float32, g, specials=False)
    x = x + x.abs().mean()
    return x, zeroscan.stats(x).buffer


def _dissenting_row(kind: str, x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A row that differs from x's by `kind` (any words for "absent")."""
    if kind == "nan":
        y = x.clone()
        y[int(torch.randint(0, x.numel(), (), generator=g))] = math.nan
        return zeroscan.stats(y).buffer
    if kind == "max_abs":
        y = x.clone()
        y[x.abs().argmax()] *= 2
        return zeroscan.stats(y).buffer
    if kind in ("mean", "m2"):  # counts and min/max |x| unchanged
        return scaled(zeroscan.stats(x).buffer, Column.MEAN if kind == "mean" else Column.M2, 1 + 1e-6)
    return garbage_rows((), g)


def _replica_summary(
    rows: torch.Tensor, present: torch.Tensor | None = None, rtol: float = REPLICA_RTOL
) -> torch.Tensor:
    """The summary row int64 [SUMMARY_WIDTH] of one replicated tensor, rows int64
    [W, 16], with rank 0's copy counted (where it is present)."""
    world = rows.shape[0]
    counted = torch.zeros((world, 1), dtype=torch.bool)
    counted[0] = True
    local = local_of(
        rows.unsqueeze(1),
        present=None if present is None else present.unsqueeze(1),
        counted=counted,
        sharded=torch.zeros((world, 1), dtype=torch.bool),
    )
    return body(allreduce.simulate(local, rtol=rtol), 1)[0]


def _named(row: torch.Tensor, count: Col, first: Col, last: Col) -> tuple[int, int, int]:
    return int(row[count]), int(row[first]), int(row[last])


def _expected(ranks: Sequence[int], world: int) -> tuple[int, int, int]:
    """(count, first, last) of a set of ranks, first = W and last = -1 when empty."""
    return len(ranks), min(ranks, default=world), max(ranks, default=-1)


DISSENT_KINDS = ("nan", "max_abs", "mean", "m2", "absent")
REPLICA_CASES = [
    (world, k, kind)
    for world in (2, 3, 8, 33)
    for k in (0, 1, 2, 5)
    if k < world / 2
    for kind in (DISSENT_KINDS if k else ("none",))
]


@pytest.mark.parametrize(("world", "k", "kind"), REPLICA_CASES)
def test_replica_comparison_names_the_planted_dissenters(world: int, k: int, kind: str) -> None:
    """REFERENCE is W - k; the others, non-finite and absent ranks and MEAN_LO/HI are as planted."""
    seed, g = seeded()
    x, row = _replica(g)
    planted = sorted(torch.randperm(world, generator=g)[:k].tolist())
    rows = row.expand(world, -1).clone()
    present = torch.ones(world, dtype=torch.bool)
    dissent = _dissenting_row(kind, x, g) if k else row
    for r in planted:
        rows[r] = dissent  # every dissenter holds the same (wrong) row
        present[r] = kind != "absent"
    got = _replica_summary(rows, present)
    what = f"seed {seed}: {kind} on ranks {planted} of {world}"
    assert int(got[Col.REFERENCE]) == world - k, what
    assert _named(got, Col.REFERENCE, Col.FIRST_OTHER, Col.LAST_OTHER)[1:] == _expected(planted, world)[1:], what
    nan_ranks = planted if kind == "nan" else []
    absent_ranks = planted if kind == "absent" else []
    nonfinite = _named(got, Col.NONFINITE_RANKS, Col.FIRST_NONFINITE, Col.LAST_NONFINITE)
    assert nonfinite == _expected(nan_ranks, world), what
    assert int(got[Col.PRESENT]) == world - len(absent_ranks), what
    assert (int(got[Col.FIRST_ABSENT]), int(got[Col.LAST_ABSENT])) == _expected(absent_ranks, world)[1:], what
    means = rows[present, Column.MEAN].view(torch.float64)
    mean_range = got[Col.MEAN_LO : Col.MEAN_HI + 1].view(torch.float64).tolist()
    assert mean_range == [means.min().item(), means.max().item()], what


@pytest.mark.parametrize("world", (2, 3, 8, 33))
@pytest.mark.parametrize("word", (Column.MEAN, Column.M2))
def test_replicas_within_rtol_agree(word: Column, world: int) -> None:
    """A mean or m2 that differs by a relative 1e-12 (rtol 1e-9) is no mismatch: REFERENCE is W."""
    seed, g = seeded()
    _, row = _replica(g)
    rows = row.expand(world, -1).clone()
    for r in torch.randperm(world, generator=g)[: max(1, world // 3)].tolist():
        rows[r] = scaled(rows[r], word, 1 + 1e-12)
    got = _replica_summary(rows)
    assert _named(got, Col.REFERENCE, Col.FIRST_OTHER, Col.LAST_OTHER) == (world, world, -1), f"seed {seed}"


@pytest.mark.parametrize("nan_rank", (0, 1))
def test_two_rank_tie_with_a_nan_is_not_ambiguous(nan_rank: int) -> None:
    """Two ranks, one holding a NaN: the other is the reference (REFERENCE 1, positive), the NaN rank named."""
    seed, g = seeded()
    x, row = _replica(g)
    rows = row.expand(2, -1).clone()
    rows[nan_rank] = _dissenting_row("nan", x, g)
    got = _replica_summary(rows)
    what = f"seed {seed}: NaN on rank {nan_rank}"
    assert _named(got, Col.REFERENCE, Col.FIRST_OTHER, Col.LAST_OTHER) == (1, nan_rank, nan_rank), what
    assert _named(got, Col.NONFINITE_RANKS, Col.FIRST_NONFINITE, Col.LAST_NONFINITE) == (1, nan_rank, nan_rank), what


@pytest.mark.parametrize("world", (2, 4, 6))
@pytest.mark.parametrize("kind", ("max_abs", "mean", "m2"))
def test_even_split_without_a_nan_is_ambiguous_and_rank_0_is_the_reference(kind: str, world: int) -> None:
    """W/2 ranks against W/2, none non-finite: REFERENCE is -W/2, the others the half without rank 0."""
    seed, g = seeded()
    x, row = _replica(g)
    other_half = sorted(torch.randperm(world, generator=g)[: world // 2].tolist())
    if 0 in other_half:
        other_half = sorted(set(range(world)) - set(other_half))
    rows = row.expand(world, -1).clone()
    rows[other_half] = _dissenting_row(kind, x, g)
    got = _replica_summary(rows)
    what = f"seed {seed}: {kind} on ranks {other_half} of {world}"
    assert int(got[Col.REFERENCE]) == -(world // 2), what
    assert (int(got[Col.FIRST_OTHER]), int(got[Col.LAST_OTHER])) == (other_half[0], other_half[-1]), what


def test_majority_between_two_different_dissenters_is_the_reference() -> None:
    """Ranks 1 and W-1 hold a lower and a higher mean: the W-2 others are the reference class."""
    seed, g = seeded()
    _, row = _replica(g)
    world = 8
    rows = row.expand(world, -1).clone()
    rows[1] = scaled(row, Column.MEAN, 1 - 1e-6)
    rows[world - 1] = scaled(row, Column.MEAN, 1 + 1e-6)
    got = _replica_summary(rows)
    assert _named(got, Col.REFERENCE, Col.FIRST_OTHER, Col.LAST_OTHER) == (world - 2, 1, world - 1), f"seed {seed}"


def test_a_majority_between_the_extremes_without_the_counted_copy_is_not_claimed() -> None:
    """Ranks 0 and 1 (0 is the counted copy) hold the least mean and rank
    W-1 the greatest; the W-3 ranks between them are a majority that no
    candidate class holds: the summary does not claim ranks 0 and 1 as a
    majority (REFERENCE < 0), and still names the ranks outside them."""
    seed, g = seeded()
    _, row = _replica(g)
    world = 7
    rows = row.expand(world, -1).clone()
    rows[:2] = scaled(row, Column.MEAN, 1 - 1e-6)
    rows[world - 1] = scaled(row, Column.MEAN, 1 + 1e-6)
    got = _replica_summary(rows)
    assert _named(got, Col.REFERENCE, Col.FIRST_OTHER, Col.LAST_OTHER) == (-2, 2, world - 1), (
        f"seed {seed}: {got.tolist()}"
    )


@pytest.mark.parametrize("world", (8, 12, 40))
def test_blocks_of_identical_ranks_simulate_as_every_rank(world: int) -> None:
    """simulate(copies=...) over blocks of consecutive identical ranks gives
    the summary of the same world given rank by rank."""
    seed, g = seeded()
    x, row = _replica(g)
    rows = row.expand(world, -1).clone()
    odd = int(torch.randint(1, world - 5, (), generator=g))
    rows[odd : odd + 2] = _dissenting_row("nan", x, g)  # blocks of two and three dissenters
    present = torch.ones(world, dtype=torch.bool)
    present[world - 3 :] = False
    counted = torch.zeros((world, 1), dtype=torch.bool)
    counted[0] = True
    every = local_of(rows.unsqueeze(1), present=present.unsqueeze(1), counted=counted,
                     sharded=torch.zeros((world, 1), dtype=torch.bool))
    starts = sorted({0, 1, odd, odd + 2, world - 3})
    copies = [b - a for a, b in zip(starts, [*starts[1:], world])]
    blocks = allreduce.Local(*(t[starts] for t in every))
    want, got = allreduce.simulate(every), allreduce.simulate(blocks, copies=copies)
    assert torch.equal(got[: allreduce.SUMMARY_WIDTH], want[: allreduce.SUMMARY_WIDTH]), (
        f"seed {seed}: blocks {starts} x {copies} of {world}"
    )


@pytest.mark.parametrize("by", ("mean", "fingerprint"))
def test_three_values_with_two_equal_largest_classes_are_no_sure_majority(by: str) -> None:
    """W = 8: ranks 1-3 hold one value, ranks 4-6 another, ranks 0 and 7 a
    third; no value is held by a majority, whichever of them the candidate
    classes find, so the summary claims none (REFERENCE < 0)."""
    seed, g = seeded()
    x, row = _replica(g)
    world = 8
    rows = row.expand(world, -1).clone()
    if by == "mean":  # the same exact words: the classes go by mean
        rows[1:4] = scaled(row, Column.MEAN, 1 - 1e-6)
        rows[4:7] = scaled(row, Column.MEAN, 1 + 1e-6)
    else:
        rows[1:4] = _dissenting_row("max_abs", x, g)
        rows[4:7] = _dissenting_row("nan", x, g)
    got = _replica_summary(rows)
    assert int(got[Col.REFERENCE]) < 0, f"seed {seed}: {got.tolist()}"


def test_replicas_near_the_top_of_float64_compare_their_means() -> None:
    """float64 replicas around 1e160 with a spread of 1e150 (their mean
    squared overflows, their m2 does not): a mean that differs by 1e-6
    relative on one rank is still a mismatch."""
    seed, g = seeded()
    x = 1e160 * (1.0 + 1e-10 * torch.rand(1000, generator=g, dtype=torch.float64))
    row = zeroscan.stats(x).buffer
    world = 4
    rows = row.expand(world, -1).clone()
    rows[2] = scaled(row, Column.MEAN, 1 + 1e-6)
    got = _replica_summary(rows)
    assert _named(got, Col.REFERENCE, Col.FIRST_OTHER, Col.LAST_OTHER) == (world - 1, 2, 2), f"seed {seed}"


# ------------------------------------------------------------ per-rank words


@pytest.mark.parametrize("world", (1, 4, 33))
def test_rank_counts_and_first_and_last_ranks(world: int) -> None:
    """PRESENT, NONFINITE_RANKS and the first/last non-finite and absent ranks are as set."""
    seed, g = seeded()
    n = 6
    clean, with_nan = zeroscan.stats(torch.ones(10)).buffer, zeroscan.stats(torch.tensor([1.0, math.inf])).buffer
    nonfinite = torch.rand((world, n), generator=g) < 0.3
    present = torch.rand((world, n), generator=g) < 0.7
    rows = torch.where(nonfinite.unsqueeze(-1), with_nan, clean)
    got = body(allreduce.simulate(local_of(rows, present=present)), n)
    for i in range(n):
        what = f"seed {seed}: row {i} of {world} ranks"
        held = [r for r in range(world) if present[r, i]]
        absent = [r for r in range(world) if not present[r, i]]
        bad = [r for r in held if nonfinite[r, i]]
        assert int(got[i, Col.PRESENT]) == len(held), what
        nonfinite_ranks = _named(got[i], Col.NONFINITE_RANKS, Col.FIRST_NONFINITE, Col.LAST_NONFINITE)
        assert nonfinite_ranks == _expected(bad, world), what
        assert (int(got[i, Col.FIRST_ABSENT]), int(got[i, Col.LAST_ABSENT])) == _expected(absent, world)[1:], what


@pytest.mark.parametrize("world", (1, 2, 8, 33))
def test_header_range_reveals_a_rank_with_another_header(world: int) -> None:
    """header_range gives each header word's least and greatest value over the ranks: one odd rank shows."""
    seed, g = seeded()
    common = torch.randint(-(2**63), 2**63 - 1, (allreduce.NUM_HEADER,), generator=g)
    header = common.expand(world, -1).clone()
    odd = int(torch.randint(0, world, (), generator=g))
    word = int(torch.randint(0, allreduce.NUM_HEADER, (), generator=g))
    header[odd, word] = int(torch.randint(-(2**63), 2**63 - 1, (), generator=g))
    rows = rows_of([[torch.ones(3)] * world])
    low, high = allreduce.header_range(allreduce.simulate(local_of(rows, header=header)))
    what = f"seed {seed}: rank {odd} word {word} of {world}"
    assert low == header.amin(0).tolist() and high == header.amax(0).tolist(), what
    assert header[odd, word].item() in (low[word], high[word]), what
    assert all(lo == hi for k, (lo, hi) in enumerate(zip(low, high)) if k != word), what


# ------------------------------------------------------------ words and sizes


def test_ordered_keys_sort_like_the_floats_and_invert_themselves() -> None:
    """ordered() gives float64 bits int64 keys that order as the floats (-0.0 below 0.0); it is its own inverse."""
    seed, g = seeded()
    specials = torch.tensor([-math.inf, -1e308, -1.0, -5e-324, -0.0, 0.0, 5e-324, 2.2e-308, 1.0, 1e308, math.inf],
                            dtype=torch.float64)
    randoms = torch.randint(-(2**63), 2**63 - 1, (2000,), generator=g).view(torch.float64)
    subnormal = torch.randint(1, 2**52, (200,), generator=g).view(torch.float64) * torch.where(
        torch.rand(200, generator=g) < 0.5, 1.0, -1.0)
    values = torch.cat([specials, randoms[~randoms.isnan()], subnormal])
    bits = values.view(torch.int64)
    keys = allreduce.ordered(bits)
    assert torch.equal(allreduce.ordered(keys), bits), f"seed {seed}: not its own inverse"
    a, b = values.unsqueeze(1), values.unsqueeze(0)
    ka, kb = keys.unsqueeze(1), keys.unsqueeze(0)
    assert bool(((a < b) <= (ka < kb)).all()), f"seed {seed}: a float below another has a key below its key"
    assert bool(((ka < kb) <= (a <= b)).all()), f"seed {seed}: a key below another belongs to a float not above"
    negative_zero, zero = allreduce.ordered(torch.tensor([-0.0, 0.0], dtype=torch.float64).view(torch.int64)).tolist()
    assert negative_zero < zero


@pytest.mark.parametrize(("world", "chunk"), [(8, 3), (33, 5)])
def test_chunked_simulation_matches_the_whole(world: int, chunk: int) -> None:
    """simulate(chunk=...) gives the same words but mean and m2, which agree to 1e-14 (their sums' order differs)."""
    seed, g = seeded()
    full = [make_values(int(torch.randint(0, 10_000, (), generator=g)), torch.float64, g) + 100.0 for _ in range(4)]
    rows = rows_of([split(x, world, g) for x in full])
    present = torch.rand((world, len(full)), generator=g) < 0.9
    counted = torch.rand((world, len(full)), generator=g) < 0.8
    sharded = torch.rand((world, len(full)), generator=g) < 0.5
    header = torch.randint(-100, 100, (world, allreduce.NUM_HEADER), generator=g)
    local = local_of(rows, present=present, counted=counted, sharded=sharded, header=header)
    whole, chunked = allreduce.simulate(local), allreduce.simulate(local, chunk=chunk)
    moments = torch.zeros_like(whole, dtype=torch.bool)
    body(moments, len(full))[:, Column.MEAN : Column.M2 + 1] = True
    assert torch.equal(whole[~moments], chunked[~moments]), f"seed {seed}"
    got, want = (decode(allreduce.summary_rows(s, len(full))) for s in (chunked, whole))
    for i, (got_row, want_row) in enumerate(zip(got, want)):
        assert_moments_close(got_row, want_row, 1e-14, f"seed {seed}: tensor {i}", world=world)


class _Done:
    """The work handle of an asynchronous all_reduce that has finished."""

    def wait(self) -> bool:
        return True


class _Traffic:
    """Stands in for torch.distributed in allreduce.start: a group of `world`
    ranks whose all_reduce leaves the buffer as it is and counts its bytes."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.sent = 0
        self.calls = 0

    def get_world_size(self, group: object = None) -> int:
        return self.world

    def all_reduce(
        self, tensor: torch.Tensor, op: object = None, group: object = None, async_op: bool = False
    ) -> _Done | None:
        self.sent += tensor.numel() * tensor.element_size()
        self.calls += 1
        return _Done() if async_op else None


@pytest.mark.parametrize("n", (1, 7, 100))
def test_bytes_do_not_grow_with_the_world(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """start() sends payload_bytes(n) <= 320 n + 64 per rank, in five all_reduces, at any W; the summary
    is summary_bytes(n) <= 200 n + 64."""
    for world in (1, 3, 16, 4096):
        traffic = _Traffic(world)
        monkeypatch.setattr(allreduce.dist, "get_world_size", traffic.get_world_size)
        monkeypatch.setattr(allreduce.dist, "all_reduce", traffic.all_reduce)
        rank = world - 1
        local = allreduce.Local(
            zeroscan.stats(torch.ones(5)).buffer.expand(n, -1).clone(),
            torch.ones(n, dtype=torch.bool), torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool),
            torch.tensor([rank]), torch.zeros(allreduce.NUM_HEADER, dtype=torch.int64),
        )
        summary = allreduce.start(local, None)  # type: ignore[arg-type]
        assert traffic.sent == allreduce.payload_bytes(n), f"{n} rows, rank {rank} of {world}"
        assert traffic.calls == 5, f"{traffic.calls} all_reduces for {n} rows, rank {rank} of {world}"
        assert summary.numel() * summary.element_size() == allreduce.summary_bytes(n), f"{n} rows of {world} ranks"
    assert allreduce.payload_bytes(n) <= 320 * n + 16 * allreduce.NUM_HEADER  # the header: least and greatest word
    assert allreduce.summary_bytes(n) <= 200 * n + 16 * allreduce.NUM_HEADER


# ------------------------------------------------------------ overflow


def _huge(world: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [W, 2, 16] of float64 data near the top of its range (each rank's
    n_i mean_i overflows): all positive, and of both signs around 1e300."""
    positive = (0.5 + 0.5 * torch.rand(4000, generator=g, dtype=torch.float64)) * 1.5e308
    mixed = (0.5 + 0.5 * torch.rand(4000, generator=g, dtype=torch.float64)) * 1e300
    mixed[torch.rand(4000, generator=g) < 0.4] *= -1
    rows = rows_of([split(positive, world, g), split(mixed, world, g)])
    return rows, combine_rows(rows)


@pytest.mark.parametrize("world", (2, 5, 16))
def test_overflowing_sums_keep_exact_words_and_a_finite_mean(world: int) -> None:
    """Data near 1e308: counts and min/max |x| still exact; the mean finite and within 1e-9 of combine_rows's."""
    seed, g = seeded()
    rows, want = _huge(world, g)
    merged = allreduce.summary_rows(allreduce.simulate(local_of(rows)), 2)
    assert torch.equal(merged[:, EXACT_WORDS], want[:, EXACT_WORDS]), f"seed {seed}"
    for i, (got_row, want_row) in enumerate(zip(decode(merged), decode(want))):
        assert math.isfinite(got_row["mean"]), f"seed {seed}: tensor {i}"
        assert close(got_row["mean"], want_row["mean"], 1e-9, 0.0), (
            f"seed {seed}: tensor {i}: {got_row['mean']!r} vs {want_row['mean']!r}"
        )


@pytest.mark.parametrize("world", (2, 5))
def test_overflowing_m2_is_infinite_not_nan(world: int) -> None:
    """Where combine_rows's m2 overflows to inf, the merged m2 is inf too (not NaN)."""
    seed, g = seeded()
    rows, want = _huge(world, g)
    merged = allreduce.summary_rows(allreduce.simulate(local_of(rows)), 2)
    assert merged[:, Column.M2].tolist() == want[:, Column.M2].tolist(), f"seed {seed}"
