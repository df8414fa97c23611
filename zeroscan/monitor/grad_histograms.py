"""Monitor(histogram=True): each gradient's and weight's log2-magnitude histogram.

The Monitor's scans (step_record.py) then call stats_many_hist instead of
stats_many: the same single native pass per device also counts, for every
tensor it scans, the histogram fields of zeroscan.histogram (int64 [B] per
tensor, B the largest field count among the call's dtypes: 256 for float32
and bfloat16, 2048 once a float64 tensor is in the call). The fields stay on
the device beside the rows and, like them, are not read until report(),
which turns them into exact Histograms (Report.histograms).

A report shows the histograms of its latest step only, so when a step that
the optimizer took is recorded, the fields of every earlier record are freed:
the ring keeps fields for the latest step taken and for the backward passes
recorded after it (a run of skipped steps keeps those, `history` at most).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import distributed as dist

from zeroscan.histogram import Histogram
from zeroscan.monitor.step_record import Param, Slot, StepRecord
from zeroscan.monitor.report import histogram_key


def check_histogram(op: str, histogram: object, process_group: dist.ProcessGroup | None) -> bool:
    """The Monitor's `histogram` argument, checked."""
    if not isinstance(histogram, bool):
        raise TypeError(f"{op}: histogram must be a bool, got {type(histogram).__name__}")
    if histogram and process_group is not None:
        # Shards would merge by summing their fields, but the fields would need an
        # all_gather of their own beside the rows' one: not done yet.
        raise NotImplementedError(
            f"{op}: histogram=True is not supported with a process_group yet; pass histogram=False"
        )
    return histogram


def free_earlier_fields(kept: Iterable[StepRecord], incoming: StepRecord) -> None:
    """`incoming` joins the ring: if the optimizer took its step, no earlier
    record can be a report's latest step (steps.judged_records), so their
    histogram fields are freed."""
    if incoming.stepped:
        for r in kept:
            r.drop_histograms()


def latest_histograms(params: list[Param], rec: StepRecord) -> dict[str, Histogram]:
    """Report.histograms: the histogram of each gradient and weight of the
    decoded record `rec` (parameter order, each gradient before its weight,
    as in Report.tensors), by histogram_key; {} when scanned without."""
    table = rec.rows
    if table is None or not table.has_histograms:
        return {}
    out: dict[str, Histogram] = {}
    for row in range(2 * len(params)):
        hist = table.histogram(row)
        if hist is not None:
            slot = Slot.at_row(row)
            out[histogram_key(params[slot.param].name, slot.kind)] = hist
    return out
