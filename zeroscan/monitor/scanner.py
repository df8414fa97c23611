"""How the Monitor scans a step's tensors into its StepRecord, reading nothing back.

One native call for the whole step (scan_one_device) until that
fails once (several devices, or a tensor that needs preparing or cannot be
scanned), then one call per device (scan_by_device, which leaves
out a tensor it cannot scan, with a note). Across ranks each tensor is
first cut to this rank's part (ranks.RankExchange.local_parts), and the
record keeps which slots are sharded and which shards another rank counts.
"""

from __future__ import annotations

import torch

from zeroscan import ops
from zeroscan.monitor.ranks import RankExchange
from zeroscan.monitor.step_record import Param, Scan, Slot, StepRecord, Unscanned
from zeroscan.monitor.table import FieldBlock
from zeroscan.ops import scannable_form
from zeroscan.stats import device_groups
from zeroscan.words import dtype_name


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
                return [scan_one_device(tensors, slots, histogram)]
            except (RuntimeError, ValueError, TypeError):
                # Several devices, or a tensor that needs preparing or cannot be scanned
                # (scan_by_device leaves that one out): from now on, one scan per device.
                self.fast = False
        return scan_by_device(tensors, slots, params, record, histogram)


def native_many(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One native scan of tensors on one device: int64 [N, 16], not read."""
    return ops.stats_many(tensors, None)


def native_many_hist(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """native_many that also counts each tensor's histogram in the same pass:
    rows int64 [N, 16] and fields int64 [N, B] (zeroscan.histogram), not read."""
    return ops.stats_many_hist(tensors, None)


def scan_one_device(tensors: list[torch.Tensor], slots: list[int], histogram: bool) -> Scan:
    """One native call over `tensors` (at Slot rows `slots`), all on one device."""
    if not histogram:
        return Scan(slots, native_many(tensors), None)
    rows, fields = native_many_hist(tensors)
    return Scan(slots, rows, FieldBlock(fields, tuple(t.dtype for t in tensors)))


def scan_by_device(
    tensors: list[torch.Tensor], slots: list[int], params: list[Param], record: StepRecord, histogram: bool = False
) -> list[Scan]:
    """One native scan per device of what can be scanned of `tensors` (at
    Slot rows `slots`; see zeroscan.ops.scannable_form): a tensor that
    cannot be scanned goes to record.unscanned (unless the record holds its
    row from an earlier scan: a gradient freed after backward ended), and
    the rest is scanned."""
    earlier = {r for rows, _ in record.groups for r in rows}
    ready: list[torch.Tensor] = []
    rows: list[int] = []
    for t, row in zip(tensors, slots):
        form, why = scannable_form(t)
        if form is not None:
            ready.append(form)
            rows.append(row)
        elif row not in earlier:  # else the row scanned when backward ended stands
            slot = Slot.at_row(row)
            record.unscanned.append(Unscanned(params[slot.param].name, slot.kind, dtype_name(t.dtype), why))
    scans = []
    for group in device_groups(ready):
        group_rows = [rows[i] for i in group]
        try:
            scans.append(scan_one_device([ready[i] for i in group], group_rows, histogram))
        except (RuntimeError, ValueError, TypeError) as err:
            for row in group_rows:
                record.notes.append((slot_label(params, row), f"not scanned: {err}"))
    return scans


def slot_label(params: list[Param], row: int) -> str:
    """How a note names the tensor at Slot row `row`: the parameter, with ":grad" or ":weight"."""
    slot = Slot.at_row(row)
    return f"{params[slot.param].name}:{slot.kind}"
