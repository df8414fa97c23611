"""When the Monitor reads a step's gradients: once, where the rules want them.

The rules judge a step that the optimizer took by its gradients as
optimizer.step() sees them: after clipping, after GradScaler's unscaling
(which bumps no version counter, so no cheap check can tell it happened),
after any write to .grad. The Monitor reads them there, from its step
pre-hook, once, whatever the number of backward passes that accumulated
them, in the scan that also reads every weight.

A step that optimizer.step() never takes (GradScaler skipped it on inf/NaN,
a check of the user's own, a backward pass of a GAN's other model) passes no
hook: the Monitor learns of it only once the gradients were reset, at the
model's next forward or backward pass. So it holds on to the gradient
tensors that backward left (`Pending`, references: nothing is copied) and
reads those then. A loop that resets gradients by letting go of them
(zero_grad() sets .grad to None, torch's default since 2.0) leaves them
intact in the Monitor's hands. A loop that zeroes them in place
(zero_grad(set_to_none=False)) leaves nothing to read; so until the Monitor
has seen how the loop resets gradients after a step (`ResetHabit`), and for
good once it has seen them zeroed in place, it also reads them when backward
ends, as it always did: two reads a step, the first one for a skipped step.

What holding them costs: after a step that was not taken, the gradients the
loop let go stay alive until the model's next forward pass (its next
backward pass, where zero_grad() runs between the two); after a step taken,
nothing (they were read and dropped at the step). The blind spot: a loop
seen letting go of its gradients that later zeroes in place those of a step
that optimizer.step() skipped; that step is read after the reset (zeros), and
the Monitor reads at backward end from then on.

`witness_of`: while reading is deferred, the first values of a few
gradients are read when backward ends. When every gradient of a step is
exactly zero, they tell whether backward() left them so or a change after it
did (clip_grad_norm_ with max_norm=0), as the full scan at backward end
used to (whole_model.all_zero_finding reads them as the rows `before`).

What each rule sees, then: the gradient rules, the gradients optimizer.step()
takes; the skipped-steps rule and the history of a skipped step, the
gradients backward left (unscaled in place, if GradScaler ran: inf and NaN
stay); grad_cleared and accumulation, which tensors backward left and their
version counters (backward.py), nothing read; the weight rules, every weight
read at every monitored step, as before (nothing cheaper tells a weight
changed: fused optimizers and writes through .data bump no version counter,
and an update below a weight's resolution leaves its bits as they were). A
gradient freed (resize_(0)) between backward and the step is left out with a
note, where a read at backward end kept its row.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from zeroscan.monitor import scanner
from zeroscan.monitor.backward import GradState, grad_state, reset_kind
from zeroscan.monitor.step_record import Param, Scan, Slot, StepRecord, renumber
from zeroscan.ops import is_dtensor, scannable_form

WITNESSES = 8  # gradients whose first values are read when backward ends, at most
WITNESS_VALUES = 64  # values read of each


class Pending(NamedTuple):
    """The gradients as backward left them, held until the Monitor knows
    whether optimizer.step() takes them: the tensors and their Slot rows."""

    tensors: list[torch.Tensor]
    slots: list[int]

    def renumbered(self, new_index: dict[int, int]) -> Pending:
        """After the model changed: a parameter gone drops its gradient."""
        kept = [(t, Slot.grad(new_index[Slot.at_row(r).param]).row) for t, r in zip(self.tensors, self.slots)
                if Slot.at_row(r).param in new_index]
        return Pending([t for t, _ in kept], [r for _, r in kept])


class OpenStep(NamedTuple):
    """A step whose backward pass has finished and whose optimizer step has
    not run yet: its record (None when the step is not monitored), the
    gradients as backward left them, and the gradient tensors held unread
    until the Monitor knows whether optimizer.step() takes them (None: read
    when backward ended, or not monitored)."""

    record: StepRecord | None
    grads: GradState
    pending: Pending | None = None

    def renumbered(self, new_index: dict[int, int], requires_grad: tuple[bool, ...], now: GradState) -> OpenStep:
        """This open step after the model changed (parameter i is now
        new_index[i]; `now`: the new parameters' gradients as they are now,
        kept for the ones that are new)."""
        old = {new_index[i]: was for i, was in enumerate(self.grads) if i in new_index}
        grads = [old[j] if j in old else state for j, state in enumerate(now)]
        if self.record is not None:
            renumber(self.record, new_index, requires_grad)
        pending = None if self.pending is None else self.pending.renumbered(new_index)
        return OpenStep(self.record, grads, pending)


class ResetHabit:
    """How the training loop resets gradients after a step, as seen so far.
    `defer` (read once, at the step) once the loop was seen letting go of
    them; never again once it was seen zeroing them in place. Watching costs
    one pass over the parameters per step until the habit is known."""

    def __init__(self) -> None:
        self.defer = False
        self.known = False
        self._watching: GradState | None = None

    def stepped(self, params: list[Param]) -> None:
        """optimizer.step() takes the gradients as they are now: the loop resets them next."""
        if not self.known:
            self._watching = grad_state(params)

    def observe(self, params: list[Param], *, last: bool = False) -> None:
        """A forward pass (or, `last`, a backward pass) of the model begins:
        what became of the gradients of the step taken last. A backward pass
        into gradients left untouched is accumulation across steps, which
        tells nothing: the watch ends there."""
        if self._watching is None:
            return
        kind = reset_kind(params, self._watching)
        if kind is not None or last:
            self._watching = None
        if kind is not None:
            self.learn(in_place=kind == "in place")

    def learn(self, *, in_place: bool) -> None:
        if in_place:
            self.defer = False
        elif not self.known:
            self.defer = True
        self.known = True

    def forget(self) -> None:
        """The model's parameters changed: what was watched is numbered otherwise."""
        self._watching = None


def witness_of(tensors: list[torch.Tensor], slots: list[int]) -> Scan | None:
    """A scan of the first WITNESS_VALUES values of up to WITNESSES of the
    gradients `tensors` (at Slot rows `slots`): views (nothing copied) of
    plain contiguous ones spread over the list, on the device of the first
    of them, preferring those larger than WITNESS_VALUES (no gradient read
    whole twice). It looks at 2 * WITNESSES gradients at most, so that its
    cost does not grow with the model. None when none will do, or the scan
    fails (a rare device error: the step's own scan meets it too)."""
    looked = range(0, len(tensors), max(1, len(tensors) // (2 * WITNESSES)))
    large: list[tuple[torch.Tensor, int]] = []
    small: list[tuple[torch.Tensor, int]] = []
    device = None
    for k in looked[: 2 * WITNESSES]:
        t = tensors[k]
        if is_dtensor(t) or t.layout != torch.strided or not t.is_contiguous() or t.numel() == 0:
            continue
        ready, _ = scannable_form(t)
        if ready is None or (device is not None and ready.device != device):
            continue
        device = ready.device
        (large if ready.numel() > WITNESS_VALUES else small).append((ready.reshape(-1), slots[k]))
        if len(large) == WITNESSES:
            break
    chosen = (large or small)[:WITNESSES]
    if not chosen:
        return None
    try:
        return scanner.scan_one_device([t[:WITNESS_VALUES] for t, _ in chosen], [row for _, row in chosen], False)
    except (RuntimeError, ValueError, TypeError):
        return None
