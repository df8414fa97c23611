"""zeroscan.diagnose: from the counts of one scan to a verdict in plain words.

A Stats record says how many values are zero, subnormal, near zero or
non-finite; a Diagnosis says what that means. The verdicts, their order and
the words of each reason are the rule book of zeroscan/value_rules.py, which
the Monitor's gradient rules read too: EMPTY, NONFINITE, EXACT_ZERO,
UNDERFLOW (every nonzero value subnormal or <= tol), PARTIAL_UNDERFLOW,
MOSTLY_ZERO, CONSTANT, else HEALTHY; the first that holds wins.

`tol` is the near-zero threshold of the scan (zeroscan.stats), by default
torch.finfo(dtype).eps; integer tensors have no subnormal or near-zero values.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from zeroscan.stats import Stats, scan_many, scan_one
from zeroscan.value_rules import Limits, Values, judge
from zeroscan.verdicts import MOSTLY_ZERO, PARTIAL_UNDERFLOW, Severity, Verdict, check_fraction

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
    verdict, reason = judge(Values.of_stats(stats), Limits(mostly_zero, partial_underflow))
    return Diagnosis(verdict, reason, stats)


def _check_thresholds(op: str, mostly_zero: float, partial_underflow: float) -> None:
    check_fraction(op, "mostly_zero", mostly_zero)
    check_fraction(op, "partial_underflow", partial_underflow)
