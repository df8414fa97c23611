"""The Monitor's arguments, checked before anything is hooked (each error
names the argument and what was received, in one line), and what they make
of the model and the optimizer: `Setup`, and the NaN trace.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from zeroscan.inputs import received
from zeroscan.monitor.frameworks import Framework, gradient_source, recognize
from zeroscan.monitor.grad_histograms import check_histogram
from zeroscan.monitor.grad_source import GradSource
from zeroscan.monitor.hooks import Hooks
from zeroscan.monitor.nonfinite_trace import NonfiniteTrace
from zeroscan.monitor.optimizer import param_groups_holder
from zeroscan.monitor.ranks import RankExchange, check_group, default_group
from zeroscan.monitor.report import Finding, Thresholds
from zeroscan.monitor.step_record import Param, collect_params



def check_step_call(scans_at_optimizer_step: bool, loss: object) -> None:
    """Raises for a Monitor.step() call that must not be made, or a bad `loss`."""
    if scans_at_optimizer_step:
        raise RuntimeError(
            "zeroscan.Monitor.step: this Monitor already scans at every optimizer.step() "
            "(it was given an optimizer with auto=True); drop the manual step() call, "
            "or create the Monitor with auto=False"
        )
    if loss is not None and not isinstance(loss, torch.Tensor):
        raise TypeError(f"zeroscan.Monitor.step: loss must be a tensor or None, got {type(loss).__name__}")

class Setup(NamedTuple):
    """What a Monitor's arguments make of the model and the optimizer."""

    thresholds: Thresholds
    params: list[Param]  # the model's parameters, tied ones once (step_record.collect_params)
    framework: Framework | None  # DeepSpeed's, Megatron's: their own step, groups and gradients
    groups: Any  # the object whose param_groups' lrs are read; None without an optimizer
    source: GradSource  # where each gradient and weight is read (grad_source.py)
    ranks: RankExchange | None  # the exchange across the process group's ranks
    mesh_warning: Finding | None  # ranks.default_group's, about the group it chose
    histogram: bool


def set_up(
    op: str, model: object, optimizer: object, every: object, history: object, trace_nonfinite: object,
    thresholds: object, process_group: dist.ProcessGroup | None, histogram: object,
) -> Setup:
    """Checks the Monitor's arguments (raising for a bad one) and reads the
    model, the optimizer and the process group as the Monitor will use them."""
    checked = check_options(op, model, every, history, trace_nonfinite, thresholds)
    framework = recognize(optimizer)
    groups = None if optimizer is None else param_groups_holder(op, optimizer, framework)
    params = collect_params(model)  # type: ignore[arg-type]
    process_group, mesh_warning = default_group(process_group, params)
    group = check_group(op, process_group, params)
    histogram = check_histogram(op, histogram, group)
    ranks = None if group is None else RankExchange(group, params, checked.replica_rtol)
    source = gradient_source(op, framework, groups, params)
    return Setup(checked, params, framework, groups, source, ranks, mesh_warning, bool(histogram))


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


MAX_TRACED_STEPS = 1024  # with every > 1, steps the trace keeps at most (about 14 KiB each)


def nonfinite_trace(setup: Setup, model: nn.Module, hooks: Hooks, history: int, every: int) -> NonfiniteTrace:
    """The NaN trace of Monitor(trace_nonfinite=True): it keeps as many steps
    as the records span (every monitored step of `history`, and the steps
    between them), up to MAX_TRACED_STEPS; across ranks, where each was
    born travels with each step's merge."""
    trace = NonfiniteTrace(model, setup.params, hooks, min(history * every, max(history, MAX_TRACED_STEPS)))
    if setup.ranks is not None:
        trace.exchanging = True
        setup.ranks.born = trace.born_words
    return trace
