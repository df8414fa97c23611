"""Gradients that are zero in exact arithmetic by the model's structure.

Softmax gives the same result when its input moves by a shift shared along
the dimension it normalizes; a batch, instance, group or layer norm, when
the shift is shared by what it normalizes together (it subtracts their
mean). A parameter that only adds such a shift (the bias of a separate key
projection before softmax(q k^T), a convolution's bias right before a batch
or instance norm, a constant added to every logit of a row before
log_softmax) gets a gradient that is zero in exact arithmetic: what backward
computes is the rounding error of a sum that cancels, about the dtype's eps
times the size of its terms. The parameter's neighbours (the other
parameters of its module, whose gradients are built from the same incoming
gradient: the weight beside a bias) have gradients of the terms' size.

So a gradient counts as zero by structure when, at each of the latest
monitored steps, its root mean square is within NOISE_EPS times the dtype's
eps of its neighbours', and every way from it to the model's outputs goes
through a normalizing op in the probed forward pass's graph
(graph.normalizer_gates). Either alone misleads: by the numbers, a parameter
alone behind a tiny scale looks like noise, while a genuinely vanishing
gradient (behind a tiny scale, deep in a saturated stack) vanishes together
with its neighbours; by the graph, every parameter before a LayerNorm would
pass. The ways to the outputs are those of the model's own outputs: a
normalizing op in the loss (cross_entropy's log_softmax) is not seen, and
the gradient stays a vanishing one.
"""

from __future__ import annotations

import math
import statistics

import torch

from zeroscan.monitor.context import StepContext
from zeroscan.monitor.graph import COMPILED_GATE
from zeroscan.monitor.report import Finding
from zeroscan.monitor.series import Series
from zeroscan.monitor.step_record import Param, Slot
from zeroscan.words import dtype_name
from zeroscan.result_row import Row
from zeroscan.verdicts import Cause, Severity
from zeroscan.words import listed

NOISE_EPS = 256  # rounding noise: at most this many eps of the dtype times the neighbours' RMS
STABLE_STEPS = 3  # the latest monitored steps that must all say so
SOFTMAXES = ("softmax", "log_softmax", "scaled_dot_product_attention")


def neighbours(p: Param, params: list[Param]) -> list[Param]:
    """The parameters of p's module, else those of the modules inside it."""
    same = [q for q in params if q.owner == p.owner and q is not p]
    if same:
        return same
    prefix = f"{p.owner}." if p.owner else ""
    return [q for q in params if q is not p and q.name.startswith(prefix)]


def _rms(row: Row) -> float:
    n = int(row["numel"])
    return float(row["norm"]) / math.sqrt(n) if n else 0.0


def _why(kinds: frozenset[str]) -> str:
    said = []
    if kinds & set(SOFTMAXES):
        said.append(
            "softmax ignores a shift shared along the dimension it normalizes (the bias of a separate key "
            "projection, a constant added to every logit of a row)"
        )
    if kinds - set(SOFTMAXES) - {COMPILED_GATE}:
        said.append("a norm subtracts the mean of what it normalizes, and with it a shift they share (a bias "
                    "right before a batch or instance norm)")
    if COMPILED_GATE in kinds:
        said.append("torch.compile hides which op")
    return "; ".join(said)


def structural_zero(p: Param, params: list[Param], series: Series) -> Finding | None:
    """The finding for a gradient that is rounding noise by the model's
    structure (see the module doc), or None."""
    rec = series.records[-1]
    context = rec.context if isinstance(rec.context, StepContext) else None
    kinds = context.gates.get(p.name) if context is not None and context.gates is not None else None
    if not kinds or not p.tensor.dtype.is_floating_point:
        return None
    eps = torch.finfo(p.tensor.dtype).eps
    near = neighbours(p, params)
    ratios: list[float] = []
    for r in series.records[-STABLE_STEPS:]:
        own = r.row(Slot.grad(p.index))
        peers = [rms for q in near if (row := r.row(Slot.grad(q.index))) is not None and (rms := _rms(row)) > 0]
        if own is None or not peers:
            if r is rec:
                return None
            continue
        ratio = _rms(own) / statistics.median(peers)
        if not ratio <= NOISE_EPS * eps:
            return None
        ratios.append(ratio)
    ops = listed(sorted(kinds), 3)
    why = _why(kinds)
    dtype = dtype_name(p.tensor.dtype)
    steps = f"at each of the last {len(ratios)} monitored steps" if len(ratios) > 1 else "at the latest monitored step"
    nothing = "nothing to fix: the parameter neither trains nor needs to"
    peers = listed([q.name for q in near], 3)
    # The largest: a sum that cancels exactly at one step (a one-element shift) says 0 there.
    size = (
        f"its root mean square is at most {max(ratios):.2g} times its neighbours' ({peers}), about {dtype} eps "
        f"({eps:.2g})" if max(ratios) > 0 else f"it is exactly zero while its neighbours' ({peers}) are not"
    )
    return Finding(p.name, "grad", Severity.INFO, Cause.ZERO_BY_STRUCTURE, (
        f"the gradient of {p.name} is rounding noise, zero in exact arithmetic by the model's structure: "
        f"{size}, {steps}, and every way from it to the outputs goes through {ops}: {why}; {nothing}"
    ), root=(
        "these parameters' gradients are rounding noise, zero in exact arithmetic by the model's structure: "
        f"within {NOISE_EPS} times {dtype} eps of their neighbours' gradients, and every way from them to the "
        f"outputs goes through {ops}: {why}; {nothing}"
    ))
