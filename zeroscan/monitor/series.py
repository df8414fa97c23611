"""Per-parameter series over the kept steps, read column-wise.

The rules ask, per parameter, how many steps in a row its gradient has been
exactly zero, how long its weight has not changed, how its gradient norm
moved; the report shows every gradient's norm and zero fraction at every
kept step. For 10k parameters x 64 steps a loop over rows is far too slow,
so each question is answered for every parameter at once from the steps'
RowTables (table.py), with values equal to what a Row would give.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import numpy as np

from zeroscan.monitor.step_record import Param, StepRecord
from zeroscan.monitor.table import RowTable, fields, fraction
from zeroscan.result_row import Column, Row

COUNT_COLUMNS = [Column.NUMEL, Column.ZEROS]


def _table(r: StepRecord) -> RowTable:
    return r.rows if r.rows is not None else RowTable([])


class Series:
    """The per-parameter series of `records` (decoded, oldest first) for
    `params` parameters; each is computed once, when first asked for."""

    def __init__(self, records: list[StepRecord], params: int) -> None:
        self.records = records
        self.params = params
        self.grad_rows = 2 * np.arange(params)

    @cached_property
    def _grad_counts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """numel, zeros (int64 [R, P]) and present (bool [R, P]) of every gradient."""
        shape = (len(self.records), self.params)
        numel, zeros = np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)
        present = np.zeros(shape, dtype=bool)
        for k, r in enumerate(self.records):
            words, present[k] = _table(r).gather(self.grad_rows, COUNT_COLUMNS)
            numel[k], zeros[k] = words[:, 0], words[:, 1]
        return numel, zeros, present

    @cached_property
    def _zero_streaks(self) -> np.ndarray:
        """int [P]: steps in a row, up to the latest, where the gradient is all zero."""
        numel, zeros, present = self._grad_counts
        streak = np.zeros(self.params, dtype=np.int64)
        going = np.ones(self.params, dtype=bool)
        for k in reversed(range(len(self.records))):
            going &= present[k] & (zeros[k] == numel[k])
            streak += going
        return streak

    def zero_streak(self, param: int) -> int:
        return int(self._zero_streaks[param])

    def zero_counts(self, param: int) -> list[int]:
        """The gradient's exact-zero count at each step where it has one."""
        _, zeros, present = self._grad_counts
        return zeros[present[:, param], param].tolist()

    def grad_present(self) -> np.ndarray:
        """bool [R, P]: whether each parameter had a gradient scanned at each step."""
        return self._grad_counts[2]

    def had_grad(self, param: int) -> int:
        """At how many steps before the latest the parameter had a gradient."""
        _, _, present = self._grad_counts
        return int(present[:-1, param].sum())

    @cached_property
    def _weight_same(self) -> np.ndarray:
        """bool [R - 1, P]: the weight's words at step k + 1 equal those at step k (both scanned)."""
        rows = self.grad_rows + 1
        same = np.zeros((max(len(self.records) - 1, 0), self.params), dtype=bool)
        before, had = _table(self.records[0]).gather(rows) if self.records else (None, None)
        for k, r in enumerate(self.records[1:]):
            words, has = _table(r).gather(rows)
            same[k] = had & has & (words == before).all(axis=1)
            before, had = words, has
        return same

    @cached_property
    def _unchanged(self) -> np.ndarray:
        """int [P]: how many of the latest steps hold a bit-identical scan of the weight."""
        if not self.records:
            return np.zeros(self.params, dtype=np.int64)
        _, last = _table(self.records[-1]).gather(self.grad_rows + 1, [Column.NUMEL])
        count = last.astype(np.int64)
        going = last.copy()
        for k in reversed(range(len(self.records) - 1)):
            going &= self._weight_same[k]
            count += going
        return count

    def unchanged_for(self, param: int) -> int:
        return int(self._unchanged[param])

    def weight_same_last(self, param: int) -> bool:
        """Whether the weight's scan at the latest step equals the one at the step before."""
        return len(self.records) >= 2 and bool(self._weight_same[-1, param])

    def grad_norms(self) -> np.ndarray:
        """float64 [R, P]: every gradient's norm, NaN where it has none."""
        out = np.full((len(self.records), self.params), np.nan)
        for k, r in enumerate(self.records):
            words, present = _table(r).gather(self.grad_rows)
            out[k, present] = fields(words[present])["norm"]
        return out

    def zero_fractions(self) -> tuple[np.ndarray, np.ndarray]:
        """float64 [R, P] zeros / numel, and where a gradient with values is present."""
        numel, zeros, present = self._grad_counts
        return fraction(zeros, numel), present & (numel > 0)


def tensor_rows(params: list[Param], rec: StepRecord) -> list[dict[str, Any]]:
    """Report.tensors: the latest scan of each gradient and weight (in
    parameter order) and of each activation; see tensor_dict."""
    table = _table(rec)
    rows = np.arange(2 * len(params))
    words, present = table.gather(rows)
    rows, words = rows[present], words[present]
    f = fields(words)
    numel = f["numel"]
    columns = {
        "numel": numel,
        "zero_fraction": fraction(f["zeros"], numel),
        "subnormal_fraction": fraction(f["subnormal"], numel),
        "near_zero_fraction": fraction(f["near_zero"], numel),
        "nan": f["nan"],
        "inf": f["posinf"] + f["neginf"],
        **{k: f[k] for k in ("norm", "mean", "std", "min_abs", "max_abs")},
    }
    values = [columns[k].tolist() for k in columns]
    out = [
        {"name": params[row // 2].name, "kind": "weight" if row % 2 else "grad", **dict(zip(columns, entry))}
        for row, entry in zip(rows.tolist(), zip(*values))
    ]
    for act in rec.acts or []:
        out.append(tensor_dict(act.name, "activation", act.output))
    return out


def history(params: list[Param], shown: list[StepRecord]) -> dict[str, Any]:
    """Report.history: per step shown, every gradient's norm, zero and
    subnormal fraction (NaN where it had none), for the parameters that had
    a gradient at any of the steps. The keys are those of the report's
    tensor rows ("zero_fraction", "subnormal_fraction"), so one quantity has
    one name; "grad_norm" is the gradient rows' "norm"."""
    grad_rows = 2 * np.arange(len(params))
    had = np.zeros(len(params), dtype=bool)
    for r in shown:
        had |= _table(r).gather(grad_rows, [Column.NUMEL])[1]
    kept = np.flatnonzero(had)
    grad_norm, zero_fraction, subnormal_fraction = [], [], []
    for r in shown:
        words, present = _table(r).gather(grad_rows[kept])
        f = fields(words)
        for out, values in (
            (grad_norm, f["norm"]),
            (zero_fraction, fraction(f["zeros"], f["numel"])),
            (subnormal_fraction, fraction(f["subnormal"], f["numel"])),
        ):
            values[~present] = np.nan
            # A row of zeros (no gradient underflows, say) shares one 0.0: 10k parameters
            # x 64 steps of Python floats are 15 MB per series.
            out.append([0.0] * len(values) if not values.any() else values.tolist())
    return {
        "steps": [r.step for r in shown],
        "names": [params[i].name for i in kept.tolist()],
        "grad_norm": grad_norm,
        "zero_fraction": zero_fraction,
        "subnormal_fraction": subnormal_fraction,
    }


def tensor_dict(name: str, kind: str, f: Row) -> dict[str, Any]:
    """One entry of Report.tensors."""
    n = int(f["numel"])
    return {
        "name": name,
        "kind": kind,
        "numel": n,
        "zero_fraction": int(f["zeros"]) / n if n else 0.0,
        "subnormal_fraction": int(f["subnormal"]) / n if n else 0.0,
        "near_zero_fraction": int(f["near_zero"]) / n if n else 0.0,
        "nan": int(f["nan"]),
        "inf": int(f["posinf"]) + int(f["neginf"]),
        "norm": float(f["norm"]),
        "mean": float(f["mean"]),
        "std": float(f["std"]),
        "min_abs": float(f["min_abs"]),
        "max_abs": float(f["max_abs"]),
    }
