"""How the Monitor scans a step's tensors into its StepRecord, reading nothing back.

One native call for the whole step (step_record.scan_one_device) until that
fails once (several devices, or a tensor that needs preparing or cannot be
scanned), then one call per device (step_record.scan_by_device, which leaves
out a tensor it cannot scan, with a note). Across ranks each tensor is
first cut to this rank's part (ranks.RankExchange.local_parts), and the
record keeps which slots are sharded and which shards another rank counts.
"""

from __future__ import annotations

import torch

from zeroscan.monitor import step_record
from zeroscan.monitor.ranks import RankExchange
from zeroscan.monitor.step_record import Param, Scan, StepRecord


class Scanner:
    """The scans of one Monitor (`ranks`: its exchange across ranks, or None)."""

    def __init__(self, ranks: RankExchange | None) -> None:
        self.ranks = ranks
        self.fast = True  # one native call for the whole step, until that fails once

    def scan_into(
        self,
        record: StepRecord,
        tensors: list[torch.Tensor],
        slots: list[int],
        params: list[Param],
        histogram: bool,
        *,
        collective: bool = True,
        partitioned: frozenset[int] = frozenset(),
    ) -> None:
        """Scans `tensors` (at Slot rows `slots`) of the Monitor's `params`
        into `record`, with their histograms when `histogram`; collective:
        see RankExchange.local_parts; `partitioned`: the rows whose tensor is
        this rank's piece of one split across the group (grad_source.py),
        merged as a DTensor's shards are."""
        with torch.no_grad():
            if self.ranks is None:
                record.add(self._run(tensors, slots, params, record, histogram))
            else:
                local, slots, sharded, uncounted = self.ranks.local_parts(
                    tensors, slots, collective=collective, partitioned=partitioned
                )
                record.add(self._run(local, slots, params, record, histogram))
                record.sharded += sharded
                record.uncounted += uncounted

    def _run(
        self, tensors: list[torch.Tensor], slots: list[int], params: list[Param], record: StepRecord, histogram: bool
    ) -> list[Scan]:
        if not tensors:
            return []
        if self.fast:
            try:
                return [step_record.scan_one_device(tensors, slots, histogram)]
            except (RuntimeError, ValueError, TypeError):
                # Several devices, or a tensor that needs preparing or cannot be scanned
                # (scan_by_device leaves that one out): from now on, one scan per device.
                self.fast = False
        return step_record.scan_by_device(tensors, slots, params, record, histogram)
