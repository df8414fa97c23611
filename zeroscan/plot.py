"""Pictures: per-layer gradient flow from a Monitor report, and a checkpoint scan.

``plot_report(report, path)`` draws, per parameter in model order, the
gradient norm, the zero %, the underflow % and the near-zero % side by side,
with the layers that have findings named in colour; when the report's history
holds more than one step, heat maps of the norm, zero % and underflow % over
the steps sit below. ``plot_scan(rows, path)`` draws the same kind of picture
for the tensors of a scanned checkpoint (``zeroscan scan --plot``).

Underflow % is the subnormal values' share, as everywhere in zeroscan (the
report's "subnormal_fraction", the loggers' "underflow_pct"); near-zero %
(0 < |x| <= tol, subnormals included: "near_zero_fraction") is a quantity of
its own, in its own panel, never added to it.

Both work on plain dicts (Report.to_dict() and the scan's JSON rows), so they
can be fed from saved JSON. matplotlib is optional: it is imported on the
first call, and its absence raises ImportError saying how to install it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from zeroscan.loggers import scanned_words
from zeroscan.report_data import report_dict
from zeroscan.safe_text import printable

SEVERITY_COLORS = {"error": "#c62828", "warning": "#ef6c00", "info": "#1565c0"}
SEVERITY_RANK = {"ok": 0, "info": 1, "warning": 2, "error": 3}
PLAIN_COLOR = "#607d8b"
ZERO_COLOR = "#6a1b9a"
SUBNORMAL_COLOR = "#00838f"
NEAR_ZERO_COLOR = "#80deea"
MISSING_COLOR = "#9e9e9e"
EXACT_ZERO_CELL = "#000000"  # heat-map cells whose gradient norm is exactly 0
MAX_LABELS = 160  # above this many layers, only every k-th name (and every problem layer) is written
# Underflow is the subnormal values, in every picture, scalar and report row; near-zero has its own panel.
UNDERFLOW_TITLE = "underflow % (subnormal)"


def require_matplotlib() -> Any:
    """matplotlib.figure.Figure, or ImportError with the install command."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no backend or global state is touched
    except ImportError:
        raise ImportError(
            "zeroscan's plots need matplotlib, which is not installed: pip install matplotlib"
        ) from None
    return Figure


def plot_formats() -> dict[str, str]:
    """The file formats matplotlib writes: extension -> description."""
    require_matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase

    return dict(FigureCanvasBase.get_supported_filetypes())


def plot_destination(path: str | os.PathLike[str]) -> tuple[str, str]:
    """(the file a plot to `path` is written to, its format), chosen as
    matplotlib's savefig chooses them: by the extension, and .png appended
    when there is none. ValueError, one line, for an extension matplotlib
    cannot write."""
    require_matplotlib()
    text = os.fspath(path)
    ext = os.path.splitext(text)[1][1:].lower()
    if not ext:
        return text.rstrip(".") + ".png", "png"
    formats = plot_formats()
    if ext not in formats:
        raise ValueError(
            f"{printable(text)}: matplotlib cannot write .{printable(ext)} files; "
            f"it writes {', '.join('.' + f for f in sorted(formats))}"
        )
    return text, ext


# --- small helpers -----------------------------------------------------------


def _num(v: object) -> float:
    """A float from a JSON value; None (a missing value) becomes NaN."""
    if v is None:
        return math.nan
    return float(v)  # type: ignore[arg-type]


def _spans_decades(values: Sequence[float], decades: float = 2.0) -> bool:
    pos = [v for v in values if v > 0 and math.isfinite(v)]
    return len(pos) >= 2 and math.log10(max(pos) / min(pos)) >= decades


def _label_every(n: int, height_in: float) -> int:
    """Write every k-th layer name so that names never overlap at 7pt."""
    fits = max(1, int(height_in * 72 / 9))
    return max(1, math.ceil(n / min(fits, MAX_LABELS)))


def _figure_height(n_layers: int, rows: int) -> float:
    per_row = min(max(2.2, 0.17 * n_layers + 1.0), 28.0)
    return per_row * rows + 0.8


def _style_names(ax: Any, names: Sequence[str], severities: Sequence[str], height_in: float) -> None:
    """Layer names on the y axis, top to bottom in model order, problems coloured and bold."""
    every = _label_every(len(names), height_in)
    problems = [i for i in range(len(names)) if severities[i] in SEVERITY_COLORS]
    ticks = sorted(
        set(problems)
        | {i for i in range(0, len(names), every) if every == 1 or all(abs(i - j) >= every for j in problems)}
    )
    ax.set_yticks(ticks)
    ax.set_yticklabels([_short(names[i]) for i in ticks], fontsize=7)
    for label, i in zip(ax.get_yticklabels(), ticks):
        color = SEVERITY_COLORS.get(severities[i])
        if color:
            label.set_color(color)
            label.set_fontweight("bold")
    ax.set_ylim(len(names) - 0.5, -0.5)
    if len(names) > 40:  # a tall chart: repeat the value axis on top
        for shared in ax.get_shared_y_axes().get_siblings(ax):
            shared.tick_params(axis="x", top=True, labeltop=True)


def _short(name: str, limit: int = 48) -> str:
    short = name if len(name) <= limit else "…" + name[-(limit - 1) :]
    return printable(short)  # a newline or bidi override in a file's tensor name would garble the axis


def _bar_colors(severities: Sequence[str], plain: str) -> list[str]:
    return [SEVERITY_COLORS.get(s, plain) for s in severities]


def _percent_axis(ax: Any, values: Sequence[float], title: str) -> None:
    """0-100 % linear, or log when every value is small (< 20 %) and they span decades."""
    ax.set_title(title, fontsize=9)
    pos = [v for v in values if v > 0 and math.isfinite(v)]
    if pos and _spans_decades(pos) and max(pos) < 20.0:
        ax.set_xscale("log")
        ax.set_xlim(min(pos) / 3, 100 * 1.5)
    else:
        ax.set_xlim(0, 100)
    ax.grid(axis="x", alpha=0.3)
    if not pos:
        ax.text(0.5, 0.5, "none", ha="center", va="center", transform=ax.transAxes, fontsize=9, color=PLAIN_COLOR)


def _legend(fig: Any, present: set[str], extra: Sequence[tuple[str, str]] = ()) -> None:
    from matplotlib.patches import Patch

    handles = [
        Patch(color=SEVERITY_COLORS[s], label=f"{s} finding") for s in ("error", "warning", "info") if s in present
    ]
    handles += [Patch(color=color, label=label) for color, label in extra]
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 5), fontsize=8, frameon=False)


# --- the Monitor's report --------------------------------------------------------


def plot_report(report: object, path: str | os.PathLike[str], *, dpi: int = 110) -> str:
    """Draws the gradient flow of a Monitor report (a Report or its to_dict())
    to `path` (any format matplotlib writes: .png, .svg, .pdf; .png appended
    when it has no extension) and returns the path written."""
    Figure = require_matplotlib()
    target, fmt = plot_destination(path)
    data = report_dict(report)
    tensors = list(data.get("tensors", []))
    # Every parameter in model order; one with a weight row but no gradient
    # row is drawn as "no gradient" (frozen, detached, unused).
    kind = "grad" if any(t.get("kind") == "grad" for t in tensors) else "weight"
    params = [t for t in tensors if t.get("kind") in ("grad", "weight")] or tensors
    names = list(dict.fromkeys(str(t["name"]) for t in params))
    by_name = {str(t["name"]): t for t in params if t.get("kind", kind) == kind or kind not in ("grad", "weight")}
    grads = [by_name.get(n, {"name": n}) for n in names]
    history = data.get("history") or {}
    steps = list(history.get("steps") or [])
    with_history = len(steps) > 1 and bool(history.get("names"))

    worst: dict[str, str] = {}
    for f in data.get("findings", []):
        name, sev = str(f.get("name", "")), str(f.get("severity", "info")).lower()
        if SEVERITY_RANK.get(sev, 0) > SEVERITY_RANK.get(worst.get(name, "ok"), 0):
            worst[name] = sev
    severities = [worst.get(n, "ok") for n in names]

    rows = 2 if with_history else 1
    n_layers = max(len(names), len(history.get("names") or []), 1)
    height = _figure_height(n_layers, rows)
    fig = Figure(figsize=(13, height), dpi=dpi, layout="constrained")
    axes = fig.subplots(rows, 4, squeeze=False, sharey="row")
    what = "gradient" if kind == "grad" else "weight"
    n_findings = len(data.get("findings", []))
    step = data.get("step")
    fig.suptitle(
        f"zeroscan · {what} flow at step {step} · {scanned_words(tensors)} scanned · "
        f"{n_findings} finding{'s' if n_findings != 1 else ''}",
        fontsize=11,
    )

    if names:
        _report_bars(axes[0], grads, names, severities, height / rows, what)
    else:
        for ax in axes[0]:
            ax.text(0.5, 0.5, "no tensors in this report", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
    extra = [(SUBNORMAL_COLOR, "underflow (subnormal)"), (NEAR_ZERO_COLOR, "near zero"), (MISSING_COLOR, "no gradient")]
    if with_history:
        axes[1][3].set_axis_off()  # the history keeps no near-zero share
        if _report_heatmaps(fig, axes[1][:3], history, names, worst, height / rows):
            extra.append((EXACT_ZERO_CELL, "norm exactly 0 (heat map)"))
    _legend(fig, set(severities), extra)
    fig.savefig(target, format=fmt)
    return target


def _report_bars(
    axes: Sequence[Any],
    grads: Sequence[Mapping[str, Any]],
    names: list[str],
    severities: list[str],
    height: float,
    what: str,
) -> None:
    y = list(range(len(names)))
    norms = [_num(t.get("norm")) for t in grads]
    zero_pct = [100.0 * _num(t.get("zero_fraction")) for t in grads]
    sub_pct = [100.0 * _num(t.get("subnormal_fraction")) for t in grads]
    near_pct = [100.0 * _num(t.get("near_zero_fraction")) for t in grads]
    nonfinite = [int(t.get("nan") or 0) + int(t.get("inf") or 0) for t in grads]

    ax = axes[0]
    pos = [v for v in norms if v > 0 and math.isfinite(v)]
    log = _spans_decades(pos)
    floor = (min(pos) / 10 if log else 0.0) if pos else 0.0
    widths = [v if v > 0 and math.isfinite(v) else 0.0 for v in norms]
    ax.barh(y, widths, left=floor if log else 0.0, color=_bar_colors(severities, PLAIN_COLOR), height=0.75)
    if log:
        ax.set_xscale("log")
        ax.set_xlim(floor, max(pos) * 3)
    ax.set_title(f"{what} norm" + (" (log)" if log else ""), fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    x_note = floor if log else 0.0
    for i, (v, bad) in enumerate(zip(norms, nonfinite)):
        note = None
        if bad:
            note = "NaN/Inf"
        elif math.isnan(v):
            note = "no gradient"
        elif v == 0:
            note = "exactly 0"
        if note:
            color = SEVERITY_COLORS["error"] if bad else (MISSING_COLOR if note == "no gradient" else ZERO_COLOR)
            ax.text(x_note, i, f" {note}", va="center", ha="left", fontsize=7, color=color, fontweight="bold")
    _style_names(ax, names, severities, height)

    ax = axes[1]
    finite_zero_pct = [v if math.isfinite(v) else 0.0 for v in zero_pct]
    ax.barh(y, finite_zero_pct, color=_bar_colors(severities, ZERO_COLOR), height=0.75)
    _percent_axis(ax, zero_pct, "exact zeros %")

    ax = axes[2]
    ax.barh(y, [v if math.isfinite(v) else 0.0 for v in sub_pct], color=SUBNORMAL_COLOR, height=0.75)
    _percent_axis(ax, sub_pct, UNDERFLOW_TITLE)

    ax = axes[3]
    ax.barh(y, [v if math.isfinite(v) else 0.0 for v in near_pct], color=NEAR_ZERO_COLOR, height=0.75)
    _percent_axis(ax, near_pct, "near zero % (0 < |x| ≤ eps)")


def _report_heatmaps(
    fig: Any, axes: Sequence[Any], history: Mapping[str, Any], order: list[str], worst: dict[str, str], height: float
) -> bool:
    """Heat maps over steps; rows follow `order` (the bar chart's), then any
    name only the history holds; a name without a column is drawn missing.
    Returns whether a gradient norm of exactly 0 was drawn."""
    zero_norms = False
    import matplotlib
    import numpy as np
    from matplotlib.colors import LogNorm, Normalize

    columns = {str(n): i for i, n in enumerate(history["names"])}
    names = list(dict.fromkeys(list(order) + list(columns)))
    row_of = {n: i for i, n in enumerate(names)}
    steps = list(history["steps"])
    severities = [worst.get(n, "ok") for n in names]
    panels = (
        ("grad_norm", "gradient norm over steps", 1.0, "viridis"),
        ("zero_fraction", "exact zeros % over steps", 100.0, "magma_r"),
        ("subnormal_fraction", "underflow % (subnormal) over steps", 100.0, "magma_r"),
    )
    for ax, (key, title, scale, cmap_name) in zip(axes, panels):
        grid = np.full((len(names), len(steps)), np.nan)
        # A report saved before the history's key was renamed has "underflow_fraction".
        series = history.get(key) or (history.get("underflow_fraction") if key == "subnormal_fraction" else None)
        for j, row in enumerate(series or []):
            for name, k in columns.items():
                if k < len(row):
                    grid[row_of[name], j] = _num(row[k]) * scale
        masked = np.ma.masked_invalid(grid)
        pos = grid[np.isfinite(grid) & (grid > 0)]
        cmap = matplotlib.colormaps[cmap_name].with_extremes(bad=MISSING_COLOR)
        if key == "grad_norm" and pos.size and _spans_decades(list(pos)):
            vmin = float(pos.min())
            norm: Any = LogNorm(vmin=vmin, vmax=float(pos.max()))
            masked = np.ma.masked_invalid(np.where(grid == 0, vmin / 10, grid))
            cmap = cmap.with_extremes(under=EXACT_ZERO_CELL)  # a norm of exactly 0 cannot sit on a log scale
            zero_norms = bool((grid == 0).any())
            title += " (log)"
        elif scale == 100.0:  # percentages: one fixed scale, so 5 % never looks like 100 %
            norm = Normalize(vmin=0.0, vmax=100.0)
        else:
            finite = grid[np.isfinite(grid)]
            hi = float(finite.max()) if finite.size else 1.0
            norm = Normalize(vmin=0.0, vmax=hi if hi > 0 else 1.0)
        image = ax.imshow(masked, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
        ax.set_title(title, fontsize=9)
        every = max(1, math.ceil(len(steps) / 12))
        xt = list(range(0, len(steps), every))
        ax.set_xticks(xt)
        ax.set_xticklabels([str(steps[k]) for k in xt], fontsize=7)
        ax.set_xlabel("step", fontsize=8)
        fig.colorbar(image, ax=ax, shrink=0.8, pad=0.01)
    _style_names(axes[0], names, severities, height)
    return zero_norms


# --- a checkpoint scan -------------------------------------------------------------


def plot_scan(
    rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str], *, title: str = "", dpi: int = 110
) -> str:
    """Draws a checkpoint scan (the JSON rows of `zeroscan scan`, in file
    order): zero %, underflow %, near-zero % and the |x| range per tensor,
    with tensors that have findings named in colour. Returns the path
    written (`path`, with .png appended when it has no extension)."""
    Figure = require_matplotlib()
    target, fmt = plot_destination(path)
    rows = list(rows)
    names = [str(r["name"]) for r in rows]
    severities = [str(r.get("severity", "ok")) for r in rows]
    height = _figure_height(max(len(rows), 1), 1)
    fig = Figure(figsize=(13, height), dpi=dpi, layout="constrained")
    axes = fig.subplots(1, 4, squeeze=False, sharey="row")[0]
    n_findings = sum(1 for s in severities if s in SEVERITY_COLORS)
    fig.suptitle(
        (title + " · " if title else "") + f"{len(rows)} tensors · {n_findings} with findings", fontsize=11
    )
    if not rows:
        for ax in axes:
            ax.text(0.5, 0.5, "no tensors", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
        fig.savefig(target, format=fmt)
        return target

    y = list(range(len(rows)))
    numel = [max(int(r.get("numel") or 0), 1) for r in rows]
    zero_pct = [100.0 * int(r.get("zeros") or 0) / n for r, n in zip(rows, numel)]
    sub_pct = [100.0 * int(r.get("subnormal") or 0) / n for r, n in zip(rows, numel)]
    near_pct = [100.0 * int(r.get("near_zero") or 0) / n for r, n in zip(rows, numel)]

    ax = axes[0]
    ax.barh(y, zero_pct, color=_bar_colors(severities, ZERO_COLOR), height=0.75)
    _percent_axis(ax, zero_pct, "exact zeros %")
    _style_names(ax, names, severities, height)

    ax = axes[1]
    ax.barh(y, sub_pct, color=SUBNORMAL_COLOR, height=0.75)
    _percent_axis(ax, sub_pct, UNDERFLOW_TITLE)

    ax = axes[2]
    ax.barh(y, near_pct, color=NEAR_ZERO_COLOR, height=0.75)
    _percent_axis(ax, near_pct, "near zero % (0 < |x| ≤ tol)")

    ax = axes[3]
    lows = [_num(r.get("min_abs_nonzero")) for r in rows]
    highs = [_num(r.get("max_abs")) for r in rows]
    finite = [v for v in lows + highs if v > 0 and math.isfinite(v)]
    lo = min(finite) / 10 if finite else 1e-8
    hi = max(finite) * 10 if finite else 1.0
    ax.set_xscale("log")
    ax.set_xlim(lo, hi)
    for i, (r, a, b) in enumerate(zip(rows, lows, highs)):
        bad = int(r.get("nan") or 0) + int(r.get("posinf") or 0) + int(r.get("neginf") or 0)
        color = SEVERITY_COLORS.get(severities[i], PLAIN_COLOR)
        if math.isfinite(a) and math.isfinite(b) and 0 < a < b:
            ax.plot([a, b], [i, i], color=color, linewidth=3, solid_capstyle="butt")
        elif math.isfinite(a) and a > 0:  # one magnitude (a constant, or one finite value)
            ax.plot([a], [i], "o", color=color, markersize=4)
        if bad:
            ax.text(lo, i, " NaN/Inf", va="center", ha="left", fontsize=7, color=SEVERITY_COLORS["error"],
                    fontweight="bold")
        elif not (a > 0 and math.isfinite(a)) and int(r.get("numel") or 0):
            ax.text(lo, i, " all zero", va="center", ha="left", fontsize=7, color=ZERO_COLOR, fontweight="bold")
    ax.set_title("|x| range (smallest non-zero … largest, log)", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    _legend(fig, set(severities), [(SUBNORMAL_COLOR, "underflow (subnormal)"), (NEAR_ZERO_COLOR, "near zero")])
    fig.savefig(target, format=fmt)
    return target
