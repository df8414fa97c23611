"""Trainable state that a model does not register: tensors that require
grad and that neither model.parameters() nor an optimizer ever sees.

Only leaf tensors count: a tensor with a grad_fn is an activation that
forward cached on the module (an attention map, an auxiliary loss, a dict
of features filled by hooks), not state to train. nn.Module's own
attributes (its _parameters, _buffers and _modules dicts, its hook dicts)
are never looked into as the user's containers.
"""

from __future__ import annotations

import torch
from torch import nn

from zeroscan.monitor.labels import module_label
from zeroscan.monitor.report import Finding
from zeroscan.verdicts import Cause, Severity
from zeroscan.words import listed

# An nn.Module's own attributes, and the instance __getstate__ that hooks.py may add.
MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"__getstate__"}


def trainable_leaf(value: object) -> bool:
    """A tensor that requires grad and is a leaf of the autograd graph (state, not an activation)."""
    return isinstance(value, torch.Tensor) and value.requires_grad and value.grad_fn is None


def unregistered_state(model: nn.Module) -> list[Finding]:
    """Trainable state that `model` does not register, so that neither
    model.parameters() nor an optimizer ever sees it: tensors that require
    grad kept as plain attributes or buffers, and modules or parameters kept
    in Python lists, tuples or dicts where nn.ModuleList, nn.ParameterList,
    nn.ModuleDict or nn.ParameterDict was meant."""
    registered = {id(p) for p in model.parameters()}
    modules = {id(m) for m in model.modules()}
    out: list[Finding] = []
    for mod_name, module in model.named_modules():
        owner = module_label(model, mod_name)
        for attr, value in vars(module).items():
            if attr in MODULE_INTERNALS:
                continue
            name = f"{mod_name}.{attr}" if mod_name else attr
            if trainable_leaf(value) and not isinstance(value, nn.Parameter):
                out.append(Finding(name, "param", Severity.WARNING, Cause.PLAIN_ATTRIBUTE, (
                    f"{name} requires grad but is a plain tensor attribute of {owner}, "
                    "not an nn.Parameter: model.parameters(), the optimizer and state_dict() never see it, "
                    f"so it is never trained; wrap it: self.{attr} = nn.Parameter(...)"
                )))
            elif isinstance(value, (list, tuple, dict)):
                out += _unregistered_in_container(name, owner, value, registered, modules)
        for attr, value in module._buffers.items():
            if trainable_leaf(value):
                name = f"{mod_name}.{attr}" if mod_name else attr
                out.append(Finding(name, "param", Severity.WARNING, Cause.PLAIN_ATTRIBUTE, (
                    f"{name} requires grad but is registered as a buffer, not an nn.Parameter: "
                    "the optimizer never sees it; use nn.Parameter"
                )))
    return out


def _unregistered_in_container(
    name: str, owner: str, value: list | tuple | dict, registered: set[int], modules: set[int]
) -> list[Finding]:
    """The trainable modules and parameters inside one plain container
    attribute that the model does not register."""
    items = value.items() if isinstance(value, dict) else enumerate(value)
    kind = "dict" if isinstance(value, dict) else type(value).__name__
    found: list[str] = []
    module_like = False
    for key, item in items:
        if isinstance(item, nn.Module):
            trainable = [p for p in item.parameters() if p.requires_grad]
            if id(item) not in modules and trainable and not any(id(p) in registered for p in trainable):
                found.append(f"{name}[{key!r}]")
                module_like = True
        elif trainable_leaf(item) and id(item) not in registered:
            found.append(f"{name}[{key!r}]")
    if not found:
        return []
    if module_like:
        fix = "nn.ModuleDict" if kind == "dict" else "nn.ModuleList"
        what = "modules"
    else:
        fix = "nn.ParameterDict" if kind == "dict" else "nn.ParameterList"
        what = "parameters"
    return [Finding(name, "param", Severity.WARNING, Cause.PLAIN_ATTRIBUTE, (
        f"{name} is a plain Python {kind} on {owner} holding trainable {what} ({listed(found, 10)}): nn.Module does not "
        f"look inside a {kind}, so model.parameters(), the optimizer, state_dict() and .to(device) never "
        f"see them, and they never train; use {fix}"
    ))]
