"""Where the Monitor scans at each optimizer step (auto=True): once per
step, before the step updates the weights.

A torch.optim.Optimizer that ran its __init__ calls its step pre-hooks at
every step(): the Monitor registers one. A wrapper that never ran it (timm's
Lookahead, Accelerate's AcceleratedOptimizer, a research codebase's class
that duck-types step()) has no hooks; the optimizer it wraps
(optimizer.wrapped_chain) usually has, and its step is the real one (the
wrapper's step may run at every micro-step of gradient accumulation, and the
inner one only at the steps taken). Where nothing in the chain has hooks,
the innermost object's `step` is wrapped on the instance. An optimizer whose
`step` was replaced on the instance (by a codebase of one's own) may no
longer reach the class's step and its hooks: that instance's step is
wrapped as well, unless it says that it calls the class's step (through
`__wrapped__`, as functools.wraps and torch's lr schedulers leave it), so
that the Monitor's hook keeps its place among the other pre-hooks (a
guard's) wherever it can. Every way in goes through one StepTrigger, so a
step that passes through both (a wrapped step that calls the hooked one) is
scanned once.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from zeroscan.monitor.hooks import Hooks
from zeroscan.monitor.optimizer import wrapped_chain

T = TypeVar("T")


class StepTrigger:
    """Calls `scan` once per optimizer step, whichever way in sees the step
    first: a step pre-hook, or a wrapped `step` (a pre-hook that fires
    inside a wrapped step belongs to the same step). Once `removed`, it
    only lets the steps run."""

    __slots__ = ("_scan", "_after", "_depth", "removed")

    def __init__(self, scan: Callable[[], Any], after: Callable[[Any], Any] | None = None) -> None:
        self._scan = scan
        self._after = after  # told what a wrapped step returned (a framework's step says whether it skipped)
        self._depth = 0
        self.removed = False

    def pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._depth == 0 and not self.removed:
            self._scan()

    def around(self, run: Callable[[], T]) -> T:
        if self.removed:
            return run()
        self._depth += 1
        try:
            if self._depth == 1:
                self._scan()
            returned = run()
            if self._depth == 1 and self._after is not None:
                self._after(returned)
            return returned
        finally:
            self._depth -= 1


class StepAround:
    """An optimizer instance's `step` while the Monitor scans at it: runs the
    step it replaced, the scan first. It binds like a function, so that an
    lr scheduler made later wraps it as it wraps any step (through its
    __func__), and it keeps the replaced step's attributes (the scheduler's
    marker among them). Pickled, the bound step is the class's own (a bound
    method pickles as getattr(owner, "step")); copied with its owner, it
    runs the copy's step without scanning."""

    def __init__(self, trigger: StepTrigger, owner: object, replaced: Any) -> None:
        self.__dict__.update(getattr(replaced, "__dict__", {}))
        self.__name__ = "step"
        self.__wrapped__ = replaced
        self._trigger = trigger
        self._owner = owner
        # A method of the owner is kept unbound and bound to whichever object calls it (a copy).
        self._bound = isinstance(replaced, types.MethodType) and replaced.__self__ is owner
        self._replaced = replaced.__func__ if self._bound else replaced

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        return self if obj is None else types.MethodType(self, obj)

    def __call__(self, obj: object, *args: Any, **kwargs: Any) -> Any:
        def run() -> Any:
            if self._bound:
                return self._replaced.__get__(obj, type(obj))(*args, **kwargs)
            return self._replaced(*args, **kwargs)

        if obj is not self._owner:
            return run()
        return self._trigger.around(run)


class StepWrap:
    """The handle of a StepAround put on an instance (Hooks.keep): remove()
    puts back the step it replaced, unless something wrapped it since (then
    it stays, letting the steps through)."""

    def __init__(self, trigger: StepTrigger, owner: object, replaced: Any, had_own: bool) -> None:
        self.id = id(self)  # unique among live handles (a RemovableHandle's id is a small count)
        self._trigger = trigger
        self._owner = owner
        self._replaced = replaced
        self._had_own = had_own
        self.method: Any = None

    def remove(self) -> None:
        self._trigger.removed = True
        if self.method is None or vars(self._owner).get("step") is not self.method:
            return
        if self._had_own:
            vars(self._owner)["step"] = self._replaced
        else:
            del vars(self._owner)["step"]


def has_step_hooks(optimizer: object) -> bool:
    """Whether optimizer.step() calls the step pre-hooks registered on it:
    a torch Optimizer whose __init__ ran (it makes the hook dict and patches
    its class's step to call them)."""
    return (
        isinstance(optimizer, torch.optim.Optimizer)
        and isinstance(getattr(optimizer, "__dict__", {}).get("_optimizer_step_pre_hooks"), dict)
        and bool(getattr(type(optimizer).step, "hooked", False))
    )


def passes_through(step: object, owner: object) -> bool:
    """Whether a step put on `owner` says it calls its class's step: a
    chain of __wrapped__ (functools.wraps, which torch's lr schedulers use)
    reaches it. (A decorator such as torch.no_grad wraps a step of its own.)"""
    target = getattr(type(owner), "step", None)
    for _ in range(16):
        if step is None:
            return False
        if getattr(step, "__func__", step) is target:
            return True
        step = getattr(step, "__wrapped__", None)
    return False


def attach_step(
    op: str,
    optimizer: object,
    scan: Callable[[], Any],
    hooks: Hooks,
    *,
    after: Callable[[Any], Any] | None = None,
) -> None:
    """Makes `scan` run once at each step of `optimizer`, before it updates
    the weights (see the module doc); every hook and wrapper goes into
    `hooks`, removed with them. With `after`, `optimizer`'s own step is
    wrapped (a framework's, frameworks.py) and `after` is given what each
    step returned. Raises, in one line, where no step can be
    hooked nor wrapped."""
    trigger = StepTrigger(scan, after)
    if after is not None:  # a framework's own step (frameworks.py): its inner optimizer steps only when it updates
        why = _wrap_step(trigger, optimizer, hooks)
        if why is None:
            return
        raise TypeError(f"{op}: the step of {type(optimizer).__name__} cannot be wrapped ({why}); "
                        "pass auto=False and call monitor.step() once per step")
    chain = wrapped_chain(optimizer)
    hooked = next((o for o in chain if has_step_hooks(o)), None)
    if hooked is not None:
        assert isinstance(hooked, torch.optim.Optimizer)
        hooks.keep(hooked.register_step_pre_hook(torch.compiler.disable(trigger.pre_hook)))
        if "step" not in vars(hooked) or passes_through(vars(hooked)["step"], hooked):  # the hook will run
            return
        target = hooked
    else:
        target = next((o for o in reversed(chain) if callable(getattr(o, "step", None))), optimizer)
    why = _wrap_step(trigger, target, hooks)
    if why is None or hooked is not None:  # a hooked optimizer whose step cannot be wrapped still has its hook
        return
    raise TypeError(
        f"{op}: optimizer {type(optimizer).__name__} has no step hooks (a torch.optim.Optimizer has them once "
        f"its __init__ ran) and its step cannot be wrapped ({why}); pass the "
        "torch.optim.Optimizer it wraps, or pass auto=False and call monitor.step() once per step"
    )


def _wrap_step(trigger: StepTrigger, owner: object, hooks: Hooks) -> str | None:
    """Puts a StepAround on `owner`'s step; None, or why it cannot."""
    replaced = getattr(owner, "step", None)
    if not callable(replaced):
        return f"{type(owner).__name__}.step is {type(replaced).__name__}, not a method"
    try:
        own = vars(owner)
    except TypeError:
        return f"a {type(owner).__name__} has no __dict__ to hold a wrapped step"
    had_own = "step" in own
    handle = StepWrap(trigger, owner, own.get("step"), had_own)
    method = StepAround(trigger, owner, replaced).__get__(owner)
    try:
        setattr(owner, "step", method)
    except (AttributeError, TypeError) as err:
        return f"setting its step failed: {err}"
    if vars(owner).get("step") is not method:  # a __setattr__ or descriptor of its own put it elsewhere
        try:
            setattr(owner, "step", own["step"]) if had_own else delattr(owner, "step")
        except (AttributeError, TypeError):
            pass  # left as its class handles it: nothing the Monitor can undo better
        return "its class does not keep an instance's step"
    handle.method = method
    hooks.keep(handle)  # type: ignore[arg-type]  # a handle by its id and remove(), as Hooks keeps them
    return None
