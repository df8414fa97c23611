"""What a report's table cells say, in a few characters: numbers, byte
sizes, shares, shapes, and where a tensor's magnitudes lie binade by
binade (fmt_binades)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")  # a size past the last stays in it


def fmt_bytes(n: float) -> str:
    """A byte size in binary units: 1536 -> "1.5 KiB". The unit is the
    smallest whose rounded value stays below 1024, so 1023.96 KiB reads
    "1.0 MiB", not "1024.0 KiB"."""
    for power, unit in enumerate(BYTE_UNITS):
        value = n / 1024**power
        text = f"{value:.0f}" if unit == "B" else f"{value:.1f}"  # whole bytes, tenths of the rest
        # Compare the rounded text, not value: 1023.96 is below 1024 but prints as "1024.0".
        if float(text) < 1024:
            break
    return f"{text} {unit}"


def fmt_num(v: object) -> str:
    """A statistic in 3 significant digits; None (not measured) is "-"."""
    if v is None:
        return "-"
    x = float(v)  # type: ignore[arg-type]
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e4 else f"{x:.2e}"


def fmt_percent(part: int, whole: int) -> str:
    """part/whole in percent; a nonzero part below 0.01 % shows as "<0.01%", never as "0"."""
    if part == 0 or whole == 0:
        return "0"
    if part == whole:
        return "100%"
    pct = 100.0 * part / whole
    return f"{pct:.3g}%" if pct >= 0.01 else "<0.01%"


def fmt_shape(shape: Sequence[int]) -> str:
    """A shape without spaces, so a table column stays one word: [3,4]."""
    return "[" + ",".join(str(s) for s in shape) + "]"


# --- log2-magnitude histograms ----------------------------------------------------

BULK_SHARE = 0.99  # the share of a tensor's nonzero finite values that fmt_binades' second range holds


def fmt_binades(histogram: Mapping[str, Any], dtype: str) -> str:
    """Where a tensor's nonzero finite values lie, from its histogram
    (Histogram.to_dict()) and its dtype's name: "2^-24..2^3, 99% in
    2^-8..2^1" says every one has 2^-24 <= |x| < 2^3, and at least 99 % of
    them 2^-8 <= |x| < 2^1 (the binades left when those holding the
    smallest and the largest 0.5 % are dropped; left out when that is the
    whole range). Subnormals count as the binade from the dtype's smallest
    subnormal to its smallest normal. "-" when there is no such value."""
    bins = binade_bins(histogram, dtype)
    total = sum(count for _, _, count in bins)
    if not total:
        return "-"
    first, last = bulk(bins, total)
    text = f"{fmt_power(bins[0][0])}..{fmt_power(bins[-1][1])}"
    if (first, last) != (0, len(bins) - 1):
        text += f", {BULK_SHARE:.0%} in {fmt_power(bins[first][0])}..{fmt_power(bins[last][1])}"
    return text


def binade_bins(histogram: Mapping[str, Any], dtype: str) -> list[tuple[int, int, int]]:
    """(low exponent, high exponent, count) of each nonempty bin, ascending: the
    values 2^low <= |x| < 2^high; subnormals first, normal binades after."""
    bins = [(int(e), int(e) + 1, int(c)) for e, c in histogram["binades"].items() if int(c)]
    bins.sort()
    if int(histogram["subnormal"]):
        lowest = int(histogram["min_exponent"])
        bins.insert(0, (lowest - mantissa_bits(dtype), lowest, int(histogram["subnormal"])))
    return bins


def mantissa_bits(dtype: str) -> int:
    """The explicit mantissa bits of a floating dtype (a complex one's parts'), by torch's name."""
    import torch

    return round(-math.log2(torch.finfo(getattr(torch, dtype)).eps))


def bulk(bins: Sequence[tuple[int, int, int]], total: int) -> tuple[int, int]:
    """The first and last index of `bins` left when the bins at each end
    holding at most (1 - BULK_SHARE) / 2 of `total` are dropped."""
    tail = (1.0 - BULK_SHARE) / 2 * total
    first, below = 0, bins[0][2]
    while below <= tail:
        first += 1
        below += bins[first][2]
    last, above = len(bins) - 1, bins[-1][2]
    while above <= tail:
        last -= 1
        above += bins[last][2]
    return first, last


def fmt_power(exponent: int) -> str:
    return f"2^{exponent}"
