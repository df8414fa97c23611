"""Gradients of float32 parameters that underflowed in float16.

Under torch.autocast(dtype=torch.float16) matmuls and convolutions run in
float16, and so do their backward ops: an activation gradient below
float16's smallest subnormal (about 6e-8) becomes exactly zero on its way
to a float32 parameter, whose gradient then holds exact zeros that look
like a mask. A GradScaler multiplies the loss so that they do not underflow;
bfloat16 has float32's range and does not underflow so.

What the Monitor sees of it, without a second backward pass (context.py):
the step's forward pass ran under float16 autocast, or the probe saw the
parameter enter an op that gave a float16 result; no GradScaler that scales
ran the optimizer step; and the gradient is mostly or entirely exactly zero,
its nonzero entries (if any) below float16's smallest normal number, where
a scaled re-run would have found values that float16 can hold.
"""

from __future__ import annotations

import torch

from zeroscan.monitor.context import StepContext
from zeroscan.monitor.report import Finding, Thresholds
from zeroscan.monitor.step_record import Param
from zeroscan.words import dtype_name
from zeroscan.result_row import Row
from zeroscan.verdicts import Cause, Severity

FP16_SMALLEST_NORMAL = torch.finfo(torch.float16).tiny  # 2**-14, about 6.1e-5
FIX = (
    "Scale the loss with torch.amp.GradScaler (scaler.scale(loss).backward(), then scaler.step(optimizer) "
    "and scaler.update()), or autocast to torch.bfloat16, which has float32's range"
)


def _scaler_words(context: StepContext) -> str:
    if context.scaler == "disabled":
        return "the GradScaler that runs the optimizer step was created with enabled=False, so it scales nothing"
    if context.scaler == "none":
        return "no GradScaler ran the optimizer step"
    return "zeroscan saw no GradScaler run the optimizer step (it sees one that calls optimizer.step())"


def _how_half(p: Param, context: StepContext) -> tuple[str, str] | None:
    """How `p` went through float16 at the step: (about it, about all such), or
    None. Where the probe saw which parameters entered float16 ops, only
    those did: under autocast a norm's or an embedding's weight stays float32."""
    if context.half is not None and p.name not in context.half:
        return None
    if context.autocast == torch.float16:
        words = "the forward pass ran under torch.autocast(dtype=torch.float16)"
        return words, words
    where = context.half.get(p.name) if context.half is not None else None
    if where is None:
        return None
    at = f"in {where}" if where else "in the model's forward"
    return (
        f"{p.name} entered float16 ops {at} (a torch.autocast(dtype=torch.float16) region there, or a .half())",
        "they entered float16 ops in the forward pass (a torch.autocast(dtype=torch.float16) region, or a .half())",
    )


def fp16_underflow(p: Param, g: Row, context: object, th: Thresholds, lasting: bool = True) -> Finding | None:
    """The finding for a float32 (or float64) parameter's gradient that
    underflowed in float16 (see the module doc), or None. A gradient zero
    everywhere that has not lasted (`lasting`) is INFO: a parameter that
    starts at zero by design (LoRA's A while B = 0) is zero at its first step."""
    if not isinstance(context, StepContext) or context.scaler == "enabled":
        return None
    if p.embedding or p.tensor.dtype not in (torch.float32, torch.float64):
        # An embedding's rows are zero where a batch has no token of theirs; 16-bit
        # parameters' own gradients show their underflow (rules.py).
        return None
    how = _how_half(p, context)
    n, zeros = int(g["numel"]), int(g["zeros"])
    if how is None or n == 0 or zeros < th.mostly_zero * n:
        return None
    smallest = float(g["min_abs_nonzero"])
    if zeros < n and not smallest < FP16_SMALLEST_NORMAL:
        return None
    tiny = "" if zeros == n else (
        f", and its nonzero entries are as small as {smallest:.2g}, below float16's smallest normal number "
        f"({FP16_SMALLEST_NORMAL:.2g})"
    )
    scaler = _scaler_words(context)
    dtype = dtype_name(p.tensor.dtype)
    severity, design = (Severity.WARNING, "") if lasting else (Severity.INFO, (
        " (unless the parameter starts at zero by design, as LoRA's A does while B = 0: a warning if it lasts)"
    ))
    if context.scaler is None:  # the step ran outside optimizer.step() (auto=False): a scaler is not known
        severity = Severity.INFO
    return Finding(p.name, "grad", severity, Cause.UNDERFLOW, (
        f"{100 * zeros / n:.3g}% of the gradient entries of {p.name} are exactly zero{tiny}, while {how[0]} and "
        f"{scaler}: the gradient underflowed to zero in float16 on its way to the {dtype} parameter{design}. {FIX}"
    ), root=(
        f"these parameters' gradients are mostly or entirely exactly zero while {how[1]} and {scaler}: they "
        f"underflowed to zero in float16 on their way to the parameters{design}. {FIX}"
    ))
