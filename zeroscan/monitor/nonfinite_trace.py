"""Monitor(trace_nonfinite=True), the recording: where a NaN or an infinity
could have been born, flagged on the device at every step.

Every module of the model gets a forward pre-hook and a forward hook. In a
forward pass that builds a graph, each floating-point tensor a module call
takes or returns (found in whatever structure holds it: tensor_tree.py) gets
a flag on its own device (zeroscan's mark_nonfinite: one pass over the
tensor that ORs 1 for an infinity and 2 for a NaN into an int32 slot, and
reads nothing back), and a pre-hook on the autograd node that made it,
which flags the gradient reaching it in backward. Every parameter gets a
tensor hook too, which flags the gradient backward brings it. The host
keeps, per pass, which slot belongs to which call's inputs or outputs, and
the order in which calls began and returned and gradients arrived;
nonfinite_origin.py reads the flags only when report() asks, and finds
where the non-finite value that reached the gradients came from.

Each top-level call (the model's own, or a module called from outside it)
is a pass of its own. A pass that the backward pass after it never reached
(validation with grad on, a generation loop, a forward whose loss was
dropped after an exception) is let go when its segment closes: it made no
gradient, so it is never merged into the training pass that follows.

A segment hooks at most MAX_HOOKED gradients, the first its passes meet
(all of them: one pass's graph may feed the next, as a generation loop's
does, so the cap holds for the whole chain the backward pass may free).
Every hook gives the autograd node it sits on a Python object, and torch
frees a chain of such nodes recursively, one level of the C stack per node:
a cell unrolled 20,000 times, hooked at every call, overflows an 8 MB stack
when its graph is freed (a plain graph is freed iteratively). Past the cap
the forward values are still flagged; the backward pass is followed through
the hooked part and the parameters, and a message that depends on the rest
says the trace stopped following it. The trace holds nothing of the graph
(tensors only weakly), so a graph lives as long as the user's code keeps it.

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

from zeroscan import ops
from zeroscan.monitor.hooks import Hooks, weak_hook
from zeroscan.monitor.step_record import Param
from zeroscan.monitor.tensor_tree import flaggable, tensors_in

CHUNK = 1024  # flag slots per device buffer
MAX_HOOKED = 2048  # gradient hooks per segment (see above: a graph freed with more in one chain can overflow the stack)
TENSOR, PARAMETER = 0, 1  # what a gradient arrival is for
NO_PASS = -1  # the pass column of a parameter's arrival: it belongs to the segment's backward
_MARK = ops.mark_nonfinite
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

    def clear(self, slots: list[int]) -> None:
        """Zeroes the flags of `slots` on their devices, a run of consecutive
        slots at a time (a pass's slots are mostly one run): no index tensor
        is copied to a device, so nothing waits for the host."""
        runs: list[tuple[int, int]] = []  # [start, stop)
        for slot in sorted(t for t in slots if t >= 0):
            if runs and runs[-1][1] == slot and slot % CHUNK and self.where[slot] == self.where[slot - 1]:
                runs[-1] = (runs[-1][0], slot + 1)
            else:
                runs.append((slot, slot + 1))
        for start, stop in runs:
            buffer = self.buffers.get((self.devices[self.where[start]], start // CHUNK))
            if buffer is not None:
                buffer[start % CHUNK : (stop - 1) % CHUNK + 1].zero_()


class Call:
    """One call of a module in a forward pass: its name, how deep it is in
    the calls under way, the call it was made from (-1: none), the tracked
    tensors (numbers into ForwardPass.fslots) it took and returned, and the
    kinds of values in its inputs and output the trace could not look into."""

    __slots__ = ("name", "depth", "parent", "inputs", "labels", "outputs", "unseen_in", "unseen_out")

    def __init__(self, name: str, depth: int, parent: int) -> None:
        self.name = name
        self.depth = depth
        self.parent = parent
        self.inputs: list[int] = []
        self.labels: list[str] = []  # how each input was passed: "args[0]", "kwargs['mask']"
        self.outputs: list[int] = []
        self.unseen_in: list[str] = []
        self.unseen_out: list[str] = []


class FrozenCall(NamedTuple):
    """A Call once its pass is over: what the trace keeps."""

    name: str
    depth: int
    parent: int
    inputs: tuple[int, ...]
    labels: tuple[str, ...]
    outputs: tuple[int, ...]
    unseen_in: tuple[str, ...]
    unseen_out: tuple[str, ...]


class ForwardPass:
    """One forward pass: the calls of one top-level module call.

    events: 2 * call for a call's start, 2 * call + 1 for its return, in order.
    fslots: per tracked tensor, its flag slot (-1: unread).
    number: its place among its segment's passes (the pass column of the
        segment's arrivals).
    hooked: a gradient hook was set on one of its tensors; reached: one of
        them fired, so the backward pass ran through this pass's graph.
    params: (name, owner module) per parameter index, as the model was
        when the pass ran.
    """

    __slots__ = ("calls", "events", "fslots", "segment", "number", "hooked", "reached", "params", "closed")

    def __init__(self, segment: Segment, params: list[tuple[str, str]]) -> None:
        self.calls: list[Call] | tuple[FrozenCall, ...] = []
        self.events: list[int] | tuple[int, ...] = []
        self.fslots: list[int] | tuple[int, ...] = []
        self.segment = segment
        self.number = len(segment.passes)
        self.hooked = False
        self.reached = False
        self.params = params
        self.closed = False  # a gradient arriving later (a graph kept past its step) is not this pass's

    @property
    def flags(self) -> Flags:
        return self.segment.flags

    def freeze(self, like: ForwardPass | None) -> None:
        """The pass is over: its calls, events and slots become tuples, shared
        with `like` (the previous pass) where they are equal, as they are at
        every step of a model whose forward pass does not change."""
        calls = tuple(
            FrozenCall(
                c.name, c.depth, c.parent, tuple(c.inputs), tuple(c.labels), tuple(c.outputs),
                tuple(c.unseen_in), tuple(c.unseen_out),
            )
            for c in self.calls
        )
        self.closed = True
        events, fslots = tuple(self.events), tuple(self.fslots)
        if like is not None and (like.calls, like.events, like.fslots) == (calls, events, fslots):
            calls, events, fslots = like.calls, like.events, like.fslots  # type: ignore[assignment]
        self.calls, self.events, self.fslots = calls, events, fslots


class Segment:
    """The passes between two ends of a backward pass (one step, or one
    micro-batch of it: gradient accumulation; its StepTrace says which step)
    and the gradients that backward pass brought.

    arrivals: (pass number, TENSOR, tracked tensor, slot) or (NO_PASS,
        PARAMETER, parameter index, slot) per gradient, in the order backward
        brought them; once closed, rows of an int32 array.
    """

    __slots__ = ("passes", "flags", "arrivals", "hooks")

    def __init__(self) -> None:
        self.passes: list[ForwardPass] = []
        self.flags = Flags()
        self.arrivals: list[tuple[int, int, int, int]] | np.ndarray = []
        self.hooks = 0  # gradient hooks set, up to MAX_HOOKED

    def close(self) -> None:
        """Lets go of the passes the backward pass never reached (each keeps
        its slots in `flags`, unread) and freezes the arrivals, renumbered."""
        for fpass in self.passes:
            fpass.closed = True
        kept = [p for p in self.passes if p.reached or not p.hooked]
        dropped = [p for p in self.passes if p.hooked and not p.reached]
        if dropped:  # their flags must not count as made (born_words)
            self.flags.clear([slot for p in dropped for slot in p.fslots])
        renumber = {p.number: k for k, p in enumerate(kept)}
        for k, p in enumerate(kept):
            p.number = k
        rows = [(renumber.get(n, n), what, i, slot) for n, what, i, slot in self.arrivals]
        self.passes = kept
        self.arrivals = np.array(rows, dtype=np.int32).reshape(-1, 4)


class StepTrace(NamedTuple):
    step: int
    segments: list[Segment]


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
    """The pre-hook on the node that made one tracked tensor (its output
    `output_nr`): flags the gradient that backward brings the tensor. Holds
    its trace weakly; changes no gradient."""

    __slots__ = ("_trace", "_pass", "_tracked", "_output")

    def __init__(self, trace: NonfiniteTrace, fpass: ForwardPass, tracked: int, output: int) -> None:
        self._trace = weakref.ref(trace)
        self._pass = fpass
        self._tracked = tracked
        self._output = output

    def __call__(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        fpass = self._pass
        if self._trace() is None or fpass.closed:
            return
        try:
            grad = grad_outputs[self._output]
            fpass.reached = True
            if grad is not None and flaggable(grad):
                slot = fpass.flags.mark(grad)
                fpass.segment.arrivals.append((fpass.number, TENSOR, self._tracked, slot))  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001  the trace must never break the user's backward pass
            pass


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
                slot = fpass.flags.mark(grad)
                fpass.segment.arrivals.append((NO_PASS, PARAMETER, index, slot))  # type: ignore[union-attr]
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
            self._pass = ForwardPass(self._segment, self._params)  # every top-level call is a pass
            self._segment.passes.append(self._pass)
            self._seen = {}
        fpass = self._pass
        if fpass is None or fpass.closed:  # a step closed while a forward pass was under way
            return
        number = len(fpass.calls)
        call = Call(name, len(self._stack), self._stack[-1] if self._stack else -1)
        found: list[tuple[torch.Tensor, str]] = []
        tensors_in(args, "args", found, call.unseen_in)
        tensors_in(kwargs, "kwargs", found, call.unseen_in)
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
        call = fpass.calls[number]
        tensors_in(output, "output", found, call.unseen_out)  # type: ignore[arg-type]
        call.outputs = [self._track(fpass, t) for t, _ in found]  # type: ignore[union-attr]
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
        # requires_grad and is_leaf first: reading t.grad_fn gives its node a Python object (see above).
        if t.requires_grad and not t.is_leaf and fpass.segment.hooks < MAX_HOOKED:
            t.grad_fn.register_prehook(GradArrived(self, fpass, number, t.output_nr))
            fpass.hooked = True
            fpass.segment.hooks += 1
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
        segment.close()
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

    def end_step(self, step: int, model: nn.Module, params: list[Param], changed: bool) -> None:
        """close(), then hooks the model again where it `changed` or a
        requires_grad did: on the step path, between forward passes, never
        from report() (another thread's forward pass may be iterating the hooks)."""
        self.close(step, params)
        if changed or self.stale:
            self.attach(model, params)

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
