"""Counts in words that agree in number: "1 NaN is", "2 NaNs are".

Every message that puts a count before a noun or a verb builds it here, so
that a tensor of one value never reads "1 values are"; and so do the
messages that name ranks ("rank 3", "ranks 3 and 9", "5 ranks from 3 to 40").
Counts too large to write out shrink here too ("12.3K", "1.0M"), alike in
the Stats line and the CLI's tables.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


def count_noun(n: int, singular: str, plural: str | None = None) -> str:
    """`n` and the noun in the number `n` asks for: count_noun(1, "NaN") is
    "1 NaN", count_noun(3, "NaN") "3 NaNs"; `plural` for an irregular noun
    (count_noun(2, "info", "info"))."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"zeroscan.words.count_noun: n must be an int, got {type(n).__name__}")
    return f"{n} {singular if n == 1 else (plural if plural is not None else singular + 's')}"


# Decimal units for counts, smallest first; a count past the last stays in it.
COUNT_UNITS: tuple[tuple[str, float], ...] = (("K", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12))
EXACT_COUNT_BELOW = 10_000  # shorter than "10.0K": counts below this are written out


def short_count(n: int) -> str:
    """A count in a few characters: 9999 -> "9999", 12345 -> "12.3K",
    10**6 -> "1.0M". The unit is the smallest whose one-decimal value stays
    below 1000 after rounding, so 999_950 reads "1.0M", not "1000.0K"."""
    if n < EXACT_COUNT_BELOW:
        return str(n)
    *smaller, (largest, largest_scale) = COUNT_UNITS
    for unit, scale in smaller:
        text = f"{n / scale:.1f}"
        # Compare the rounded text, not n / scale: 999.95 is below 1000 but prints as "1000.0".
        if float(text) < 1000:
            return text + unit
    return f"{n / largest_scale:.1f}{largest}"


def listed(names: list[str], shown: int) -> str:
    """The first `shown` of `names`, comma-separated, and how many more there are:
    listed(["a", "b", "c"], 2) is "a, b and 1 more"."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def is_are(n: int) -> str:
    """The verb for a subject of `n` things: "is" for 1, "are" otherwise (0 included)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"zeroscan.words.is_are: n must be an int, got {type(n).__name__}")
    return "is" if n == 1 else "are"


class RankSet(NamedTuple):
    """Ranks known by their number and their lowest and highest member
    (global ranks): all of them when they are one or two."""

    count: int
    first: int
    last: int

    @property
    def named(self) -> tuple[int, ...]:
        """The ranks known by number: all when one or two, else the lowest and highest."""
        if self.count <= 0:
            return ()
        return (self.first,) if self.count == 1 else (self.first, self.last)

    def words(self) -> str:
        if self.count == 1:
            return f"rank {self.first}"
        if self.count == 2:
            return f"ranks {self.first} and {self.last}"
        return f"{self.count} ranks from {self.first} to {self.last}"


def span(ranks: Sequence[int]) -> str:
    """A short phrase for a list of ranks: every rank up to four, else their number and range."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) <= 4:
        return f"ranks {list(ranks)}"
    return f"{len(ranks)} ranks from {min(ranks)} to {max(ranks)}"


def brief(value: object) -> str:
    """repr() cut short: a hostile file can hold a 100 MB name or a million-long shape."""
    short = reprlib.Repr()
    short.maxstring, short.maxlist, short.maxlong, short.maxother = 120, 8, 40, 120
    return short.repr(value)


def nonfinite_words(f: Mapping[str, float | int]) -> str:
    """"3 NaN and 1 +inf among 4096 values": the non-finite counts of a decoded result row."""
    parts = [f"{int(f[k])} {label}" for k, label in (("nan", "NaN"), ("posinf", "+inf"), ("neginf", "-inf")) if f[k]]
    return " and ".join(parts) + f" among {int(f['numel'])} values"


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")
