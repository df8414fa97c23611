"""Noticing that the model changed: a submodule or parameter assigned,
replaced or removed after the Monitor was made (a new classification head,
say), so that the Monitor judges the model as it is now.

torch calls its global module and parameter registration hooks on every
`module.name = ...` and register_*(). zeroscan registers one pair of them
for the whole process, the first time a StructureWatch is made; they tell
every live StructureWatch, which flags a change when the module assigned to
belongs to its model. The process-wide hooks hold the watches weakly, so
they never keep a Monitor or its model alive. A step then costs one flag
read; the model is walked again only after a change. `del module.name`
calls no hook: report() compares the parameters themselves, which catches
that too.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn
from torch.nn.modules import module as module_hooks

from zeroscan.monitor.step_record import Param, collect_params

_WATCHES: weakref.WeakSet[StructureWatch] = weakref.WeakSet()
_REGISTERED: list[Any] = []  # the process-wide hooks' handles, once registered


def _on_assign(module: nn.Module, name: str, value: Any) -> None:
    for watch in list(_WATCHES):
        watch.assigned(module)


class StructureWatch:
    """`changed` turns True when a submodule or a parameter is assigned to
    a module of `model` (until `rebuild()`)."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._ids = {id(m) for m in model.modules()}
        self.changed = False
        self.retrace = False  # the model changed since the NaN trace last hooked it
        if not _REGISTERED:
            _REGISTERED.append(module_hooks.register_module_module_registration_hook(_on_assign))
            _REGISTERED.append(module_hooks.register_module_parameter_registration_hook(_on_assign))
        _WATCHES.add(self)

    def assigned(self, module: nn.Module) -> None:
        if id(module) in self._ids:
            self.changed = True

    def rebuild(self) -> None:
        """The model's modules as they are now; the change is taken in."""
        self._ids = {id(m) for m in self._model.modules()}
        self.changed = False

    def take_in(self, params: list[Param], check: bool) -> list[Param] | None:
        """The model's parameters as they are now where they are not
        `params` any more, else None; looked at only after a change (or,
        `check`, always). Sets `retrace` after any change: the NaN trace then
        hooks every module as it is now."""
        changed = self.changed
        if not (changed or check):
            return None
        now = collect_params(self._model)
        self.rebuild()
        same = [(p.name, id(p.tensor)) for p in now] == [(p.name, id(p.tensor)) for p in params]
        self.retrace = self.retrace or changed or not same
        return None if same else now

    def remove(self) -> None:
        _WATCHES.discard(self)


def carried_over(before: list[Param], after: list[Param]) -> dict[int, int]:
    """After the model changed: each parameter of `before` (by index) that
    the model still holds, mapped to its index in `after`."""
    by_id = {id(p.tensor): p.index for p in after}
    return {p.index: by_id[id(p.tensor)] for p in before if id(p.tensor) in by_id}
