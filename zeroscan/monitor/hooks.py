"""The hooks a Monitor puts on the user's model and optimizer, kept so that
they never outlive the Monitor nor travel with the model.

Two things follow from a hook living in the model's own hook dicts:

- The model keeps whatever the hook refers to alive. So every hook calls
  its Monitor through a weak reference (`weak_hook`): dropping the last
  reference to a Monitor frees it, with its records and the optimizer
  state it could see, and a finalizer then removes its hooks (`Hooks`).
- `torch.save(model)` pickles the hook dicts, and `copy.deepcopy(model)`
  copies them. So while zeroscan's hooks are on a module, that module gets
  an instance `__getstate__` that leaves them (and itself) out of the
  state: a saved or copied model is byte for byte what it would be without
  zeroscan, and loads without it. The module's own `__getstate__`, if its
  class has one, still makes the state.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

# The dicts of an nn.Module whose keys are hook handle ids.
HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)

# module -> the ids of zeroscan's hook handles on it, from every Monitor.
_OURS: weakref.WeakKeyDictionary[nn.Module, set[int]] = weakref.WeakKeyDictionary()


class WeakHook:
    """Calls `owner.<method>(*bound, *args)` while `owner` lives; returns
    None (a hook that changes nothing) once it is gone."""

    __slots__ = ("_owner", "_method", "_bound")

    def __init__(self, owner: object, method: str, *bound: object) -> None:
        self._owner = weakref.ref(owner)
        self._method = method
        self._bound = bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self._owner()
        if owner is None:
            return None
        return getattr(owner, self._method)(*self._bound, *args, **kwargs)


def weak_hook(owner: object, method: str, *bound: object) -> Callable[..., Any]:
    """A WeakHook that torch.compile runs as it is: host-side bookkeeping,
    which dynamo would otherwise compile once for every signature of hook it
    serves, up to its recompile limit. Disabled where a hook is made, not on
    the class: torch.compiler.disable imports torch._dynamo, about a second
    that `import zeroscan` must not cost."""
    return torch.compiler.disable(WeakHook(owner, method, *bound))


class StateWithoutHooks:
    """A module's instance `__getstate__` while zeroscan's hooks are on it:
    the state its class gives, without those hooks and without itself."""

    __slots__ = ("_module",)

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)

    def __call__(self) -> Any:
        module = self._module()
        if module is None:
            return None
        state = type(module).__getstate__(module)
        if not isinstance(state, dict):
            return state
        ours = _OURS.get(module, set())
        state = dict(state)
        state.pop("__getstate__", None)
        for name in HOOK_DICTS:
            hooks = state.get(name)
            if isinstance(hooks, dict) and any(key in ours for key in hooks):
                state[name] = OrderedDict((key, hook) for key, hook in hooks.items() if key not in ours)
        return state


class Hooks:
    """Every hook handle of one Monitor, removed together by `remove_all()`
    (Monitor.close(), or the finalizer when the Monitor is freed)."""

    def __init__(self) -> None:
        self._handles: dict[int, tuple[RemovableHandle, weakref.ref[nn.Module] | None]] = {}

    def forward_pre(self, module: nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False) -> RemovableHandle:
        return self._on_module(module, module.register_forward_pre_hook(hook, with_kwargs=with_kwargs))

    def forward(self, module: nn.Module, hook: Callable[..., Any], *, always_call: bool = False) -> RemovableHandle:
        return self._on_module(module, module.register_forward_hook(hook, always_call=always_call))

    def keep(self, handle: RemovableHandle) -> RemovableHandle:
        """A handle of a hook on something other than a module (an optimizer),
        removed with the rest."""
        self._handles[handle.id] = (handle, None)
        return handle

    def _on_module(self, module: nn.Module, handle: RemovableHandle) -> RemovableHandle:
        self._handles[handle.id] = (handle, weakref.ref(module))
        ours = _OURS.setdefault(module, set())
        ours.add(handle.id)
        if not isinstance(module.__dict__.get("__getstate__"), StateWithoutHooks):
            module.__dict__["__getstate__"] = StateWithoutHooks(module)
        return handle

    def remove(self, handle: RemovableHandle) -> None:
        entry = self._handles.pop(handle.id, None)
        if entry is None:
            return
        handle.remove()
        module = entry[1]() if entry[1] is not None else None
        if module is None:
            return
        ours = _OURS.get(module)
        if ours is not None:
            ours.discard(handle.id)
            if not ours:
                del _OURS[module]
                if isinstance(module.__dict__.get("__getstate__"), StateWithoutHooks):
                    del module.__dict__["__getstate__"]

    def remove_all(self) -> None:
        for handle, _ in list(self._handles.values()):
            self.remove(handle)
