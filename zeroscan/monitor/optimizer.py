"""What the Monitor reads of the optimizer: which object it is, its param
groups and learning rates.

The optimizer a training loop steps is often a wrapper of the one that
updates the weights: a Lookahead that never ran Optimizer.__init__ (so it
has no step hooks), a framework's wrapper, a research codebase's class that
only duck-types step() and param_groups. `wrapped_chain` finds what such a
wrapper holds, under the attribute names wrappers use (INNER_ATTRIBUTES:
extend it for a new family of wrappers); `param_groups_holder` picks the
object whose param groups the Monitor reads, and optimizer_hook.py the one
whose step it scans at.

Each parameter's param group feeds the "not_in_optimizer" check and the
lr-0 hints (OptimizerView); each monitored step records the learning
rate of every param group as the step runs with it (StepRecord.lrs), read
before optimizer.step() and the scheduler change it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zeroscan.monitor.frameworks import Framework
from zeroscan.monitor.step_record import Param

# What the optimizer holds: each parameter's (index) param group, by its
# number in optimizer.param_groups (StepRecord.lrs holds each group's learning
# rate at that step); None for a Monitor without an optimizer.
OptimizerView = dict[int, int] | None

# Where wrappers keep the optimizer they wrap: Accelerate's AcceleratedOptimizer and
# most research wrappers (.optimizer), timm's Lookahead (.base_optimizer, newer
# ._base_optimizer), ZeroRedundancyOptimizer (.optim, its rank's local optimizer).
INNER_ATTRIBUTES = ("optimizer", "base_optimizer", "_base_optimizer", "optim", "_optimizer", "inner_optimizer")
MAX_WRAPPERS = 8  # how deep wrappers are followed (a cycle of wrappers ends too)


def wrapped_chain(optimizer: object) -> list[object]:
    """`optimizer` and what it wraps, outermost first: each next object is
    the first of INNER_ATTRIBUTES of the one before that holds something
    with a step()."""
    chain = [optimizer]
    while len(chain) < MAX_WRAPPERS:
        inner = None
        for name in INNER_ATTRIBUTES:
            held = _attribute(chain[-1], name)
            if held is not None and callable(_attribute(held, "step")) and all(held is not c for c in chain):
                inner = held
                break
        if inner is None:
            break
        chain.append(inner)
    return chain


def param_groups_of(optimizer: object) -> list[Mapping[str, Any]] | None:
    """The object's param groups (a sequence of dicts, each with "params"),
    or None where it holds no such thing."""
    groups = _attribute(optimizer, "param_groups")
    if not isinstance(groups, Sequence) or isinstance(groups, (str, bytes)):
        return None
    if not all(isinstance(g, Mapping) and "params" in g for g in groups):
        return None
    return list(groups)


def param_groups_holder(op: str, optimizer: object, framework: Framework | None = None) -> object:
    """The object whose param groups the Monitor reads: a framework's view
    of its model parameters (frameworks.py), else the outermost of
    `optimizer` and what it wraps that has them (a ZeroRedundancyOptimizer's
    hold every parameter, its local optimizer's only its rank's shard; a
    Lookahead's are its base optimizer's). Raises, in one line, where none
    has them or `optimizer` is nothing like an optimizer."""
    if framework is not None:
        return framework.groups
    if not isinstance(optimizer, torch.optim.Optimizer) and not callable(_attribute(optimizer, "step")):
        raise TypeError(
            f"{op}: optimizer must be a torch.optim.Optimizer (or a wrapper of one, with step() and "
            f"param_groups) or None, got {type(optimizer).__name__}"
        )
    chain = wrapped_chain(optimizer)
    for candidate in chain:
        if param_groups_of(candidate) is not None:
            return candidate
    where = " or ".join(f".{name}" for name in INNER_ATTRIBUTES[:3])
    raise TypeError(
        f"{op}: optimizer {type(optimizer).__name__} has no param_groups (a list of dicts with 'params'), "
        f"nor does an optimizer it holds ({where}); pass the torch.optim.Optimizer that updates the weights"
    )


def _attribute(obj: object, name: str) -> Any:
    """getattr that takes a property which raises (a wrapper not fully set up) for absent."""
    try:
        return getattr(obj, name, None)
    except Exception:  # a user's property may raise anything: it only means "not here"
        return None


def optimizer_view(optimizer: object | None, params: list[Param]) -> OptimizerView:
    """Each parameter's (index) optimizer param group (its number); None
    without an optimizer. `optimizer`: the param_groups_holder."""
    if optimizer is None:
        return None
    by_id = {id(p.tensor): p.index for p in params}
    view: dict[int, int] = {}
    for number, group in enumerate(param_groups_of(optimizer) or ()):
        for t in group["params"]:
            i = by_id.get(id(t))
            if i is not None and i not in view:
                view[i] = number
    return view


def groups_fingerprint(optimizer: object) -> tuple[tuple[int, int, int], ...]:
    """What changes when a parameter joins or leaves a param group: each
    group's identity, its list of parameters' identity and length. One
    tuple per group, so a step pays for the groups, not the parameters.
    (A parameter replaced in place in a group's list, keeping its length,
    goes unseen.)"""
    out = []
    for group in param_groups_of(optimizer) or ():
        members = group["params"]
        out.append((id(group), id(members), len(members) if isinstance(members, Sequence) else -1))
    return tuple(out)


def step_lrs(optimizer: object) -> tuple[object, ...]:
    """The learning rate of each param group, in order, as this step runs
    with it. `optimizer`: the param_groups_holder."""
    return tuple(step_lr(group.get("lr")) for group in param_groups_of(optimizer) or ())


def step_lr(lr: object) -> object:
    """A param group's learning rate as this step runs with it: a tensor
    (capturable optimizers, which schedulers update in place) is copied on
    its device, not read."""
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else lr
