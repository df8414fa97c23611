"""Monitor(trace_nonfinite=True), the recording: where a NaN or an infinity
could have been born, flagged on the device at every step.

Every module of the model gets a forward pre-hook and a forward hook. In a
forward pass that builds a graph, each floating-point tensor a module call
takes or returns gets a flag on its own device (zeroscan's mark_nonfinite:
one pass over the tensor that ORs 1 for an infinity and 2 for a NaN into an
int32 slot, and reads nothing back), and a tensor hook that flags the
gradient reaching it in backward. Every parameter gets a tensor hook too,
which flags the gradient backward brings it. The host keeps, per pass, which
slot belongs to which call's inputs or outputs, and the order in which calls
began and returned and gradients arrived; nonfinite_origin.py reads the
flags only when report() asks, and finds the first place a non-finite value
appeared.

A tensor met again unchanged (the same object with the same version
counter: one module's output taken as the next one's input, a parent
returning its last child's output) keeps its flag and its gradient hook, so
most tensors are read once per pass and once more in backward.

What this does not see, by design:
- values made and used inside one module's own code: a NaN born there is
  named as born in that module (in its code, not in a module it calls);
- forward passes without a graph (a top-level call under torch.no_grad or
  inference mode), and the recomputation of activation checkpointing, which
  runs inside backward and repeats what the forward pass already flagged;
- calls on other threads than the one that called the model (nn.DataParallel's
  replicas): the wrapper's own call is traced;
- tensors that are not plain strided floating-point tensors (DTensor and
  other subclasses, sparse, complex), and parameters that are DTensors
  (FSDP2's shards): their modules' plain inputs and outputs still are;
- inside a torch.compile'd module: tracing stops at its boundary
  (`traced_modules`), because hooks inside a compiled region break its graph;
  a module compiled in place (module.compile()) runs its own hooks inside
  the compiled region, so neither it nor what it holds is traced, and an
  origin inside it is named in its caller. Compile before making the Monitor.

A hook never raises into training: what it cannot read is left unflagged.
"""

from __future__ import annotations

import threading
import weakref
from array import array
from collections import deque
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from zeroscan.monitor.hooks import Hooks, weak_hook
from zeroscan.monitor.step_record import Param
from zeroscan.ops import FLOAT_DTYPES

CHUNK = 1024  # flag slots per device buffer
MAX_DEPTH = 4  # how deep into nested lists, tuples and dicts a call's tensors are looked for
TENSOR, PARAMETER = 0, 1  # what a gradient arrival is for
_MARK = torch.ops.zeroscan.mark_nonfinite.default
_FLAGGED = frozenset(FLOAT_DTYPES)
_NO_KERNEL: set[str] = set()  # device types mark_nonfinite has no kernel for (found on first use)


class Flags:
    """The flag slots of one segment: int32 buffers of CHUNK slots, one per
    device and chunk, made zeroed when first needed, and where each slot is:
    `devices` (the distinct ones) and `where` (per slot, its device's index).
    Slot -1 is a tensor that could not be read (never flagged)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.device, int], torch.Tensor] = {}
        self.devices: list[torch.device] = []
        self.where = array("B")
        # Backward runs gradient hooks on one autograd thread per device: a slot is taken under the lock.
        self._lock = threading.Lock()

    def mark(self, t: torch.Tensor) -> int:
        """A new slot, flagged with what `t` holds (queued on t's device)."""
        device = t.device
        if device.type in _NO_KERNEL:
            return -1
        try:
            with self._lock:
                slot = len(self.where)
                if device not in self.devices:
                    self.devices.append(device)
                self.where.append(self.devices.index(device))  # a slot never flagged reads as finite
                key = (device, slot // CHUNK)
                buffer = self.buffers.get(key)
                if buffer is None:
                    buffer = self.buffers[key] = torch.zeros(CHUNK, dtype=torch.int32, device=device)
            _MARK([t.detach()], buffer, [slot % CHUNK])
        except NotImplementedError:  # no kernel for this device type (MPS, XLA)
            _NO_KERNEL.add(device.type)
            return -1
        except (RuntimeError, ValueError, TypeError):  # unreadable (freed storage): never break training
            return -1
        return slot


class Call:
    """One call of a module in a forward pass: its name, how deep it is in
    the calls under way, the call it was made from (-1: none), and the
    tracked tensors (numbers into ForwardPass.fslots) it took and returned."""

    __slots__ = ("name", "depth", "parent", "inputs", "labels", "outputs")

    def __init__(self, name: str, depth: int, parent: int) -> None:
        self.name = name
        self.depth = depth
        self.parent = parent
        self.inputs: list[int] = []
        self.labels: list[str] = []  # how each input was passed: "args[0]", "kwargs['mask']"
        self.outputs: list[int] = []


class FrozenCall(NamedTuple):
    """A Call once its pass is over: what the trace keeps."""

    name: str
    depth: int
    parent: int
    inputs: tuple[int, ...]
    labels: tuple[str, ...]
    outputs: tuple[int, ...]


class ForwardPass:
    """One forward pass (the calls from the first top-level module call
    until a backward pass begins) and the gradients its backward brought.

    events: 2 * call for a call's start, 2 * call + 1 for its return, in order.
    fslots: per tracked tensor, its flag slot (-1: unread).
    arrivals: (TENSOR, tracked tensor, slot) or (PARAMETER, parameter
        index, slot) per gradient, in the order backward brought them.
    params: (name, owner module) per parameter index, as the model was
        when the pass ran.
    """

    __slots__ = ("calls", "events", "fslots", "arrivals", "flags", "params", "closed")

    def __init__(self, flags: Flags, params: list[tuple[str, str]]) -> None:
        self.calls: list[Call] | tuple[FrozenCall, ...] = []
        self.events: list[int] | tuple[int, ...] = []
        self.fslots: list[int] | tuple[int, ...] = []
        self.arrivals: list[tuple[int, int, int]] = []
        self.flags = flags
        self.params = params
        self.closed = False  # a gradient arriving later (a graph kept past its step) is not this pass's

    def freeze(self, like: ForwardPass | None) -> None:
        """The pass is over: its calls, events and slots become tuples, shared
        with `like` (the previous pass) where they are equal, as they are at
        every step of a model whose forward pass does not change; its
        arrivals become (what, index, slot) rows of an int32 array."""
        calls = tuple(
            FrozenCall(c.name, c.depth, c.parent, tuple(c.inputs), tuple(c.labels), tuple(c.outputs))
            for c in self.calls
        )
        self.closed = True
        events, fslots = tuple(self.events), tuple(self.fslots)
        if like is not None and (like.calls, like.events, like.fslots) == (calls, events, fslots):
            calls, events, fslots = like.calls, like.events, like.fslots  # type: ignore[assignment]
        self.calls, self.events, self.fslots = calls, events, fslots
        self.arrivals = np.array(self.arrivals, dtype=np.int32).reshape(-1, 3)  # type: ignore[assignment]


class Segment:
    """The passes between two ends of a backward pass: one step, or one
    micro-batch of it (gradient accumulation); its StepTrace says which step."""

    __slots__ = ("passes", "flags")

    def __init__(self) -> None:
        self.passes: list[ForwardPass] = []
        self.flags = Flags()


class StepTrace(NamedTuple):
    step: int
    segments: list[Segment]


def flaggable(x: object) -> bool:
    """A tensor the trace flags: plain (not a subclass such as DTensor), strided, floating."""
    return (
        type(x) in (torch.Tensor, nn.Parameter)
        and x.dtype in _FLAGGED  # type: ignore[union-attr]
        and x.layout == torch.strided  # type: ignore[union-attr]
        and not x.is_meta  # type: ignore[union-attr]
        and not x.is_nested  # type: ignore[union-attr]
    )


def tensors_in(value: Any, label: str, out: list[tuple[torch.Tensor, str]], depth: int = 0) -> None:
    """Appends (tensor, label) for every flaggable tensor in `value`, looking
    into lists, tuples and dicts (a Hugging Face ModelOutput is one) MAX_DEPTH deep."""
    if isinstance(value, torch.Tensor):
        if flaggable(value):
            out.append((value, label))
    elif depth < MAX_DEPTH:
        if isinstance(value, (list, tuple)):
            for k, v in enumerate(value):
                tensors_in(v, f"{label}[{k}]", out, depth + 1)
        elif isinstance(value, dict):
            for key, v in value.items():
                tensors_in(v, f"{label}[{key!r}]", out, depth + 1)


def traced_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module the trace hooks, once each (a module
    held twice keeps its first name), the model itself named "(model)": all
    of them, except what lies inside a torch.compile'd module (an
    OptimizedModule: traced at its boundary) and a module compiled in place
    (module.compile(): its hooks would run inside the compiled region)."""
    found: list[tuple[str, nn.Module]] = []
    met: set[int] = set()

    def visit(name: str, module: nn.Module) -> None:
        if id(module) in met or getattr(module, "_compiled_call_impl", None) is not None:
            return
        met.add(id(module))
        found.append((name or "(model)", module))
        if hasattr(module, "_orig_mod") and type(module).__name__ == "OptimizedModule":
            return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return found


class GradArrived:
    """The hook on one tracked tensor: flags the gradient that backward
    brings it. Holds its trace weakly; changes no gradient."""

    __slots__ = ("_trace", "_pass", "_tracked")

    def __init__(self, trace: NonfiniteTrace, fpass: ForwardPass, tracked: int) -> None:
        self._trace = weakref.ref(trace)
        self._pass = fpass
        self._tracked = tracked

    def __call__(self, grad: torch.Tensor) -> None:
        fpass = self._pass
        if self._trace() is None or fpass.closed or not flaggable(grad):
            return
        fpass.arrivals.append((TENSOR, self._tracked, fpass.flags.mark(grad)))  # type: ignore[union-attr]


class NonfiniteTrace:
    """The hooks of trace_nonfinite=True and what they record: `steps`, the
    StepTraces of the last `history` steps that ran a traced pass (oldest
    first). The Monitor closes a segment at the end of every backward pass
    and step (`close`)."""

    def __init__(self, model: nn.Module, params: list[Param], hooks: Hooks, history: int) -> None:
        self.steps: deque[StepTrace] = deque(maxlen=history)
        # Set by the Monitor across ranks: then each exchange reads which segments made inf/NaN.
        self.exchanging = False
        self.stale = False  # a parameter's requires_grad changed since attach(): attach again at the next step
        self._hooks = hooks
        self._handles: list[Any] = []
        self._segment = Segment()
        self._pass: ForwardPass | None = None
        self._stack: list[int] = []  # the calls under way, innermost last
        self._skipping = 0  # depth inside a top-level call that is not traced
        self._seen: dict[int, tuple[weakref.ReferenceType[torch.Tensor], int, int]] = {}
        self._unexchanged: list[Segment] = []  # closed since the last exchange across ranks
        self._params: list[tuple[str, str]] = []
        self._last_pass: ForwardPass | None = None  # the latest pass closed, whose structure the next may share
        self._thread: int | None = None  # the thread that called the model: the only one whose calls are traced
        self.attach(model, params)

    def attach(self, model: nn.Module, params: list[Param]) -> None:
        """Hooks the model's modules and parameters (again, after the model changed)."""
        self.detach()
        self.stale = False
        self._params = [(p.name, p.owner) for p in params]
        for name, module in traced_modules(model):
            self._handles.append(self._hooks.forward_pre(module, weak_hook(self, "_began", name), with_kwargs=True))
            # always_call: a call that raises (and that its caller catches) still leaves the calls under way.
            self._handles.append(self._hooks.forward(module, weak_hook(self, "_returned", name), always_call=True))
        for p in params:
            if p.tensor.requires_grad and flaggable(p.tensor):
                self._handles.append(self._hooks.keep(p.tensor.register_hook(weak_hook(self, "_param_grad", p.index))))
        self._signature = self._requires_grad(params)

    @staticmethod
    def _requires_grad(params: list[Param]) -> tuple[bool, ...]:
        return tuple(p.tensor.requires_grad for p in params)

    def detach(self) -> None:
        for handle in self._handles:
            self._hooks.remove(handle)
        self._handles = []

    def forward_started(self) -> None:
        """The model's own forward begins (the Monitor's root pre-hook): calls
        left under way by a forward pass that raised are forgotten."""
        self._stack = []
        self._skipping = 0
        self._thread = threading.get_ident()

    # ---- hooks ---------------------------------------------------------------

    def _began(self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            self._begin(name, args, kwargs)
        except Exception:  # noqa: BLE001  the trace must never break the user's forward pass
            self._stack, self._skipping = [], 0

    def _returned(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        try:
            self._return(name, output)
        except Exception:  # noqa: BLE001
            self._stack, self._skipping = [], 0

    def _param_grad(self, index: int, grad: torch.Tensor) -> None:
        fpass = self._pass
        try:
            if fpass is not None and not fpass.closed and flaggable(grad):
                fpass.arrivals.append((PARAMETER, index, fpass.flags.mark(grad)))  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001  nor its backward pass
            pass

    def _begin(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._thread is not None and threading.get_ident() != self._thread:
            return  # a replica's call on a worker thread (nn.DataParallel)
        if self._skipping:
            self._skipping += 1
            return
        if not self._stack:
            # No graph, or backward recomputing a checkpointed forward: not a pass to trace.
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                self._skipping = 1
                return
            if self._pass is None or self._pass.arrivals:  # backward ran since: a new pass
                self._pass = ForwardPass(self._segment.flags, self._params)
                self._segment.passes.append(self._pass)
                self._seen = {}
        fpass = self._pass
        if fpass is None or fpass.closed:  # a step closed while a forward pass was under way
            return
        number = len(fpass.calls)
        call = Call(name, len(self._stack), self._stack[-1] if self._stack else -1)
        found: list[tuple[torch.Tensor, str]] = []
        tensors_in(args, "args", found)
        tensors_in(kwargs, "kwargs", found)
        for t, label in found:
            call.inputs.append(self._track(fpass, t))
            call.labels.append(label)
        fpass.calls.append(call)  # type: ignore[union-attr]
        fpass.events.append(2 * number)  # type: ignore[union-attr]
        self._stack.append(number)

    def _return(self, name: str, output: Any) -> None:
        if self._thread is not None and threading.get_ident() != self._thread:
            return
        if self._skipping:
            self._skipping -= 1
            return
        fpass = self._pass
        if fpass is None or fpass.closed:
            return
        under_way = [k for k, number in enumerate(self._stack) if fpass.calls[number].name == name]
        if not under_way:
            return  # a call that began before this Monitor was made
        del self._stack[under_way[-1] + 1 :]  # calls inside it that raised, and were caught in it
        number = self._stack.pop()
        found: list[tuple[torch.Tensor, str]] = []
        tensors_in(output, "output", found)
        fpass.calls[number].outputs = [self._track(fpass, t) for t, _ in found]  # type: ignore[union-attr]
        fpass.events.append(2 * number + 1)  # type: ignore[union-attr]

    def _track(self, fpass: ForwardPass, t: torch.Tensor) -> int:
        """The tracked number of `t` in this pass: flagged (and, unless a leaf,
        hooked for its gradient) when first met, or met again with a new version.
        A leaf's gradient is not hooked: a parameter's has its own hook, and
        a leaf that lives across steps would collect one hook per step."""
        version = -1 if t.is_inference() else t._version  # an inference tensor has no version counter
        seen = self._seen.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == version:
            return seen[2]
        number = len(fpass.fslots)
        fpass.fslots.append(fpass.flags.mark(t))  # type: ignore[union-attr]
        if t.requires_grad and not t.is_leaf:
            t.register_hook(GradArrived(self, fpass, number))
        self._seen[id(t)] = (weakref.ref(t), version, number)
        return number

    # ---- steps ---------------------------------------------------------------

    def close(self, step: int, params: list[Param]) -> None:
        """The passes since the last close belong to monitored-or-not step
        `step` (a step's micro-batches join one StepTrace). `params`: the
        Monitor's, to notice a requires_grad that changed (`stale`)."""
        segment, self._segment = self._segment, Segment()
        self._pass = None
        self._seen = {}
        if self._requires_grad(params) != self._signature:
            self.stale = True
        if not segment.passes:
            return
        for fpass in segment.passes:
            fpass.freeze(self._last_pass)
            self._last_pass = fpass
        if self.exchanging:
            self._unexchanged.append(segment)
        if self.steps and self.steps[-1].step == step:
            self.steps[-1].segments.append(segment)
        else:
            self.steps.append(StepTrace(step, [segment]))

    def born_words(self, rank: int, world: int, device: torch.device) -> torch.Tensor:
        """int64 [2] on `device`: [rank, rank] if a segment closed since the
        last call holds any non-finite flag, else [world, -1] (the merge
        across ranks then gives the least and the greatest rank that made
        one); computed on the devices, not read."""
        segments, self._unexchanged = self._unexchanged, []
        buffers = [(d, b) for s in segments for (d, _), b in s.flags.buffers.items()]
        # A CPU flag is read where it is (copying it to a GPU would wait for the host); the others stay on devices.
        if any(bool(b.any()) for d, b in buffers if d.type == "cpu"):
            born = torch.ones((), dtype=torch.bool, device=device)
        else:
            anys = [b.amax().to(device) for d, b in buffers if d.type != "cpu"]
            born = torch.stack(anys).amax() > 0 if anys else torch.zeros((), dtype=torch.bool, device=device)
        low = torch.where(born, rank, world).to(torch.int64)  # scalars: nothing copied from the host
        high = torch.where(born, rank, -1).to(torch.int64)
        return torch.stack([low, high])
