"""The rule book for a tensor's values: what one scan's numbers say.

zeroscan.diagnose (and through it the checkpoint CLI) and the Monitor's
gradient rules judge a tensor's numbers here, by the same rules in the same
order; the first rule that holds gives the verdict:

  EMPTY              the tensor has no elements
  NONFINITE          at least one NaN or +-inf
  EXACT_ZERO         every value is exactly zero (+0.0 or -0.0)
  UNDERFLOW          there are nonzero values and every one of them is tiny
                     (exact zeros may be present too): what is left is below
                     the dtype's usable precision
  PARTIAL_UNDERFLOW  subnormal values are at least `partial_underflow` of
                     the nonzero values: precision is being lost
  MOSTLY_ZERO        exact zeros are at least `mostly_zero` of the values
  CONSTANT           two or more values, all equal
  HEALTHY            none of the above

A rule is one function of `Values` and `Limits` that says whether it holds,
and one that says why in a sentence (diagnose's reason). A new rule is one
`Rule` in RULES, at its place in the order, and one test; the Monitor words
the verdicts it knows more about (where a zero gradient comes from, say) in
monitor/rules.py and reports any other verdict in the rule's own words.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from zeroscan.verdicts import MOSTLY_ZERO, PARTIAL_UNDERFLOW, Verdict
from zeroscan.words import count_noun, is_are


class Values(NamedTuple):
    """What the rules read of one scan of one tensor."""

    dtype: torch.dtype
    numel: int
    zeros: int
    subnormal: int
    # The nonzero values below the dtype's usable precision. For diagnose: the
    # subnormal ones and those with |x| <= tol (the scan's near_zero count).
    # For a gradient (the Monitor): the subnormal ones alone, since a healthy
    # gradient's entries are often far below eps, the default tol.
    tiny: int
    nan: int
    posinf: int
    neginf: int
    min_abs: float
    max_abs: float
    mean: float
    tol: float | None  # the scan's near-zero threshold (None: the dtype's eps); words only

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    @property
    def nonzero(self) -> int:
        return self.numel - self.zeros

    @classmethod
    def of_row(cls, row: dict[str, float | int], dtype: torch.dtype, *, tiny: str = "near_zero",
               tol: float | None = None) -> Values:
        """The values of a decoded result row (zeroscan.result_row.Row, or a
        Stats, which has the same fields as attributes: `of_stats`); `tiny`
        names the count the UNDERFLOW rule reads."""
        return cls(dtype, int(row["numel"]), int(row["zeros"]), int(row["subnormal"]), int(row[tiny]),
                   int(row["nan"]), int(row["posinf"]), int(row["neginf"]), float(row["min_abs"]),
                   float(row["max_abs"]), float(row["mean"]), tol)

    @classmethod
    def of_stats(cls, s: object) -> Values:
        """The values of a zeroscan.Stats; tiny: its near_zero count."""
        return cls(s.dtype, s.numel, s.zeros, s.subnormal, s.near_zero, s.nan, s.posinf,  # type: ignore[attr-defined]
                   s.neginf, s.min_abs, s.max_abs, s.mean, s.tol)  # type: ignore[attr-defined]


class Limits(NamedTuple):
    """The thresholds of the fraction rules (zeroscan.verdicts gives their defaults)."""

    mostly_zero: float = MOSTLY_ZERO
    partial_underflow: float = PARTIAL_UNDERFLOW


class Rule(NamedTuple):
    verdict: Verdict
    holds: Callable[[Values, Limits], bool]
    says: Callable[[Values, Limits], str]  # why, in one sentence, once it holds


def verdict_of(v: Values, limits: Limits) -> Rule | None:
    """The first rule that holds for `v`, or None: HEALTHY."""
    for rule in RULES:
        if rule.holds(v, limits):
            return rule
    return None


def judge(v: Values, limits: Limits) -> tuple[Verdict, str]:
    """The verdict for `v` and the sentence that says why."""
    rule = verdict_of(v, limits)
    if rule is None:
        return Verdict.HEALTHY, _healthy(v)
    return rule.verdict, rule.says(v, limits)


# ---- the rules, in their order ----------------------------------------------------


def _empty(v: Values, _: Limits) -> str:
    return f"the {_dtype(v)} tensor has no elements, so there is nothing to judge"


def _nonfinite(v: Values, _: Limits) -> str:
    # "+inf" and "-inf" are symbols and take no plural s; "NaN" is a word and does.
    kinds = ((v.nan, "NaN", "NaNs"), (v.posinf, "+inf", "+inf"), (v.neginf, "-inf", "-inf"))
    parts = [count_noun(k, one, many) for k, one, many in kinds if k]
    return (
        f"{_some_of(v.nonfinite, v.numel)} not finite ({', '.join(parts)}); "
        f"everything computed from {'it' if v.nonfinite == 1 else 'them'} is poisoned"
    )


def _exact_zero(v: Values, _: Limits) -> str:
    return f"{'the only value is' if v.numel == 1 else f'all {v.numel} values are'} exactly zero"


def _underflow(v: Values, _: Limits) -> str:
    zero_part = f" ({v.zeros} more exactly zero)" if v.zeros else ""
    return (
        f"every nonzero value ({v.nonzero} of {v.numel}{zero_part}) is subnormal or at most {_tol_words(v)}; "
        f"the largest |x| is {v.max_abs:.3g}, too small for {_dtype(v)} to carry"
    )


def _partial_underflow(v: Values, limits: Limits) -> str:
    return (
        f"{_some_of(v.subnormal, v.nonzero, 'nonzero value')} subnormal in {_dtype(v)} "
        f"(below {torch.finfo(v.dtype).tiny:.3g}), so {'it has' if v.subnormal == 1 else 'they have'} "
        f"lost precision (threshold {limits.partial_underflow:.3g})"
    )


def _mostly_zero(v: Values, limits: Limits) -> str:
    return f"{_some_of(v.zeros, v.numel)} exactly zero (threshold {limits.mostly_zero:.3g})"


def _constant(v: Values, _: Limits) -> str:
    return f"all {v.numel} values equal {v.mean:.6g}"


def _healthy(v: Values) -> str:
    return f"{count_noun(v.numel, 'finite value')}, {_share(v.zeros, v.numel)} exactly zero, |x| up to {v.max_abs:.3g}"


RULES: tuple[Rule, ...] = (
    Rule(Verdict.EMPTY, lambda v, _: v.numel == 0, _empty),
    Rule(Verdict.NONFINITE, lambda v, _: v.nonfinite > 0, _nonfinite),
    Rule(Verdict.EXACT_ZERO, lambda v, _: v.zeros == v.numel, _exact_zero),
    Rule(Verdict.UNDERFLOW, lambda v, _: v.tiny == v.nonzero, _underflow),
    Rule(Verdict.PARTIAL_UNDERFLOW,
         lambda v, lim: v.subnormal > 0 and v.subnormal / v.nonzero >= lim.partial_underflow, _partial_underflow),
    Rule(Verdict.MOSTLY_ZERO, lambda v, lim: v.zeros / v.numel >= lim.mostly_zero, _mostly_zero),
    # The same |x| and the same sign: |mean| equals it.
    Rule(Verdict.CONSTANT, lambda v, _: v.numel >= 2 and v.min_abs == v.max_abs and abs(v.mean) == v.max_abs,
         _constant),
)


# ---- words ------------------------------------------------------------------------


def _dtype(v: Values) -> str:
    return str(v.dtype).removeprefix("torch.")


def _tol_words(v: Values) -> str:
    if v.tol is not None:
        return f"tol={v.tol:.3g}"
    if v.dtype.is_floating_point:
        return f"eps={torch.finfo(v.dtype).eps:.3g}"
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
