"""The replica comparison of zeroscan/distributed/allreduce.py: candidates, classes, the reference.

Replicas (data-parallel copies that should hold the same tensor) are
compared without gathering them. Three candidate values: the least and the
greatest fingerprint, and the counted copy's (where the fingerprints all
agree, the least, greatest and counted copy's mean within the relative
tolerance `rtol`, reduction order, then the least and greatest m2). Round
two counts the ranks equal to each (classes L, H and C) and finds the
lowest and highest rank outside each. The largest class is the reference
(then the one holding fewer non-finite values, then C, L, H), and the ranks
outside it are named: exactly when they are one or two, else by their
number and their lowest and highest rank. A majority that holds none of the
candidate values (ranks on both sides of it that differ from each other,
and the counted copy among them) goes unseen: so when two different classes
tie, or the reference holds at most half of the ranks while the ranks hold
more than two values (some rank in no class, or three classes), the summary
marks that no majority is sure. The fingerprint is a 64-bit hash: two
different rows pass for equal with a probability near 2^-64.

zeroscan/distributed/allreduce.py carries the candidates in round one's MIN words and
the classes in round two (class_words); this module says what they are and
which class is the reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from zeroscan.distributed.allreduce_words import INT64_MAX, as_words, last_rank, neither, ordered


def _close(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, rtol: float) -> torch.Tensor:
    return ((a - b).abs() <= rtol * scale) | (a == b)


class Candidates(NamedTuple):
    """The three candidate values a replica comparison counts the ranks
    against, per row, the same on every rank: the least, the greatest and
    the counted copy's fingerprint (`by_print`: where the ranks' differ), or
    else their mean (`by_mean`: where the means differ beyond rtol), or else
    the least and greatest m2 (the counted copy has no class then)."""

    by_print: torch.Tensor  # bool [..., N]
    by_mean: torch.Tensor  # bool [..., N]
    prints: torch.Tensor  # int64 [..., N, 3]: least, greatest, counted copy's
    means: torch.Tensor  # float64 [..., N, 3]
    m2s: torch.Tensor  # float64 [..., N, 2]: least, greatest
    mean_scale: torch.Tensor  # float64 [..., N]: what rtol is relative to
    m2_scale: torch.Tensor

    def keys(self, rtol: float) -> torch.Tensor:
        """int64 [..., N, 3]: equal where two candidates count the same class."""
        mean_keys = ordered(as_words(self.means))
        lo, hi, copy = self.means.unbind(-1)
        copy_key = torch.where(
            _close(copy, lo, self.mean_scale, rtol), mean_keys[..., 0],
            torch.where(_close(copy, hi, self.mean_scale, rtol), mean_keys[..., 1], mean_keys[..., 2]),
        )
        by_mean = torch.stack([mean_keys[..., 0], mean_keys[..., 1], copy_key], -1)
        m2_keys = ordered(as_words(self.m2s))
        same_m2 = _close(self.m2s[..., 1], self.m2s[..., 0], self.m2_scale, rtol)
        high_key = torch.where(same_m2, m2_keys[..., 0], m2_keys[..., 1])
        no_class = torch.full_like(high_key, -INT64_MAX - 1)  # C has no class when only m2 tells
        by_m2 = torch.stack([m2_keys[..., 0], high_key, no_class], -1)
        return torch.where(
            self.by_print.unsqueeze(-1), self.prints, torch.where(self.by_mean.unsqueeze(-1), by_mean, by_m2)
        )


def candidates(
    prints: torch.Tensor, means: torch.Tensor, m2s: torch.Tensor, n: torch.Tensor, rtol: float
) -> Candidates:
    """The candidates from the values round one found (fields of Candidates);
    n: float64 [..., N], the finite values of a replica (the ranks whose
    fingerprints agree hold as many)."""
    n = n.clamp_min(1.0)
    top = torch.maximum(means[..., 0].abs(), means[..., 1].abs())
    m2_top = torch.maximum(m2s[..., 0].abs(), m2s[..., 1].abs())
    # The root mean square and the sum of squares, held within range: |mean|
    # past 1e154 would make n mean^2 infinite, and every difference "close".
    mean_scale = torch.hypot(torch.sqrt(m2_top / n), top)
    m2_scale = m2_top + n * top * top
    m2_scale = torch.where(m2_scale.isfinite(), m2_scale, m2_top)
    by_print = prints[..., 0] != prints[..., 1]
    by_mean = ~by_print & ~_close(means[..., 0], means[..., 1], mean_scale, rtol)
    return Candidates(by_print, by_mean, prints, means, m2s, mean_scale, m2_scale)


class Classes(NamedTuple):
    """Which replica class each rank is in (bool [..., N] each): that of the
    least candidate value (L), the greatest (H), the counted copy's (C:
    rank 0's in the Monitor)."""

    low: torch.Tensor
    high: torch.Tensor
    copy: torch.Tensor


def classes(
    c: Candidates, held: torch.Tensor, fp: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor, rtol: float
) -> Classes:
    """This rank's classes from its own row: held bool [..., N] (it holds
    the tensor), fp int64 [..., N] (its fingerprint), mean and m2 float64
    [..., N]."""

    def near_mean(k: int) -> torch.Tensor:
        return ~held | _close(mean, c.means[..., k], c.mean_scale, rtol)

    def near_m2(k: int) -> torch.Tensor:
        return ~held | _close(m2, c.m2s[..., k], c.m2_scale, rtol)

    low = torch.where(c.by_print, fp == c.prints[..., 0], torch.where(c.by_mean, near_mean(0), near_m2(0)))
    high = torch.where(c.by_print, fp == c.prints[..., 1], torch.where(c.by_mean, near_mean(1), near_m2(1)))
    copy = torch.where(c.by_print, fp == c.prints[..., 2], c.by_mean & near_mean(2))
    return Classes(low, high, copy)


def class_words(
    found: Classes, nonfinite: torch.Tensor, rank: torch.Tensor, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's words of round two: float64 [..., N, 6] to SUM (in L, in
    H, in C, in none, in L with a non-finite value, in H with one) and int64
    [..., N, 6] to MIN (first and ~last rank outside L, outside H, outside
    C); nonfinite: bool [..., N], rank: int64 [..., 1]."""
    none = ~(found.low | found.high | found.copy)
    sums = torch.stack([
        found.low.double(), found.high.double(), found.copy.double(), none.double(),
        (found.low & nonfinite).double(), (found.high & nonfinite).double(),
    ], -1)
    rank = rank.expand_as(found.low)
    outside = []
    for member in found:
        outside += [torch.where(member, world, rank), neither(~member, ~rank)]
    return sums, torch.stack(outside, -1)


def reference(
    sums: torch.Tensor, outside: torch.Tensor, first_nonfinite: torch.Tensor, keys: torch.Tensor, world: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the reference class's size (negative when no majority is
    sure), and the first and last rank outside it, from round two's reduced
    class words (`sums`, `outside`: see class_words), the lowest rank with a
    non-finite value (`first_nonfinite`, W: none) and the candidates' `keys`
    (Candidates.keys). The candidates are the classes of the least value,
    the greatest and the counted copy's; the largest wins, then the one
    holding fewer non-finite values, then the counted copy's, the least's,
    the greatest's. No majority is sure on a tie between different classes,
    or when the winner holds at most half of the ranks while the ranks hold
    more than two values (some rank in no candidate class, whose value may
    be held by more; or three classes). Two halves are told apart by their
    non-finite values alone."""
    counts = sums[..., 0:3].round().long()  # [N, 3]: L, H, C
    none = sums[..., 3].round().long()
    # C's members hold what the counted copy holds: rank 0's, where the replicas are compared.
    copy_nonfinite = first_nonfinite == 0
    bad = torch.stack([
        sums[..., 4].round().long(), sums[..., 5].round().long(),
        torch.where(copy_nonfinite, counts[..., 2], 0),
    ], -1)
    firsts, lasts = outside[..., 0::2], last_rank(outside[..., 1::2])
    score = (counts * (world + 1) + (world - bad)) * 3
    score[..., 0] += 1  # on a full tie: C, then L, then H
    score[..., 2] += 2
    best = score.argmax(-1, keepdim=True)
    count, worse = counts.gather(-1, best), bad.gather(-1, best)
    first, last = firsts.gather(-1, best), lasts.gather(-1, best)
    differs = keys != keys.gather(-1, best)
    tie = ((counts == count) & (bad == worse) & differs).any(-1)
    count, first, last = count[..., 0], first[..., 0], last[..., 0]
    held = counts > 0  # how many different classes the candidates found
    distinct = held[..., 0].long() + (held[..., 1] & (keys[..., 1] != keys[..., 0])).long() + (
        held[..., 2] & (keys[..., 2] != keys[..., 0]) & (keys[..., 2] != keys[..., 1])
    ).long()
    minority = (2 * count <= world) & ((none > 0) | (distinct > 2))
    unsure = (count < world) & (tie | minority)
    return torch.where(unsure, -count, count), first, last
