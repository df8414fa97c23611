"""Log2-magnitude histograms against their dtype's range: one heat-map row
per tensor (`plot_histograms`), for `zeroscan scan --histogram --plot` and
for histograms from `stats(x, histogram=True)` or a Monitor report.

matplotlib is optional and imported only when drawing (zeroscan.plot).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from zeroscan.headroom import FORMATS
from zeroscan.plot import _figure_height, _style_names, plot_destination, require_matplotlib

# Each fp8/fp4 target's (smallest subnormal, smallest normal, largest finite),
# from the one format table (zeroscan.headroom).
TARGET_FORMATS: dict[str, tuple[float, float, float]] = {
    name: (f.min_subnormal, f.min_normal, f.max_finite) for name, f in FORMATS.items()
}
FLUSHED_COLOR = "#bdbdbd"  # below the smallest subnormal: rounds to zero
SUBNORMAL_RANGE_COLOR = "#b2ebf2"  # subnormal: fewer significant bits
OVERFLOW_COLOR = "#ffcdd2"  # above the largest finite value: overflows to inf
LIMIT_COLOR = "#37474f"
TARGET_COLOR = "#d81b60"
MAX_FULL_RANGE = 320  # binades: a dtype's whole range is in view when it spans at most this (not float64's)
EDGE_BINS = (("0", "zeros"), ("sub", "subnormal")), (("+inf", "posinf"), ("-inf", "neginf"), ("NaN", "nan"))


def histogram_of_row(row: Mapping[str, Any]) -> Any:
    """The zeroscan.histogram.Histogram of one `zeroscan scan --histogram`
    JSON row (its "histogram", a Histogram.to_dict(), and its "dtype"; a
    complex tensor's is of its real and imaginary parts), so saved JSON can
    be plotted."""
    import torch

    from zeroscan.histogram import Histogram

    doc = row.get("histogram")
    if not isinstance(doc, Mapping):
        raise ValueError(f"histogram_of_row: row {row.get('name')!r} has no \"histogram\" (scan with --histogram)")
    dtype = getattr(torch, str(row.get("dtype")), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"histogram_of_row: row {row.get('name')!r} has dtype {row.get('dtype')!r}, not a torch dtype")
    return Histogram.from_dict(dtype.to_real(), doc)


def dtype_limits(dtype: Any) -> tuple[float, float, float]:
    """log2 of the dtype's (smallest subnormal, smallest normal, largest
    finite) |x|. An integer dtype's smallest nonzero |x| is 1, and its top
    is the end of its top binade (int8's -128 is in binade 7, [128, 256))."""
    import torch

    from zeroscan.histogram import layout_of

    if not dtype.is_floating_point:
        return 0.0, 0.0, float(layout_of(dtype).max_exponent + 1)
    info = torch.finfo(dtype)
    return math.log2(info.tiny * info.eps), math.log2(info.tiny), math.log2(info.max)


def _view(histograms: Sequence[Any], target: tuple[float, float, float] | None) -> tuple[int, int]:
    """The exponents drawn, [low, high): every occupied binade (a subnormal
    count: from the dtype's smallest subnormal), every dtype's whole range
    unless it is wider than MAX_FULL_RANGE, and the target's range."""
    points: list[float] = list(map(math.log2, target)) if target else []
    for h in histograms:
        sub, _, top = dtype_limits(h.dtype)
        occupied = h.exponents[h.counts > 0]
        if occupied.size:
            points += [float(occupied.min()), float(occupied.max()) + 1]
        if h.subnormal:
            points.append(sub)
        if top - sub <= MAX_FULL_RANGE:
            points += [sub, top]
    if not points:
        return -1, 1
    return math.floor(min(points)) - 1, math.ceil(max(points)) + 1


def _dtype_runs(histograms: Sequence[Any]) -> list[tuple[int, int, Any]]:
    """(first row, last row, dtype) of each run of consecutive rows of one dtype."""
    runs: list[tuple[int, int, Any]] = []
    for i, h in enumerate(histograms):
        if runs and runs[-1][2] == h.dtype:
            runs[-1] = (runs[-1][0], i, h.dtype)
        else:
            runs.append((i, i, h.dtype))
    return runs


def _mark_dtype_ranges(ax: Any, histograms: Sequence[Any], low: int, high: int) -> None:
    """Behind each run of rows of one dtype: its flush-to-zero, subnormal and
    overflow regions shaded, and its limits as vertical lines."""
    for first, last, dtype in _dtype_runs(histograms):
        sub, normal, top = dtype_limits(dtype)
        band = (first - 0.5, last - first + 1)
        for start, end, color in ((low, sub, FLUSHED_COLOR), (sub, normal, SUBNORMAL_RANGE_COLOR),
                                  (top, high, OVERFLOW_COLOR)):
            start, end = max(start, low), min(end, high)
            if end > start:
                ax.broken_barh([(start, end - start)], band, facecolors=color, zorder=0)
        limits = [x for x in sorted({sub, normal, top}) if low <= x <= high]
        ax.vlines(limits, band[0], band[0] + band[1], colors=LIMIT_COLOR, linewidth=1.0, zorder=3)


def _occupied(fractions: Any) -> Any:
    """The fractions with the empty bins (0, or NaN outside a dtype's range) masked: drawn as nothing."""
    import numpy as np

    return np.ma.masked_where(~(fractions > 0), fractions)


def _exponent_ticks(ax: Any, low: int, high: int) -> None:
    step = next(s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if (high - low) / s <= 16)
    ticks = [k for k in range(low, high + 1) if k % step == 0]
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"$2^{{{k}}}$" for k in ticks], fontsize=7)
    ax.set_xlim(low, high)
    ax.set_xlabel("|x| (binade 2^e ≤ |x| < 2^(e+1) drawn from e to e+1)", fontsize=8)


def plot_histograms(
    items: Sequence[tuple[str, Any]],
    path: str | os.PathLike[str],
    *,
    target: str | None = None,
    title: str = "",
    dpi: int = 110,
) -> str:
    """Draws log2-magnitude histograms (zeroscan.histogram.Histogram), one
    row per (name, histogram) of `items`, as a heat map: x is the binary
    exponent, colour the fraction of the tensor's elements in that binade
    (log scale; white: none), with zeros and subnormals in columns at the
    left and +inf, -inf and NaN at the right. Behind each row its dtype's
    range: the smallest subnormal, smallest normal and largest finite |x| as
    lines, the regions below (grey: rounds to zero; cyan: subnormal) and
    above (red: overflows) shaded. `target` ("e4m3", "e5m2" or "e2m1") adds
    that format's three limits as dashed lines, to see fp8/fp4 headroom.
    Returns the path written (`path`, with .png appended when it has no
    extension)."""
    Figure = require_matplotlib()
    import matplotlib
    import numpy as np
    from matplotlib.colors import LogNorm
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    from zeroscan.histogram import Histogram

    if target is not None and target not in TARGET_FORMATS:
        raise ValueError(f"plot_histograms: target must be one of {', '.join(TARGET_FORMATS)} or None, got {target!r}")
    items = list(items)
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Histogram)):
            raise TypeError(f"plot_histograms: items[{i}] must be a (name, Histogram) pair, got {item!r:.100}")
    target_at = TARGET_FORMATS[target] if target else None
    out, fmt = plot_destination(path)
    names = [f"{name} ({str(h.dtype).removeprefix('torch.')})" for name, h in items]
    histograms = [h for _, h in items]
    height = _figure_height(max(len(items), 1), 1)
    fig = Figure(figsize=(13, height), dpi=dpi, layout="constrained")
    fig.suptitle((title + " · " if title else "") + f"|x| by binade · {len(items)} tensors"
                 + (f" · {target} limits dashed" if target else ""), fontsize=11)
    if not items:
        fig.text(0.5, 0.5, "no tensors", ha="center", va="center")
        fig.savefig(out, format=fmt)
        return out
    left, main, right = fig.subplots(1, 3, sharey=True, gridspec_kw={"width_ratios": [0.7, 12, 1.0]})

    low, high = _view(histograms, target_at)
    grid = np.full((len(items), high - low), np.nan)
    edges = [np.full((len(items), len(bins)), np.nan) for bins in EDGE_BINS]
    for i, h in enumerate(histograms):
        if not h.numel:
            continue
        inside = (h.exponents >= low) & (h.exponents < high)
        grid[i, h.exponents[inside] - low] = h.counts[inside] / h.numel
        for edge, bins in zip(edges, EDGE_BINS):
            edge[i] = [getattr(h, attr) / h.numel for _, attr in bins]
    everything = np.concatenate([grid.ravel(), *(e.ravel() for e in edges)])
    positive = everything[everything > 0]
    norm = LogNorm(vmin=min(float(positive.min()), 0.1) if positive.size else 0.1, vmax=1.0)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad=(0, 0, 0, 0))
    image = main.imshow(_occupied(grid), aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
                        extent=(low, high, len(items) - 0.5, -0.5), zorder=2)
    _mark_dtype_ranges(main, histograms, low, high)
    if target_at:
        main.vlines([math.log2(v) for v in target_at], -0.5, len(items) - 0.5, colors=TARGET_COLOR,
                    linestyles="dashed", linewidth=1.4, zorder=4)
    _exponent_ticks(main, low, high)
    for ax, edge, bins in zip((left, right), edges, EDGE_BINS):
        ax.imshow(_occupied(edge), aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
                  extent=(-0.5, len(bins) - 0.5, len(items) - 0.5, -0.5))
        ax.set_xticks(range(len(bins)))
        ax.set_xticklabels([label for label, _ in bins], fontsize=7)
    _style_names(left, names, ["ok"] * len(names), height)
    fig.colorbar(image, ax=right, shrink=0.8, pad=0.02, label="fraction of the tensor's elements")
    handles = [Patch(color=FLUSHED_COLOR, label="below smallest subnormal (rounds to 0)"),
               Patch(color=SUBNORMAL_RANGE_COLOR, label="subnormal range"),
               Patch(color=OVERFLOW_COLOR, label="above largest finite (overflows)"),
               Line2D([], [], color=LIMIT_COLOR, label="dtype: smallest subnormal, normal, largest")]
    if target:
        handles.append(Line2D([], [], color=TARGET_COLOR, linestyle="dashed", label=f"{target}: same limits"))
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8, frameon=False)
    fig.savefig(out, format=fmt)
    return out
