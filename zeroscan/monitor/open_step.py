"""The step that a backward pass opened and no optimizer step has ended yet.

When backward ends, the Monitor opens a step: its record, the gradients as
backward left them (to tell later whether the loop touched them), and, while
reading can wait for optimizer.step(), the gradient tensors held unread
(deferred.py says when, and why). `OpenSteps` keeps that step and reads what
it holds the moment the loop lets the gradients go, learning as it does how
the loop resets them (deferred.ResetHabit).
"""

from __future__ import annotations

from zeroscan.monitor.backward import grads_touched, reset_kind
from zeroscan.monitor.causes import CauseFinder
from zeroscan.monitor.deferred import OpenStep, ResetHabit
from zeroscan.monitor.grad_source import GradReads
from zeroscan.monitor.step_reads import StepReads
from zeroscan.monitor.step_record import Param, StepRecord


class OpenSteps:
    """A Monitor's open step (`step`, None between an optimizer step and
    the next backward end), read through `reads`, its gradients followed
    through the GradReads those reads go through."""

    def __init__(self, reads: StepReads) -> None:
        self.reads = reads
        self.grads: GradReads = reads.reads
        self.step: OpenStep | None = None
        self.touched = False  # a backward pass began after the loop touched the open step's gradients
        self.habit = ResetHabit()  # whether the gradients can wait for optimizer.step() (deferred.py)

    def open(
        self, record: StepRecord | None, params: list[Param], causes: CauseFinder, exchanging: bool
    ) -> None:
        """Backward ended: a step opens, with `record` (None: not monitored)
        read now or its gradients held (StepReads.at_backward_end)."""
        pending = None
        if record is not None:
            pending = self.reads.at_backward_end(record, params, causes, self.habit.defer, exchanging)
        self.step = OpenStep(record, self.grads.state(params), pending)

    def take(self) -> OpenStep | None:
        """The open step, which ends now."""
        step, self.step = self.step, None
        return step

    def forward_started(self, params: list[Param]) -> None:
        self.habit.observe(params)
        step = self.step
        if step is not None and step.pending is not None and grads_touched(params, step.grads):
            self.read_held(params)  # a step not taken, its gradients let go: freed as soon as read

    def backward_started(self, params: list[Param]) -> None:
        # Read now, before this pass accumulates into .grad: gradients left as the
        # last backward pass left them mean gradient accumulation (the step goes on).
        self.habit.observe(params, last=True)
        step = self.step
        self.touched = step is not None and self.grads.touched(params, step.grads)
        if self.touched:
            self.read_held(params)  # before this pass writes gradients (into the same memory, maybe)

    def read_held(self, params: list[Param]) -> None:
        """The open step's gradients were touched with no optimizer step: its
        record reads the gradients backward left, held since (deferred.py),
        and how the loop resets them is learnt."""
        step = self.step
        if step is None or step.pending is None or step.record is None:
            return
        kind = reset_kind(params, step.grads)
        if kind is not None:  # zeroed in place: nothing of a later skip would be left to read
            self.habit.learn(in_place=kind == "in place")
        self.step = step._replace(pending=None)
        self.reads.held(step.record, step.pending, params)

    def let_go(self, params: list[Param], *, read: bool) -> None:
        """Holds no gradient from now on (the Monitor closes), reading them first where `read`."""
        if self.step is not None and self.step.pending is not None:
            if read:
                self.read_held(params)
            self.step = self.step._replace(pending=None)

    def renumber(self, params: list[Param], new_index: dict[int, int]) -> None:
        """The model's parameters are now `params` (`new_index`: an old index -> its new one)."""
        self.habit.forget()
        if self.step is not None:
            requires_grad = tuple(p.tensor.requires_grad for p in params)
            self.step = self.step.renumbered(new_index, requires_grad, self.grads.state(params))
