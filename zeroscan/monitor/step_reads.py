"""What the Monitor reads into a step's record, once it has decided to read.

Which tensors a step has is grad_source.GradReads.gather (one function, as
backward ends and at the step); they are scanned into the record by
scanner.py, reading nothing back; why a gradient that should be there is
not is asked of the cause analysis (causes.py) while the engine can tell.
When each read happens is the Monitor's (monitor.py) and deferred.py's.
"""

from __future__ import annotations

import copy

import torch

from zeroscan.monitor.activations import ActivationScans
from zeroscan.monitor.backward import BackwardWatch, GradState
from zeroscan.monitor.causes import CauseFinder
from zeroscan.monitor.deferred import Pending, witness_of
from zeroscan.monitor.grad_source import GradReads
from zeroscan.monitor.scanner import Scanner
from zeroscan.monitor.step_record import Param, StepRecord, decode_records


class StepReads:
    """A Monitor's reads: `reads` says where each tensor is, `scanner` scans
    them, with their histograms when `histogram`."""

    def __init__(self, reads: GradReads, scanner: Scanner, histogram: bool) -> None:
        self.reads = reads
        self.scanner = scanner
        self.histogram = histogram

    def at_backward_end(
        self, record: StepRecord, params: list[Param], causes: CauseFinder, defer: bool, exchanging: bool
    ) -> Pending | None:
        """The gradients as backward left them: read into `record` now, held
        to be read later (Pending, where `defer`), or left to the step where
        a framework moves them (grad_source.py)."""
        tensors, slots, missing = self.reads.gather(params, at_step=False)
        if missing:  # require grad, have none (or none reached): the engine says why while it can
            causes.backward_finished(missing)
        pending = None
        if not self.reads.source.moved:  # else the framework's step reads them where it moved them
            if defer:  # read at optimizer.step(), or once the loop lets them go
                if not exchanging:  # across ranks no row `before` is kept to read it
                    record.witness = witness_of(tensors, slots)
                pending = Pending(tensors, slots)
            else:
                self.scanner.scan_into(record, tensors, slots, params, self.histogram)
        record.requires_grad = tuple(p.tensor.requires_grad for p in params)
        return pending

    def held(self, record: StepRecord, pending: Pending, params: list[Param]) -> None:
        """Gradients held since backward ended (deferred.py), read into `record`."""
        self.scanner.scan_into(record, pending.tensors, pending.slots, params, self.histogram)

    def at_step(
        self,
        record: StepRecord,
        params: list[Param],
        loss: torch.Tensor | None,
        backward: GradState | None,
        activations: ActivationScans,
        causes: CauseFinder,
        watch: BackwardWatch,
        *,
        collective: bool = True,
    ) -> None:
        """One native scan per device of every gradient and weight, into
        `record`; never reads it. `backward`: the gradients as the step's
        backward pass left them, where the Monitor saw it end.
        collective=False (a report() on some ranks only) leaves out what only
        a collective could read (a Partial DTensor)."""
        tensors, slots, missing = self.reads.gather(params, record, backward)
        record.requires_grad = tuple(p.tensor.requires_grad for p in params)
        partitioned = self.reads.partitioned(params)
        self.scanner.scan_into(
            record, tensors, slots, params, self.histogram, collective=collective, partitioned=partitioned
        )
        record.activations = activations.scans
        record.notes.extend(activations.notes)
        if missing:
            seen = (backward is not None) if watch.active else None
            record.none_causes.update(causes.explain(missing, loss, seen, watch.fired))

    def now(
        self,
        open_record: StepRecord | None,
        params: list[Param],
        activations: ActivationScans,
        causes: CauseFinder,
        watch: BackwardWatch,
    ) -> StepRecord:
        """With no step recorded, a record of the gradients as they are now,
        decoded: a copy of the open step's, whose gradients were read when
        backward ended (the open step goes on, and its merge is read later;
        no step has been taken yet, so the Monitor does not know yet whether
        they may wait: deferred.py), else a fresh scan, on this rank alone."""
        if open_record is not None and not self.reads.source.moved:
            now = copy.copy(open_record)
        else:
            now = StepRecord(-1)
            now.stepped = None
            self.at_step(now, params, None, None, activations, causes, watch, collective=False)
        decode_records([now])
        return now
