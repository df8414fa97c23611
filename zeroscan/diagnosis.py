"""zeroscan.diagnose: from the counts of one scan to a verdict in plain words.

A Stats record says how many values are zero, subnormal, near zero or
non-finite; a Diagnosis says what that means. The verdicts are checked in
this order and the first that holds wins:

  EMPTY              the tensor has no elements
  NONFINITE          at least one NaN or +-inf
  EXACT_ZERO         every value is exactly zero (+0.0 or -0.0)
  UNDERFLOW          there are nonzero values and every one of them is
                     subnormal or <= tol (exact zeros may be present too):
                     what is left is below the dtype's usable precision
  MOSTLY_ZERO        exact zeros are at least `mostly_zero` of the values
  PARTIAL_UNDERFLOW  subnormal values are at least `partial_underflow` of
                     the nonzero values: precision is being lost
  CONSTANT           two or more values, all equal
  HEALTHY            none of the above

`tol` is the near-zero threshold of the scan (zeroscan.stats), by default
torch.finfo(dtype).eps; integer tensors have no subnormal or near-zero values.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from zeroscan.stats import Stats, scan_many, scan_one
from zeroscan.verdicts import MOSTLY_ZERO, PARTIAL_UNDERFLOW, Severity, Verdict, check_fraction
from zeroscan.words import count_noun, is_are

__all__ = [
    "MOSTLY_ZERO", "PARTIAL_UNDERFLOW", "Diagnosis", "Severity", "Verdict",
    "diagnose", "diagnose_many", "diagnose_stats",
]


@dataclass(frozen=True)
class Diagnosis:
    """A verdict, the one-sentence reason for it, and the Stats it rests on."""

    verdict: Verdict
    reason: str
    stats: Stats

    @property
    def severity(self) -> Severity:
        return self.verdict.severity

    def to_dict(self) -> dict[str, object]:
        return {
            "verdict": self.verdict.value,
            "severity": self.severity.name.lower(),
            "reason": self.reason,
            "stats": self.stats.to_dict(),
        }

    def __str__(self) -> str:
        return f"{self.verdict.name} ({self.severity.name.lower()}): {self.reason}\n  {self.stats!r}"


def diagnose(
    x: torch.Tensor,
    *,
    tol: float | None = None,
    mostly_zero: float = MOSTLY_ZERO,
    partial_underflow: float = PARTIAL_UNDERFLOW,
) -> Diagnosis:
    """Scans `x` once and says what it is (see the module doc for the verdicts).

    tol: near-zero threshold; None means torch.finfo(x.dtype).eps.
    mostly_zero: fraction of exact zeros from which the verdict is MOSTLY_ZERO
        (default 0.9).
    partial_underflow: fraction of the nonzero values that are subnormal from
        which the verdict is PARTIAL_UNDERFLOW (default 0.01).
    """
    _check_thresholds("zeroscan.diagnose", mostly_zero, partial_underflow)
    return diagnose_stats(scan_one("zeroscan.diagnose", x, tol=tol), mostly_zero=mostly_zero, partial_underflow=partial_underflow)


def diagnose_many(
    tensors: Iterable[torch.Tensor],
    *,
    tol: float | None = None,
    mostly_zero: float = MOSTLY_ZERO,
    partial_underflow: float = PARTIAL_UNDERFLOW,
) -> list[Diagnosis]:
    """diagnose() for many tensors with one stats_many call (one per device)."""
    _check_thresholds("zeroscan.diagnose_many", mostly_zero, partial_underflow)
    batch = scan_many("zeroscan.diagnose_many", tensors, tol=tol)
    return [
        diagnose_stats(s, mostly_zero=mostly_zero, partial_underflow=partial_underflow)
        for s in batch
    ]


def diagnose_stats(
    stats: Stats,
    *,
    mostly_zero: float = MOSTLY_ZERO,
    partial_underflow: float = PARTIAL_UNDERFLOW,
) -> Diagnosis:
    """The verdict for an existing Stats (same logic and defaults as diagnose),
    for example one item of a stats_many result."""
    if not isinstance(stats, Stats):
        raise TypeError(f"zeroscan.diagnose_stats: stats must be a zeroscan.Stats, got {type(stats).__name__}")
    _check_thresholds("zeroscan.diagnose_stats", mostly_zero, partial_underflow)
    verdict, reason = _judge(stats, mostly_zero, partial_underflow)
    return Diagnosis(verdict, reason, stats)


def _check_thresholds(op: str, mostly_zero: float, partial_underflow: float) -> None:
    check_fraction(op, "mostly_zero", mostly_zero)
    check_fraction(op, "partial_underflow", partial_underflow)


def _judge(s: Stats, mostly_zero: float, partial_underflow: float) -> tuple[Verdict, str]:
    n = s.numel
    dtype = str(s.dtype).removeprefix("torch.")
    if n == 0:
        return Verdict.EMPTY, f"the {dtype} tensor has no elements, so there is nothing to judge"
    nonfinite = s.nan + s.posinf + s.neginf
    if nonfinite:
        # "+inf" and "-inf" are symbols and take no plural s; "NaN" is a word and does.
        kinds = ((s.nan, "NaN", "NaNs"), (s.posinf, "+inf", "+inf"), (s.neginf, "-inf", "-inf"))
        parts = [count_noun(k, one, many) for k, one, many in kinds if k]
        return Verdict.NONFINITE, (
            f"{_some_of(nonfinite, n)} not finite ({', '.join(parts)}); "
            f"everything computed from {'it' if nonfinite == 1 else 'them'} is poisoned"
        )
    zeros = s.zeros
    if zeros == n:
        return Verdict.EXACT_ZERO, f"{'the only value is' if n == 1 else f'all {n} values are'} exactly zero"
    nonzero = n - zeros
    tiny = s.near_zero
    if tiny == nonzero:
        limit = _tol_words(s)
        zero_part = f" ({zeros} more exactly zero)" if zeros else ""
        return Verdict.UNDERFLOW, (
            f"every nonzero value ({nonzero} of {n}{zero_part}) is subnormal or at most {limit}; "
            f"the largest |x| is {s.max_abs:.3g}, too small for {dtype} to carry"
        )
    if zeros / n >= mostly_zero:
        return Verdict.MOSTLY_ZERO, (
            f"{_some_of(zeros, n)} exactly zero "
            f"(threshold {mostly_zero:.3g})"
        )
    if s.subnormal and s.subnormal / nonzero >= partial_underflow:
        return Verdict.PARTIAL_UNDERFLOW, (
            f"{_some_of(s.subnormal, nonzero, 'nonzero value')} subnormal in {dtype} "
            f"(below {torch.finfo(s.dtype).tiny:.3g}), so {'it has' if s.subnormal == 1 else 'they have'} "
            "lost precision "
            f"(threshold {partial_underflow:.3g})"
        )
    if n >= 2 and s.min_abs == s.max_abs and abs(s.mean) == s.max_abs:  # same |x|, same sign
        return Verdict.CONSTANT, f"all {n} values equal {s.mean:.6g}"
    return Verdict.HEALTHY, (
        f"{count_noun(n, 'finite value')}, {_share(zeros, n)} exactly zero, |x| up to {s.max_abs:.3g}"
    )


def _tol_words(s: Stats) -> str:
    if s.tol is not None:
        return f"tol={s.tol:.3g}"
    if s.dtype.is_floating_point:
        return f"eps={torch.finfo(s.dtype).eps:.3g}"
    return "0"


def _share(part: int, whole: int) -> str:
    if part == whole:
        return "all"
    pct = 100.0 * part / whole
    text = f"{pct:.3g}"
    if pct < 0.01 or text == "100" or not math.isfinite(pct):  # "100%" would read as "all"
        return f"{part}"
    return f"{text}%"


def _some_of(part: int, whole: int, noun: str = "value") -> str:
    """The subject and its verb, agreeing in number: "the only value is",
    "all of the 5 values are", "1 of the 20000 values is", "5% of the 200 values are"."""
    if part == whole == 1:
        return f"the only {noun} is"
    share = _share(part, whole)
    verb = is_are(part) if share == str(part) else "are"  # "all" and a percentage are plural
    return f"{share} of the {whole} {noun}s {verb}"
