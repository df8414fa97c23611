"""When a backward pass through the model ends, and what happened to the
gradients after it.

The Monitor opens a step when backward completes and keeps hold of its
gradients (deferred.py says when it reads them), so that a step whose
optimizer.step() never runs (GradScaler skips it when it finds inf/NaN) is
still seen. `BackwardWatch` puts a pre-hook on the grad_fn of
each output of a forward pass; the first of them to fire in a backward pass
queues an autograd-engine callback, which runs when that backward pass has
finished accumulating every .grad. The callback queues itself once more
before acting, so that it runs after the callbacks other wrappers queue
during backward (DDP copies its all-reduced buckets into .grad in one).
Which outputs a backward pass went through (`fired`: a hook on each output
tensor sees whether a gradient reached it; a wrapper such as DDP may give
all outputs one grad_fn) is what tells an output left out of the loss
(cause analysis, causes.py).

A `GradState` remembers, per parameter, which .grad tensor was there and
its version counter (bumped by in-place changes such as clipping and
zero_(); not by GradScaler's unscaling, nor by a write through .data), with
no reference that would keep a freed gradient alive. Between two backward
passes with no step, gradients left untouched mean gradient accumulation;
gradients reset or changed mean the step ended without optimizer.step().
After a step, whether they were zeroed in place or let go (`reset_kind`)
tells the Monitor whether it may defer reading them (deferred.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch

from zeroscan.monitor.graph import Root, output_roots
from zeroscan.monitor.step_record import Param

_ENGINE = getattr(torch.autograd.Variable, "_execution_engine", None)

# Per parameter: a weak reference to its .grad tensor and that tensor's version
# counter, or None where .grad was None.
GradState = list[tuple["weakref.ReferenceType[torch.Tensor]", int] | None]


def grad_state(params: list[Param]) -> GradState:
    out: GradState = []
    for p in params:
        g = p.tensor.grad
        out.append(None if g is None else (weakref.ref(g), g._version))
    return out


def same_grad(p: Param, was: tuple[weakref.ReferenceType[torch.Tensor], int] | None) -> bool:
    """Whether p's .grad is the tensor `was` remembers, unchanged since."""
    g = p.tensor.grad
    if was is None:
        return g is None
    return g is not None and was[0]() is g and g._version == was[1]


def grads_touched(params: list[Param], state: GradState) -> bool:
    """Whether any gradient was replaced, cleared or changed in place since `state`."""
    return not all(same_grad(p, was) for p, was in zip(params, state))


def reset_kind(params: list[Param], state: GradState) -> Literal["in place", "let go"] | None:
    """How the gradients that `state` remembers were touched since: "in
    place" when one of them is still there, changed in place (zero_(), a
    clipping, an accumulation); "let go" when every one touched is gone or
    replaced (zero_grad() setting .grad to None); None when none was touched."""
    kind: Literal["let go"] | None = None
    for p, was in zip(params, state):
        if was is None or same_grad(p, was):
            continue
        g = p.tensor.grad
        if g is not None and g is was[0]():
            return "in place"
        kind = "let go"
    return kind


class BackwardWatch:
    """Calls `finished()` once at the end of every backward pass that goes
    through an output of a watched forward pass (see the module doc), and
    `started()` when such a pass reaches the model's outputs."""

    def __init__(self, started: Callable[[], None], finished: Callable[[], None]) -> None:
        self._started = started
        self._finished = finished
        self.running = False
        self.active = _ENGINE is not None and hasattr(_ENGINE, "queue_callback")
        self.fired: set[int] = set()  # the outputs (by position) that a gradient reached

    def watch(self, roots: list[Any], outputs: list[torch.Tensor]) -> None:
        """Hooks the grad_fns of a forward pass's outputs, and the outputs."""
        if not self.active:
            return
        for fn in roots:
            fn.register_prehook(self._on_output_grad)
        for k, t in enumerate(outputs):
            t.register_hook(_Fired(self, k))

    def watch_output(self, output: Any) -> list[Root]:
        """Watches a forward pass's `output` (graph.output_roots: its tensors
        with a grad_fn, nested); the Roots it found."""
        roots: list[Root] = []
        tensors: list[torch.Tensor] = []
        output_roots(output, roots, tensors)
        self.watch([t.grad_fn for t in tensors], tensors)
        return roots

    def reset(self) -> None:
        """A new forward pass begins: a backward pass that raised never finished."""
        self.running = False
        self.fired = set()

    def _on_output_grad(self, grad_outputs: Any) -> None:
        if self.running:
            return
        self.running = True
        self._started()
        _ENGINE.queue_callback(self._requeue)

    def _requeue(self) -> None:
        _ENGINE.queue_callback(self._done)

    def _done(self) -> None:
        self.running = False
        self._finished()


class _Fired:
    """The hook on one output tensor: tells the watch that a gradient reached
    output number `key` (torch calls it with None where none did). Changes
    no gradient."""

    __slots__ = ("_watch", "_key")

    def __init__(self, watch: BackwardWatch, key: int) -> None:
        self._watch = watch
        self._key = key

    def __call__(self, grad: torch.Tensor | None) -> None:
        if grad is not None:
            self._watch.fired.add(self._key)
