"""Where each parameter's gradient (and weight) lives when the Monitor reads it.

The Monitor reads every gradient through one `GradSource`, which knows the
conventions large-model frameworks use:

  .grad        torch's own, and every framework that leaves it there (DDP,
               FSDP2, DeepSpeed's stage 0 in fp32).
  main_grad    Megatron-core's DDP, Apex and Transformer Engine's
               fuse_wgrad_accumulation accumulate into `param.main_grad` (a
               float32 view of one grad buffer) and leave .grad None.
  a partition  DeepSpeed ZeRO 1-3 moves each gradient, after backward, into
               this rank's flat partition: a parameter's fragment of it is
               read where DeepSpeed's public safe_get_local_grad and
               get_full_hp_grad read it (`_hp_mapping`, ZeRO 1-2 and its
               bf16 optimizer; the ZeRO-3 optimizer's local fp32 gradient),
               and a ZeRO-3 weight through its local partition (`ds_tensor`),
               whose padding past the parameter's end is cut off.

A partition is this rank's piece of a tensor split across the data-parallel
group, disjoint from the other ranks' pieces: with `process_group=` the
Monitor merges the pieces (counts and min/max exact), as it merges a
DTensor's shards, so the report is of the full tensor; without one it is
this rank's piece, and the report says so. Nothing is gathered.

These frameworks also keep a gradient buffer for a parameter that backward
never reached (zeros: DeepSpeed fills them in, Megatron's buffer is zeroed
at each step). So a source that reads anything but .grad (`moved`) also
hooks every parameter's gradient, and a parameter that no backward pass of
the step reached is read as having no gradient (its cause analysis then
says why), never as an exact zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zeroscan.monitor.backward import GradState, grad_state, grads_touched
from zeroscan.monitor.causes import cleared_cause
from zeroscan.monitor.hooks import Hooks, weak_hook
from zeroscan.monitor.step_record import Param, StepRecord, grad_row, weight_row


class GradSource:
    """The .grad convention: the gradient is param.grad, the weight the
    parameter itself."""

    moved = False  # gradients live elsewhere than .grad when the step reads them
    where = ".grad"  # words for a message: what a gradient finding saw

    def grad(self, p: Param) -> torch.Tensor | None:
        return p.tensor.grad

    def weight(self, p: Param) -> torch.Tensor | None:
        """The weight to scan (None: nothing of it on this rank to scan)."""
        return p.tensor

    def partitioned(self, p: Param, kind: str) -> bool:
        """Whether the `kind` ("grad" or "weight") read is this rank's
        disjoint piece of a tensor split across the data-parallel group."""
        return False

    def partitioned_rows(self, params: list[Param]) -> frozenset[int]:
        """The Slot rows (step_record.Slot.row) read as partitions."""
        return frozenset()


class MainGrad(GradSource):
    """Megatron-core / Apex / Transformer Engine: .grad where it is set
    (an optimizer that copies main_grad into it), else param.main_grad.

    With Megatron's optimizers (`ranges`: each DistributedOptimizer's
    parameter ranges), a parameter the distributed optimizer shards is read
    through the range of it this rank owns: after the reduce-scatter, only
    that range of main_grad holds the reduced gradient. A weight is read
    through the fp32 master the optimizer updates (`param.main_param`, this
    rank's shard of it where `main_param_sharded`)."""

    moved = True
    where = "main_grad"

    def __init__(self, ranges: Callable[[torch.Tensor], tuple[int, int] | None] | None = None) -> None:
        self._ranges = ranges  # a parameter's owned (start, end), (0, 0) for none; None: not sharded

    def grad(self, p: Param) -> torch.Tensor | None:
        t = p.tensor
        g = t.grad
        if g is None:
            main = getattr(t, "main_grad", None)
            g = main if isinstance(main, torch.Tensor) else None
        owned = self._ranges(t) if self._ranges is not None and g is not None else None
        if owned is not None:
            return g.reshape(-1)[owned[0]:owned[1]]
        return g

    def weight(self, p: Param) -> torch.Tensor | None:
        t = p.tensor
        main = getattr(t, "main_param", None)
        if getattr(t, "main_param_sharded", False):
            return main.reshape(-1) if isinstance(main, torch.Tensor) else _empty(t)
        return main if isinstance(main, torch.Tensor) else t

    def partitioned(self, p: Param, kind: str) -> bool:
        t = p.tensor
        if kind == "weight":
            return bool(getattr(t, "main_param_sharded", False))
        return self._ranges is not None and self._ranges(t) is not None

    def partitioned_rows(self, params: list[Param]) -> frozenset[int]:
        return _rows(self, params)


class ZeroPartitions(GradSource):
    """DeepSpeed: each gradient through this rank's ZeRO partition (see
    the module doc); a ZeRO-3 weight through its local partition."""

    moved = True
    where = "the local ZeRO partition"

    def __init__(self, zero3_optimizer: Any = None, masters: dict[int, torch.Tensor] | None = None) -> None:
        self._z3 = zero3_optimizer  # the ZeRO-3 optimizer, where the parameters carry none
        self._masters = masters or {}  # id(parameter) -> its whole fp32 master (DeepSpeed's fp16/bf16 optimizers)

    def grad(self, p: Param) -> torch.Tensor | None:
        try:
            return self._grad(p.tensor)
        except DEEPSPEED_REFUSALS:  # a parameter outside its optimizer has no partition: no gradient to read
            return None

    def _grad(self, t: torch.Tensor) -> torch.Tensor | None:
        if hasattr(t, "ds_id"):  # ZeRO-3
            optimizer = getattr(t, "_z3_optimizer", None) or self._z3
            if optimizer is None or not t.requires_grad:
                return None
            return _valid_part(t, optimizer.get_local_fp32_grad_for_param(t))
        mapping = getattr(t, "_hp_mapping", _ABSENT)
        if mapping is _ABSENT:  # not partitioned (stage 0): DeepSpeed leaves it in .grad
            return t.grad
        if mapping is None:  # no element of this parameter is in this rank's partition
            return _empty(t)
        # raises ValueError outside "immediately after backward and before engine step"
        fragment = mapping.get_lp_grad_fragment(t._index_in_param_group).reshape(-1)
        address = mapping.lp_fragment_address
        if fragment.numel() == t.numel() and fragment.numel() != address.numel:
            # the bf16 optimizer keeps a full buffer per rank: its own fragment is the part this rank owns
            fragment = fragment.narrow(0, address.start, address.numel)
        return fragment

    def weight(self, p: Param) -> torch.Tensor | None:
        """The fp32 master weight the optimizer updates, where DeepSpeed keeps
        one (a bf16 copy may not move at a step that moves its master)."""
        t = p.tensor
        if id(t) in self._masters:
            return self._masters[id(t)]
        try:
            if hasattr(t, "ds_tensor"):
                optimizer = getattr(t, "_z3_optimizer", None) or self._z3
                if optimizer is not None and t.requires_grad:
                    return _valid_part(t, optimizer.get_local_fp32_param(t))
                return _valid_part(t, t.ds_tensor)
            mapping = getattr(t, "_hp_mapping", _ABSENT)
            if mapping is None:
                return _empty(t)
            if mapping is not _ABSENT:
                return mapping.get_hp_fragment().reshape(-1)
        except DEEPSPEED_REFUSALS:  # outside the optimizer: the model's own copy
            if hasattr(t, "ds_tensor"):
                return _valid_part(t, t.ds_tensor)
        return t

    def partitioned(self, p: Param, kind: str) -> bool:
        t = p.tensor
        return hasattr(t, "ds_id") or hasattr(t, "_hp_mapping")

    def partitioned_rows(self, params: list[Param]) -> frozenset[int]:
        return _rows(self, params)


def _rows(source: GradSource, params: list[Param]) -> frozenset[int]:
    return frozenset(
        2 * p.index + (kind == "weight") for p in params for kind in ("grad", "weight") if source.partitioned(p, kind)
    )


_ABSENT = object()
# What DeepSpeed raises for a parameter it holds no partition of, or outside a step.
DEEPSPEED_REFUSALS = (KeyError, ValueError, AttributeError, IndexError, AssertionError)


def _empty(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=t.device)


def _valid_part(t: torch.Tensor, part: torch.Tensor | None) -> torch.Tensor | None:
    """A ZeRO-3 parameter's local partition without the padding that rounds
    every rank's partition up to one size (the last ranks' hold zeros past
    the parameter's end)."""
    if part is None:
        return None
    part = part.reshape(-1)
    size = int(getattr(t.ds_tensor, "ds_numel", part.numel()))
    group = getattr(t, "ds_process_group", None)
    rank = torch.distributed.get_rank(group) if torch.distributed.is_initialized() else 0
    valid = max(0, min(size, int(t.ds_numel) - rank * size))
    return part.narrow(0, 0, min(valid, part.numel()))


def source_for(params: list[Param]) -> GradSource:
    """The convention the parameters themselves show: DeepSpeed's partition
    marks, Megatron's main_grad, else .grad."""
    for p in params:
        if hasattr(p.tensor, "ds_id") or hasattr(p.tensor, "_hp_mapping"):
            return ZeroPartitions()
    if any(isinstance(getattr(p.tensor, "main_grad", None), torch.Tensor) for p in params):
        return MainGrad()
    return GradSource()


class Reached:
    """Which parameters a backward pass reached since the step began: a
    hook on each parameter's gradient (one set add, no tensor read). For a
    source whose frameworks keep a buffer for every parameter."""

    def __init__(self, params: list[Param], hooks: Hooks) -> None:
        self.seen: set[int] = set()
        self._hooks = hooks
        self._handles: dict[int, Any] = {}  # parameter index -> its hook's handle
        self.attach(params)

    def attach(self, params: list[Param]) -> None:
        """Hooks `params` afresh (the model changed)."""
        for h in self._handles.values():
            self._hooks.remove(h)
        self._handles = {}
        self.cover(params)

    def cover(self, params: list[Param]) -> None:
        """Hooks the parameters that require a gradient and have no hook yet
        (one unfrozen since): from the next backward pass on."""
        for p in params:
            if p.tensor.requires_grad and p.index not in self._handles:
                handle = p.tensor.register_hook(weak_hook(self, "_on_grad", p.index))
                self._handles[p.index] = self._hooks.keep(handle)

    def _on_grad(self, index: int, grad: torch.Tensor) -> None:
        self.seen.add(index)


class GradReads:
    """A Monitor's reads of its parameters' gradients and weights at a
    step: through `source`, and, where the source keeps a buffer for every
    parameter (`moved`), with what backward reached (`Reached`)."""

    def __init__(self, source: GradSource, params: list[Param], hooks: Hooks) -> None:
        self.source = source
        self.reached = Reached(params, hooks) if source.moved else None
        self._partitioned: tuple[list[Param], frozenset[int]] | None = None

    def partitioned(self, params: list[Param]) -> frozenset[int]:
        """source.partitioned_rows(params), worked out once per list of
        parameters (the Monitor makes a new list when the model changes)."""
        if self._partitioned is None or self._partitioned[0] is not params:
            self._partitioned = (params, self.source.partitioned_rows(params))
        return self._partitioned[1]

    def gather(
        self, params: list[Param], record: StepRecord | None = None, backward: GradState | None = None,
        *, at_step: bool = True,
    ) -> tuple[list[torch.Tensor], list[int], list[int]]:
        """A step's tensors to scan at their Slot rows, and the parameters
        that require a gradient and have none. At the step (`at_step`): every
        gradient there is and every weight; a gradient that backward left
        (`backward`: the gradients as backward left them) and that is gone
        now goes into `record.cleared`, with its cause. As backward ends
        (not `at_step`): the gradients alone, and none where a framework
        moves them at its step (only which parameters backward did not reach)."""
        tensors: list[torch.Tensor] = []
        slots: list[int] = []
        missing: list[int] = []
        source, reached = self.source, self.reached
        for p in params:
            if reached is not None:
                # None: outside the framework's optimizer, which keeps none (that finding says so)
                g = source.grad(p) if at_step and p.index in reached.seen else None
                if p.index not in reached.seen and p.tensor.requires_grad:
                    missing.append(p.index)
            else:
                g = source.grad(p)
                if g is None and backward is not None and record is not None and backward[p.index] is not None:
                    record.cleared.append(p.index)
                    record.none_causes[p.index] = cleared_cause(p.name)
                elif g is None and p.tensor.requires_grad:
                    missing.append(p.index)
            if g is not None:
                tensors.append(g)
                slots.append(grad_row(p.index))
            w = source.weight(p) if at_step else None
            if w is not None:
                tensors.append(w)
                slots.append(weight_row(p.index))
        return tensors, slots, missing

    def state(self, params: list[Param]) -> GradState:
        """The gradients as they are now (backward.py), to tell later whether
        the loop touched them; nothing to follow where a framework moves them."""
        return [None] * len(params) if self.source.moved else grad_state(params)

    def touched(self, params: list[Param], state: GradState) -> bool:
        """Whether the loop touched the gradients since `state` (backward.py);
        never where a framework moves them: its step alone ends a step."""
        return not self.source.moved and grads_touched(params, state)

    def stepped(self, params: list[Param]) -> None:
        """A step ended: the next one's backward passes start afresh."""
        if self.reached is not None:
            self.reached.seen.clear()
            self.reached.cover(params)

    def renumber(self, params: list[Param], new_index: dict[int, int]) -> None:
        """The model changed: hook its parameters as they are now."""
        if self.reached is not None:
            seen = {new_index[i] for i in self.reached.seen if i in new_index}
            self.reached.attach(params)
            self.reached.seen = seen
