"""A report from decoded step records: the findings, the latest step's
rows, the history and where a NaN was born, put together.

The Monitor decides when a report is made and which records it judges
(monitor.py); what each record means is rules.py and steps.py, whose
findings this module puts into the Report as the rules worded them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import nn

from zeroscan.monitor.causes import CauseFinder
from zeroscan.monitor.changes import Memberships
from zeroscan.monitor.grad_histograms import latest_histograms
from zeroscan.monitor.nonfinite_origin import origin_finding, pointer
from zeroscan.monitor.nonfinite_trace import StepTrace
from zeroscan.monitor.optimizer import optimizer_view
from zeroscan.monitor.report import Finding, Report, Thresholds
from zeroscan.monitor.rules import judge
from zeroscan.monitor.series import COUNT_COLUMNS, history, tensor_rows
from zeroscan.monitor.step_record import Param, StepRecord
from zeroscan.monitor.steps import history_records, judged_records
from zeroscan.monitor.unregistered import unregistered_state


def compose_report(
    params: list[Param],
    recorded: list[StepRecord],
    thresholds: Thresholds,
    optimizer: object | None,
    model: nn.Module,
    traced: list[StepTrace] | None,
    causes: CauseFinder,
    memberships: Memberships | None = None,
    notices: Sequence[Finding] = (),
    grads_from: str = ".grad",
) -> Report:
    """The Report of decoded `recorded` (oldest first, at least one), judged
    against `thresholds`; `optimizer`: the object holding the param groups
    (optimizer.param_groups_holder), None without one; `traced`: the NaN
    trace's steps, None without one; `memberships`: which param group held
    each parameter at each step (changes.py), None without an optimizer;
    `notices`: findings the Monitor made about itself (ranks.default_group);
    `grads_from`: where the gradients were read (grad_source.GradSource.where),
    said in each gradient finding's message where it is not .grad."""
    basis = judged_records(params, recorded)
    latest = basis[-1]
    explain_zeros(params, latest, causes)
    model_findings = unregistered_state(model) + list(notices)
    origin, origin_pointer = None, ""
    if traced is not None:
        found, origin = origin_finding(params, recorded, traced)
        model_findings += [found] if found is not None else []
        origin_pointer = pointer(origin, found)
    findings = judge(
        params, recorded, basis, thresholds, optimizer_view(optimizer, params), model_findings, memberships,
        origin_pointer, grads_from,
    )
    shown = history_records(params, recorded)
    return Report(
        latest.step, findings, tensor_rows(params, latest), history(params, shown),
        latest_histograms(params, latest), origin.to_dict() if origin is not None else None,
    )


def explain_zeros(params: list[Param], record: StepRecord, causes: CauseFinder) -> None:
    """Why the gradients of `record` (the step the report judges) that are
    exactly zero everywhere are so, where the cause analysis can tell."""
    record.zero_causes = {}
    if record.rows is None:
        return
    counts, present = record.rows.gather(2 * np.arange(len(params)), COUNT_COLUMNS)  # numel, zeros
    zero = np.flatnonzero(present & (counts[:, 0] > 0) & (counts[:, 1] == counts[:, 0])).tolist()
    if zero:
        record.zero_causes = causes.explain_zeros(zero)
