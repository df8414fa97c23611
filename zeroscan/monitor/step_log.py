"""The monitored steps a Monitor keeps, and what becomes of them when the model changes.

The last `history` monitored steps, each a StepRecord of device buffers that
nobody reads until a report does (`decoded`). Across ranks, a step's merge
starts as the step ends, and its summary is all the step keeps (ranks.py);
with histograms, only the latest step keeps its fields (grad_histograms.py).
"""

from __future__ import annotations

from collections import deque

from zeroscan.monitor.grad_histograms import free_earlier_fields
from zeroscan.monitor.ranks import RankExchange, decode
from zeroscan.monitor.step_record import Param, StepRecord, renumber


class StepLog:
    """The kept records of a Monitor (`ranks`: its exchange across ranks, or None)."""

    def __init__(self, history: int, ranks: RankExchange | None, histogram: bool) -> None:
        self.records: deque[StepRecord] = deque(maxlen=history)
        self.ranks = ranks
        self.histogram = histogram

    def keep(self, record: StepRecord) -> None:
        """A monitored step ended: its record joins the log."""
        if self.ranks is not None:
            record.exchange = self.ranks.start(record)
            record.groups, record.fields = [], []  # the summary is all this step keeps
        if self.histogram:
            free_earlier_fields(self.records, record)
        self.records.append(record)

    def decoded(self) -> list[StepRecord]:
        """The kept records, oldest first, read back (a host sync, once per record)."""
        recorded = list(self.records)
        decode(recorded, self.ranks)
        return recorded

    def renumber(self, params: list[Param], new_index: dict[int, int]) -> None:
        """The model's parameters are now `params`: the kept records are read
        back (a rare host sync) and their rows renumbered (`new_index`: an
        old parameter index -> its new one)."""
        recorded = self.decoded()
        if self.ranks is not None:
            self.ranks.set_params(params)
        requires_grad = tuple(p.tensor.requires_grad for p in params)
        for r in recorded:
            renumber(r, new_index, requires_grad)
