"""The Monitor's plain arguments, checked before anything is hooked: each
error names the argument and what was received, in one line."""

from __future__ import annotations

from torch import nn

from zeroscan.inputs import received
from zeroscan.monitor.report import Thresholds


def check_options(
    op: str, model: object, every: object, history: object, trace_nonfinite: object, thresholds: object
) -> Thresholds:
    """Raises for a bad argument; the thresholds to judge with."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{op}: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"{op}: every must be an int >= 1, got {received(every)}")
    if isinstance(history, bool) or not isinstance(history, int) or history < 2:
        raise ValueError(f"{op}: history must be an int >= 2, got {received(history)}")
    if not isinstance(trace_nonfinite, bool):
        raise TypeError(f"{op}: trace_nonfinite must be True or False, got {received(trace_nonfinite)}")
    if thresholds is not None and not isinstance(thresholds, Thresholds):
        raise TypeError(f"{op}: thresholds must be a zeroscan.Thresholds, got {type(thresholds).__name__}")
    return thresholds or Thresholds()
