"""The probe: one forward pass of the model watched op by op.

A `Probe` (a TorchFunctionMode) sees every torch function that forward
calls: which parameters enter which module's ops, whether grad mode was on,
and where forward cuts the autograd graph of a tensor that requires grad:
.detach() / .detach_() / .data, an .item() / .tolist() / .numpy() round trip,
or an op run under torch.no_grad() or inference_mode on such a tensor. A
tensor made by a cut counts as cutting the graph only once an op with grad
mode on uses it (metrics or statistics computed under no_grad and kept
aside cut nothing): the probe follows such tensors, weakly, until then.
An .item() / .tolist() / .numpy() result is a Python value it cannot
follow, so those count where they happen.

Wrappers swap what a module holds during its forward: FSDP2 (fully_shard)
puts an unsharded parameter in place of the sharded one that the Monitor
knows. So on entering a module the probe looks at the module's own
parameters again and takes each tensor it holds now as the Monitor's
parameter of that name. Cuts made by torch itself (a wrapper's own
.detach() on the way) are not the user's and are left out.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_DATA_GETTER = torch._C.TensorBase.__dict__.get("data")
_CUT_METHODS = {
    torch.Tensor.detach: ".detach()",
    torch.Tensor.detach_: ".detach_()",
    torch.Tensor.item: ".item()",
    torch.Tensor.tolist: ".tolist()",
    torch.Tensor.numpy: ".numpy()",
}
_DETACHING = (".detach()", ".detach_()", ".data")
_UNFOLLOWED = (".item()", ".tolist()", ".numpy()")  # their results are Python values
MAX_FOLLOWED = 4096  # tensors made by a cut, followed at once
# torch's own wrappers (FSDP, DDP, DTensor, torch.compile): a cut made there is not the model's.
_WRAPPER_DIRS = tuple(
    os.path.join(os.path.dirname(torch.__file__), sub) + os.sep
    for sub in ("distributed", "_dynamo", "_functorch", "_inductor", "_subclasses")
)
# Frames between an op's caller and the probe: the probe's own, dynamo's compiler.disable
# wrapper and torch.ops.* calls.
_BETWEEN = (
    os.path.abspath(__file__),
    os.path.join(os.path.dirname(torch.__file__), "_ops.py"),
    os.path.join(os.path.dirname(torch.__file__), "_dynamo", "eval_frame.py"),
)
MAX_CUTS = 16
Cut = tuple[str, str]  # what cut the graph, and the module where


class Probe(TorchFunctionMode):
    """Records, during one forward pass, how each parameter is used and where
    the autograd graph is cut (see the module doc). `by_owner`: per module
    name, its parameters' attribute names and Monitor indices."""

    def __init__(self, pindex: dict[int, int], by_owner: dict[str, dict[str, int]]) -> None:
        super().__init__()
        self.pindex = dict(pindex)
        self.by_owner = by_owner
        self.stack: list[str] = []
        self.ran: set[str] = set()
        self.no_grad_modules: set[str] = set()
        self.used: dict[int, str] = {}
        self.no_grad_use: dict[int, str] = {}
        self.reentrant: set[int] = set()  # used inside torch.utils.checkpoint(use_reentrant=True)
        self.detached: dict[int, str] = {}
        self.cuts: list[Cut] = []  # cuts whose result an op with grad mode on used
        self.followed: dict[int, tuple[weakref.ref[torch.Tensor], Cut]] = {}  # by id: tensors a cut made
        # Modules called after the model's forward, before the step ended (an auxiliary
        # loss computed in the training loop), with whether grad mode was on.
        self.outside: dict[str, bool] = {}
        self.handles: list[Any] = []
        self.active = False
        self.done = False
        # Run as it is when torch.compile traces the forward this probe watches
        # (the Monitor on a compiled model's _orig_mod): the ops it observes stay
        # its own. Disabled here, not on the class: torch.compiler.disable imports
        # torch._dynamo, about a second that `import zeroscan` must not cost.
        # The function, not the bound method: a bound method here would make a
        # reference cycle of the probe.
        self._observe_eagerly = torch.compiler.disable(Probe._observe)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            made_by = self._observe_eagerly(self, func, args, kwargs)
        except Exception:  # observing must never break the forward pass
            made_by = None
        out = func(*args, **kwargs)
        if made_by is not None:
            try:
                self._follow(out, made_by)
            except Exception:
                pass
        return out

    def _observe(self, func: Any, args: tuple, kwargs: dict) -> Cut | None:
        """Records what the op shows; returns the cut that made its result
        (a new one, or one an input carries under no_grad), to follow."""
        where = self.stack[-1] if self.stack else ""
        cut = _CUT_METHODS.get(func)
        if cut is None and getattr(func, "__self__", None) is _DATA_GETTER and _DATA_GETTER is not None:
            cut = ".data"
        grad_on = torch.is_grad_enabled()
        graph_input = False  # a tensor that requires grad and is no parameter enters the op
        carried: Cut | None = None  # the cut that made an input, not yet used with grad on
        for t in tensors_in(args, kwargs):
            i = self.pindex.get(id(t))
            if i is None:
                graph_input = graph_input or t.requires_grad
                made = self._made_by(t)
                if made is not None and grad_on and (cut is None or cut in _UNFOLLOWED):
                    self._confirm(made)  # used with grad on, or turned into a Python value
                elif made is not None:
                    carried = carried or made
            elif cut in _DETACHING:
                self.detached.setdefault(i, where)
            elif grad_on:
                self.used.setdefault(i, where)
            else:
                self.no_grad_use.setdefault(i, where)
                if in_reentrant_checkpoint():
                    self.reentrant.add(i)
        if not grad_on and cut is None and graph_input and not in_reentrant_checkpoint() and not in_function_forward():
            cut = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
        if cut is None:
            return None if grad_on else carried
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        cuts_graph = cut.startswith("torch.") or (
            first is not None and first.requires_grad and id(first) not in self.pindex
        )
        if not cuts_graph or called_by_torch():
            return carried
        if cut in _UNFOLLOWED:
            self._confirm((cut, where))
            return None
        return (cut, where)

    def _made_by(self, t: torch.Tensor) -> Cut | None:
        entry = self.followed.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _confirm(self, cut: Cut) -> None:
        if cut not in self.cuts and len(self.cuts) < MAX_CUTS:
            self.cuts.append(cut)

    def _follow(self, out: Any, cut: Cut) -> None:
        """Follows the tensors `out` holds, made by `cut`."""
        for t in (out,) if isinstance(out, torch.Tensor) else out if isinstance(out, (list, tuple)) else ():
            if isinstance(t, torch.Tensor):
                if len(self.followed) >= MAX_FOLLOWED:
                    del self.followed[next(iter(self.followed))]
                self.followed[id(t)] = (weakref.ref(t), cut)

    def enter_module(self, name: str, module: nn.Module, root_grad: bool) -> None:
        self.stack.append(name)
        self.ran.add(name)
        if root_grad and not torch.is_grad_enabled():
            self.no_grad_modules.add(name)
        own = self.by_owner.get(name)
        if own:  # what the module holds now (FSDP2: the unsharded parameter)
            for attr, t in module._parameters.items():
                if t is not None and attr in own:
                    self.pindex[id(t)] = own[attr]

    def leave_module(self) -> None:
        if self.stack:
            self.stack.pop()


def called_by_torch() -> bool:
    """Whether the op being observed was called from one of torch's wrappers
    (FSDP's hooks, say), not from the model's code."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in _BETWEEN:
        frame = frame.f_back
    if frame is None:
        return False
    where = frame.f_code.co_filename
    # "<eval_with_key>": the code of a torch.fx graph (a compiled graph run as Python)
    return where.startswith(_WRAPPER_DIRS) or where.startswith("<eval_with_key>")


def in_reentrant_checkpoint() -> bool:
    """Whether the caller runs inside the forward of torch.utils.checkpoint's
    reentrant implementation (which runs its function under no_grad)."""
    return called_within("forward", "torch/utils/checkpoint.py")


def in_function_forward() -> bool:
    """Whether the caller runs inside a custom autograd.Function's forward,
    which torch runs under no_grad: no cut (its backward says what flows back)."""
    return called_within("apply", "torch/autograd/function.py")


def called_within(name: str, file: str) -> bool:
    """Whether a function `name` of torch's file `file` is among the caller's 64 nearest frames."""
    frame = sys._getframe(2)
    for _ in range(64):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == name and code.co_filename.replace("\\", "/").endswith(file):
            return True
        frame = frame.f_back
    return False


def tensors_in(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b
