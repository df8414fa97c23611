"""Results a forward pass computed with an autograd graph that the loss never used.

An auxiliary loss (a router's load-balancing loss, an auxiliary head's
loss) trains its parameters only once it is added to the loss. Computed
and left out, it still holds its graph: kept on a module
(`self.aux_loss = ...`) or returned by a submodule next to the main
result. A parameter with no gradient that such a tensor reaches feeds it,
and backward never went through it (else the parameter would have a
gradient): that is the cause to name, before any .detach() the forward
pass made elsewhere.

The tensors looked at: those with a grad_fn kept as attributes of the
model's modules (in plain lists, tuples and dicts too, one level), and the
outputs of the submodules that hold the parameter (the probe kept their
grad_fns for its one step), in both cases only those that no op of the
probed forward pass took: a result that went on (into a .detach(), say)
was used, and what cut it is the cause. A module's own output, which
reaches its own parameters by construction, says nothing and is left out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from zeroscan.monitor import graph
from zeroscan.monitor.labels import module_label, one_level
from zeroscan.monitor.step_record import Param, Why
from zeroscan.monitor.unregistered import MODULE_INTERNALS
from zeroscan.verdicts import Cause

MAX_KEPT = 64  # tensors whose graph is walked, per question


class Kept(NamedTuple):
    """A tensor with a graph: how messages name it, and its grad_fn."""

    label: str
    node: Any


def kept_on_modules(model: nn.Module, taken: Callable[[torch.Tensor], bool]) -> list[Kept]:
    """The tensors with a grad_fn that the model's modules keep as attributes,
    and that no op of the probed pass took (`taken` says)."""
    out: list[Kept] = []
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr in MODULE_INTERNALS:
                continue
            where = f"{name}.{attr}" if name else attr
            for key, t in one_level(value):
                if isinstance(t, torch.Tensor) and t.grad_fn is not None and not taken(t):
                    label = where if key is None else f"{where}[{key!r}]"
                    out.append(Kept(f"{label} (kept on {module_label(model, name)})", t.grad_fn))
                if len(out) >= MAX_KEPT:
                    return out
    return out


class KeptGraphs:
    """What one explain() asks of the kept tensors: which reach a parameter
    (each tensor's graph walked once, when first needed)."""

    def __init__(self, model: nn.Module, outputs: list[tuple[str, str, Any]], taken: Callable[[torch.Tensor], bool],
                 roots: list[Any], index: dict[int, int]) -> None:
        self._model = model
        self._outputs = outputs  # (module name, which output, grad_fn) that no op took, from the probe
        self._taken = taken
        self._roots = {id(node) for node in roots}
        self._index = index
        self._on_modules: list[Kept] | None = None
        self._reach: dict[int, set[int]] = {}

    def _reaches(self, kept: Kept, i: int) -> bool:
        if id(kept.node) not in self._reach:
            self._reach[id(kept.node)] = graph.reachable([kept.node], self._index)
        return i in self._reach[id(kept.node)]

    def feeding(self, p: Param) -> Kept | None:
        """A kept tensor that `p` (no gradient) feeds, if any."""
        try:
            return self._feeding(p)
        except Exception:  # a module whose attributes cannot be read: nothing known
            return None

    def _feeding(self, p: Param) -> Kept | None:
        if self._on_modules is None:
            self._on_modules = kept_on_modules(self._model, self._taken)
        candidates = list(self._on_modules)
        for name, which, node in self._outputs:
            holds = p.owner.startswith(name + ".")  # a submodule that holds p, not p's own module
            if holds and id(node) not in self._roots and len(candidates) < MAX_KEPT:
                candidates.append(Kept(f"{which} of {module_label(self._model, name)}", node))
        return next((k for k in candidates if self._reaches(k, p.index)), None)


def unused_result_why(name: str, kept: Kept) -> Why:
    """`name` feeds `kept`, which the loss that backward ran never used."""
    said = (
        "which carries an autograd graph but is not part of the loss that backward ran (computed, but "
        "never added to the loss); add it to the loss (an auxiliary loss, such as a router's load-balancing "
        "loss, trains only once added), or stop computing it"
    )
    return Why(Cause.UNUSED, f"{name} gets no gradient: it feeds {kept.label}, {said}",
               f"these parameters get no gradient: they feed {kept.label}, {said}")
