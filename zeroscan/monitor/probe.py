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

The probe also notes what the cause analysis asks of a pass beyond cuts:
which parameters entered an op that gave a float16 result (autocast's
matmuls and convolutions; context.py), a cut the model made on its own input
(a pipeline stage that detaches what it received), and the graph behind the
outputs of each submodule (an auxiliary loss a module returns that never
enters the loss; causes.py).
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

from zeroscan.monitor.labels import one_level

_DATA_GETTER = torch._C.TensorBase.__dict__.get("data")
_CUT_METHODS = {
    torch.Tensor.detach: ".detach()",
    torch.Tensor.detach_: ".detach_()",
    torch.Tensor.item: ".item()",
    torch.Tensor.tolist: ".tolist()",
    torch.Tensor.numpy: ".numpy()",
}
_DETACHING = (".detach()", ".detach_()", ".data")
_WIDER_THAN_HALF = (torch.float32, torch.float64)
_UNFOLLOWED = (".item()", ".tolist()", ".numpy()")  # their results are Python values
MAX_FOLLOWED = 4096  # tensors made by a cut, followed at once
# torch's own wrappers (FSDP, DDP, DTensor, torch.compile), and the Monitor's own hooks (the NaN
# trace's): a cut made there is not the model's.
_WRAPPER_DIRS = tuple(
    os.path.join(os.path.dirname(torch.__file__), sub) + os.sep
    for sub in ("distributed", "_dynamo", "_functorch", "_inductor", "_subclasses")
) + (os.path.dirname(os.path.abspath(__file__)) + os.sep,)  # zeroscan/monitor/
# Frames between an op's caller and the probe: the probe's own, dynamo's compiler.disable
# wrapper and torch.ops.* calls.
_BETWEEN = (
    os.path.abspath(__file__),
    os.path.join(os.path.dirname(torch.__file__), "_ops.py"),
    os.path.join(os.path.dirname(torch.__file__), "_dynamo", "eval_frame.py"),
)
MAX_CUTS = 16
MAX_OUTPUTS = 1024  # submodule outputs whose graph the probe keeps, for one step
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
        self.half: dict[int, str] = {}  # parameters an op took into a float16 result, and the module where
        self.inputs: list[weakref.ref[torch.Tensor]] = []  # the model's own inputs that require grad
        # The first cut the model made on one of them that an op then used with grad on (as
        # any cut counts); `_from_input`: ids of the followed tensors such a cut made.
        self.input_cut: Cut | None = None
        self._from_input: set[int] = set()
        self._cutting_input = False
        # The outputs of submodules that carry a graph and that no later op took: the
        # submodule's name, which output, and its grad_fn (kept while the probe's step
        # lasts, for graph.py to walk). `_taken`: by position in `_kept`, whether an op took it.
        self._kept: list[tuple[str, str, Any, weakref.ref[torch.Tensor]]] = []
        self._kept_ids: dict[int, int] = {}
        self._taken: set[int] = set()
        # The tensors that require grad and that an op took with grad on, by id (weakly: an id
        # outlives its tensor, and may name a later one).
        self._consumed: dict[int, weakref.ref[torch.Tensor]] = {}
        self._op_params: list[int] = []  # the parameters wider than float16 that the current op takes
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
        self._keep_eagerly = torch.compiler.disable(Probe._keep_outputs)  # it reads grad_fns: not dynamo's

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self._op_params, self._cutting_input = [], False  # what _observe finds of this op
        try:
            made_by = self._observe_eagerly(self, func, args, kwargs)
        except Exception:  # observing must never break the forward pass
            made_by = None
        out = func(*args, **kwargs)
        if made_by is not None or self._op_params:
            try:
                if made_by is not None:
                    self._follow(out, made_by)
                if self._op_params and isinstance(out, torch.Tensor) and out.dtype == torch.float16:
                    for i in self._op_params:
                        self.half.setdefault(i, self.stack[-1] if self.stack else "")
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
        for t in call_tensors(args, kwargs):
            i = self.pindex.get(id(t))
            if i is not None and t.dtype in _WIDER_THAN_HALF:
                self._op_params.append(i)
            if i is None:
                graph_input = graph_input or t.requires_grad
                if t.requires_grad and grad_on:
                    self._took(t)
                made = self._made_by(t)
                if made is not None and grad_on and (cut is None or cut in _UNFOLLOWED):
                    self._confirm(made)  # used with grad on, or turned into a Python value
                    if id(t) in self._from_input and self.input_cut is None:
                        self.input_cut = made
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
        self._cutting_input = self.input_cut is None and self._takes_input(args, kwargs, cut)
        if cut in _UNFOLLOWED:
            self._confirm((cut, where))
            if self._cutting_input:
                self.input_cut = (cut, where)
            return None
        return (cut, where)

    def _took(self, t: torch.Tensor) -> None:
        """An op with grad mode on takes `t`, which requires grad."""
        self._consumed[id(t)] = weakref.ref(t)
        k = self._kept_ids.get(id(t))
        if k is not None and self._kept[k][3]() is t:
            self._taken.add(k)

    def taken(self, t: torch.Tensor) -> bool:
        """Whether an op with grad mode on took `t` during the probed pass."""
        ref = self._consumed.get(id(t))
        return ref is not None and ref() is t

    @property
    def outputs(self) -> list[tuple[str, str, Any]]:
        """The submodule outputs with a graph that no later op of the pass took:
        (the submodule's name, which output, its grad_fn)."""
        return [(name, which, node) for k, (name, which, node, _) in enumerate(self._kept) if k not in self._taken]

    def _takes_input(self, args: tuple, kwargs: dict, cut: str) -> bool:
        """Whether the cut `cut` is made on one of the model's own inputs
        (under no_grad: any tensor of the op; else the tensor cut)."""
        if not self.inputs:
            return False
        own = {id(t) for ref in self.inputs if (t := ref()) is not None}
        if cut.startswith("torch."):
            return any(id(t) in own for t in call_tensors(args, kwargs))
        return bool(args) and id(args[0]) in own

    def _made_by(self, t: torch.Tensor) -> Cut | None:
        entry = self.followed.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _confirm(self, cut: Cut) -> None:
        if cut not in self.cuts and len(self.cuts) < MAX_CUTS:
            self.cuts.append(cut)

    def _follow(self, out: Any, cut: Cut) -> None:
        """Follows the tensors `out` holds, made by `cut`."""
        from_input = self._cutting_input
        for t in (out,) if isinstance(out, torch.Tensor) else out if isinstance(out, (list, tuple)) else ():
            if isinstance(t, torch.Tensor):
                if from_input:
                    self._from_input.add(id(t))
                if len(self.followed) >= MAX_FOLLOWED:
                    del self.followed[next(iter(self.followed))]
                self.followed[id(t)] = (weakref.ref(t), cut)

    def enter_module(
        self, name: str, module: nn.Module, root_grad: bool, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> None:
        if not self.stack and not self.inputs:  # the model's own forward: its inputs that require grad
            found = call_tensors(args, kwargs or {})
            self.inputs = [weakref.ref(t) for t in found if t.requires_grad and id(t) not in self.pindex]
        self.stack.append(name)
        self.ran.add(name)
        if root_grad and not torch.is_grad_enabled():
            self.no_grad_modules.add(name)
        own = self.by_owner.get(name)
        if own:  # what the module holds now (FSDP2: the unsharded parameter)
            for attr, t in module._parameters.items():
                if t is not None and attr in own:
                    self.pindex[id(t)] = own[attr]

    def leave_module(self, output: Any = None) -> None:
        if self.stack:
            name = self.stack.pop()
            if self.stack:  # a submodule's: the model's own outputs are the Monitor's roots
                try:
                    self._keep_eagerly(self, name, output)
                except Exception:  # keeping must never break the forward pass
                    pass

    def _keep_outputs(self, name: str, output: Any) -> None:
        for key, t in one_level(output):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None and len(self._kept) < MAX_OUTPUTS:
                which = "the output" if key is None else f"output[{key!r}]"
                self._kept_ids[id(t)] = len(self._kept)
                self._kept.append((name, which, t.grad_fn, weakref.ref(t)))


def called_by_torch() -> bool:
    """Whether the op being observed was called from one of torch's wrappers
    (FSDP's hooks, say) or the Monitor's own, not from the model's code."""
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


def call_tensors(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors a call was given: its arguments, and those one list or tuple deep."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b
