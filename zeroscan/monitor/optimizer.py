"""What the Monitor reads of the optimizer: param groups and learning rates.

Each parameter's param group feeds the "not_in_optimizer" check and the
lr-0 hints (rules.OptimizerView); each monitored step records the learning
rate of every param group as the step runs with it (StepRecord.lrs), read
before optimizer.step() and the scheduler change it.
"""

from __future__ import annotations

import torch

from zeroscan.monitor.step_record import Param
from zeroscan.monitor.rules import OptimizerView


def optimizer_view(optimizer: torch.optim.Optimizer | None, params: list[Param]) -> OptimizerView:
    """Each parameter's (index) optimizer param group (its number); None
    without an optimizer."""
    if optimizer is None:
        return None
    by_id = {id(p.tensor): p.index for p in params}
    view: dict[int, int] = {}
    for number, group in enumerate(optimizer.param_groups):
        for t in group["params"]:
            i = by_id.get(id(t))
            if i is not None and i not in view:
                view[i] = number
    return view


def step_lrs(optimizer: torch.optim.Optimizer) -> tuple[object, ...]:
    """The learning rate of each param group, in order, as this step runs with it."""
    return tuple(step_lr(group.get("lr")) for group in optimizer.param_groups)


def step_lr(lr: object) -> object:
    """A param group's learning rate as this step runs with it: a tensor
    (capturable optimizers, which schedulers update in place) is copied on
    its device, not read."""
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else lr
