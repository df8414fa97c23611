"""The rules over a window of monitored steps: a gradient norm that keeps
falling (norm_drift), and a gradient's exact-zero fraction that keeps rising
(zero_fraction_rising). Pure functions of the records, as rules.py's."""

from __future__ import annotations

import math

import numpy as np

from zeroscan.monitor.report import GLOBAL_NAME, Finding, Thresholds
from zeroscan.monitor.series import Series
from zeroscan.monitor.step_record import Param
from zeroscan.verdicts import Cause, Severity


def history_findings(params: list[Param], series: Series, th: Thresholds) -> list[tuple[int, Finding]]:
    """(parameter index, finding) for what only the last `th.drift_window`
    monitored steps together show: gradient norms drifting to zero, rising
    zero fractions; nothing until that many steps are recorded."""
    window = series.records[-th.drift_window:]
    if len(window) < th.drift_window:
        return []
    out: list[tuple[int, Finding]] = []
    recent = Series(window, len(params))
    norms = recent.grad_norms()  # [W, P], NaN where a gradient is missing
    totals: list[float] = []
    for per in norms.tolist():
        total = 0.0
        for v in per:  # in parameter order, as a running sum: the same float as always
            if v == v:
                total += v * v
        totals.append(math.sqrt(total))
    steps = f"{window[0].step}..{window[-1].step}"
    if _drifts(totals, th.drift_factor):
        out.append((-1, Finding(GLOBAL_NAME, "grad", Severity.WARNING, Cause.NORM_DRIFT, (
            f"the total gradient norm fell from {totals[0]:.3g} to {totals[-1]:.3g} over monitored "
            f"steps {steps}, falling almost every step: training is stalling (aggressive clipping, "
            "a decaying scale or learning signal); if the loss is not improving, loosen the clipping"
        ))))
    else:
        for i in np.flatnonzero(_drifting(norms, th.drift_factor)).tolist():
            first, last = float(norms[0, i]), float(norms[-1, i])
            out.append((i, Finding(params[i].name, "grad", Severity.WARNING, Cause.NORM_DRIFT, (
                f"the gradient norm of {params[i].name} fell from {first:.3g} to {last:.3g} over "
                f"monitored steps {steps}, falling almost every step"
            ))))
    fractions, valid = recent.zero_fractions()
    embedding = np.array([p.embedding for p in params], dtype=bool)
    for i in np.flatnonzero(valid.all(axis=0) & ~embedding & _rising(fractions)).tolist():
        first, last = float(fractions[0, i]), float(fractions[-1, i])
        out.append((i, Finding(params[i].name, "grad", Severity.WARNING, Cause.ZERO_FRACTION_RISING, (
            f"the exact-zero fraction of the gradient of {params[i].name} rose from {100 * first:.3g}% "
            f"to {100 * last:.3g}% over monitored steps {steps}: units are dying "
            "(ReLU) or a mask is closing"
        ))))
    return out


def _drifting(norms: np.ndarray, factor: float) -> np.ndarray:
    """_drifts for every column of float64 [W, P] at once: bool [P]."""
    with np.errstate(all="ignore"):
        usable = (np.isfinite(norms) & (norms > 0)).all(axis=0)
        falls = (norms[1:] < norms[:-1]).sum(axis=0)
        return usable & (falls >= 0.9 * (len(norms) - 1)) & (norms[0] / norms[-1] >= factor)


def _rising(fractions: np.ndarray) -> np.ndarray:
    """_rises for every column of float64 [W, P] at once: bool [P]."""
    ups = (fractions[1:] >= fractions[:-1]).sum(axis=0)
    last = fractions[-1]
    return (last >= 0.5) & (last - fractions[0] >= 0.25) & (ups >= 0.8 * (len(fractions) - 1))


def _drifts(series: list[float], factor: float) -> bool:
    if len(series) < 2 or not all(math.isfinite(v) and v > 0 for v in series):
        return False
    falls = sum(1 for a, b in zip(series, series[1:]) if b < a)
    return falls >= 0.9 * (len(series) - 1) and series[0] / series[-1] >= factor
