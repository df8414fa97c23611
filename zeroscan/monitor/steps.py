"""Whether the optimizer steps ran, as the Monitor's rules see it.

A record is a step taken (optimizer.step() or Monitor.step() ran on its
gradients), a step skipped (its gradients were reset after backward with no
step, and they held inf/NaN: GradScaler), or a backward pass that no step
followed, with finite gradients, which is no step of this model (a GAN's
generator pass through the monitored discriminator). A step taken on
inf/NaN gradients that left the weights finite (zeroscan.guard) is reported
as skipped too. Which records the
per-parameter rules judge, which the history shows, the skipped-steps and
no-step findings, and where non-finite gradients began live here.
"""

from __future__ import annotations

import numpy as np

from zeroscan.monitor.step_record import Param, StepRecord, grad_row
from zeroscan.monitor.report import GLOBAL_NAME, Finding, Thresholds
from zeroscan.verdicts import Cause, Severity
from zeroscan.words import count_noun, listed


def nonfinite_grads(params: list[Param], r: StepRecord) -> list[str]:
    """The parameters whose gradient holds NaN or inf at step record `r`."""
    if r.rows is None:
        return []
    return [params[i].name for i in np.flatnonzero(r.rows.nonfinite_grads(len(params))).tolist()]


def skipped(params: list[Param], r: StepRecord) -> bool:
    """A step whose optimizer.step() did not run because its gradients were
    not finite (GradScaler). A backward pass that no step followed, with
    finite gradients (a GAN's generator pass through the monitored
    discriminator, say), is not a training step of this model."""
    return r.stepped is False and bool(nonfinite_grads(params, r))


def judged_records(params: list[Param], records: list[StepRecord]) -> list[StepRecord]:
    """The records the per-parameter rules judge: the steps the optimizer
    took; else the skipped ones; else whatever backward passes were seen."""
    stepped = [r for r in records if r.stepped]
    if stepped:
        return stepped
    return [r for r in records if skipped(params, r)] or records


def history_records(params: list[Param], records: list[StepRecord]) -> list[StepRecord]:
    """The records a report's history shows: the steps taken or skipped (a
    backward pass that no step followed is not a step of this model); all
    of them when there are none such."""
    return [r for r in records if r.stepped or skipped(params, r)] or records


def nothing_ran(params: list[Param], records: list[StepRecord]) -> bool:
    """Whether the report has only the scan report() made itself (no step or
    backward pass was recorded) and it found no gradient: one fact, which one
    finding states (step_findings) instead of one per parameter."""
    if len(records) != 1 or records[0].step >= 0 or records[0].rows is None:
        return False
    rows = records[0].rows
    return all(rows.row(grad_row(p.index)) is None for p in params)


def first_nonfinite(params: list[Param], records: list[StepRecord]) -> tuple[int, list[str]] | None:
    """The first of `records` (its position) whose gradients hold inf/NaN, and in which parameters."""
    for k, r in enumerate(records):
        names = nonfinite_grads(params, r)
        if names:
            return k, names
    return None


def first_nonfinite_words(records: list[StepRecord], first: tuple[int, list[str]] | None) -> str:
    if first is None:
        return "no gradient held inf/NaN"
    k, names = first
    step = records[k].step
    earlier = " (or earlier: older steps are no longer kept)" if k == 0 and step > 0 else ""
    return f"non-finite gradients first appeared at step {step}{earlier}, in {listed(names, 3)}"


def undone(params: list[Param], records: list[StepRecord], k: int) -> bool:
    """Whether optimizer.step() ran on the inf/NaN gradients of records[k] and
    the weights at the next record hold none: the update was skipped inside
    the step or undone after it (zeroscan.guard, a fused optimizer given a
    found_inf), not applied. The latest record has no next one to tell."""
    r = records[k]
    return bool(r.stepped) and k + 1 < len(records) and bool(nonfinite_grads(params, r)) and (
        not nonfinite_weights(params, records[k + 1])
    )


def nonfinite_weights(params: list[Param], r: StepRecord) -> bool:
    """Whether a weight scanned at record `r` holds NaN or inf."""
    return r.rows is not None and bool(r.rows.nonfinite_weights(len(params)).any())


def skipped_words(params: list[Param], skips: list[StepRecord], most: int = 6) -> str:
    """Each of `skips` by its step number and the gradients that held inf/NaN."""
    shown = [f"step {r.step}: {listed(nonfinite_grads(params, r), 3)}" for r in skips[:most]]
    more = f"; and {count_noun(len(skips) - most, 'more step')}" if len(skips) > most else ""
    return "; ".join(shown) + more


def step_findings(params: list[Param], records: list[StepRecord], th: Thresholds) -> list[tuple[int, Finding]]:
    """Whether the optimizer steps ran: skipped steps, or no step at all.

    A step is skipped when its gradients hold inf/NaN and either
    optimizer.step() did not run (GradScaler, or a check of the user's own)
    or it ran and left the weights finite (`undone`: zeroscan.guard). Every
    such step of the kept history is listed, whether or not the latest one is."""
    if nothing_ran(params, records):
        return [(-1, Finding(GLOBAL_NAME, "grad", Severity.WARNING, Cause.NO_STEP, (
            "nothing has run yet: no training step was seen and no parameter has a gradient (no backward "
            "pass through the model); gradients are judged once training steps have run (optimizer.step() "
            "after backward(), or Monitor.step() in a loop without an optimizer)"
        )))]
    closed = [r for r in records if r.stepped is not None and (r.stepped or skipped(params, r))]
    # While the latest gradients still hold inf/NaN, the findings about them (and
    # where they began) say it; steps taken on them are not called skipped then.
    latest_bad = bool(nonfinite_grads(params, records[-1]))
    guarded = set() if latest_bad else {id(r) for k, r in enumerate(records) if undone(params, records, k)}
    skips = [r for r in closed if not r.stepped or id(r) in guarded]
    run = 0
    for r in reversed(closed):
        if r.stepped and id(r) not in guarded:
            break
        run += 1
    first = first_nonfinite(params, records)
    first_words = first_nonfinite_words(records, first)
    if skips:
        n, m = len(skips), len(closed)
        if n == m:
            severity, what = Severity.ERROR, (
                f"optimizer.step() was skipped at every one of the {m} monitored steps: nothing trains"
            )
        elif run >= th.skip_run:
            severity, what = Severity.WARNING, (
                f"optimizer.step() was skipped at the last {run} monitored steps ({n} of {m} in all)"
            )
        elif guarded:
            severity, what = Severity.INFO, f"optimizer.step() was skipped at {n} of {m} monitored steps"
        else:
            severity, what = Severity.INFO, (
                f"optimizer.step() was skipped at {n} of {m} monitored steps (a GradScaler calibrating "
                "its loss scale skips a few, early in training)"
            )
        by_framework = sorted({r.skipped_by for r in skips if r.skipped_by and not r.stepped})
        if by_framework and not guarded and run < th.skip_run and n < m:
            what = f"optimizer.step() was skipped at {n} of {m} monitored steps"
        by_scaler = sum(1 for r in skips if not r.stepped)
        how = []
        if by_framework:
            how.append(f"{' and '.join(by_framework)} skipped {'it' if by_scaler == 1 else 'them'} itself: its "
                       "step checks the gradients for inf/NaN (an overflow) and updates nothing then")
        elif by_scaler:
            how.append(
                f"{'at ' + str(by_scaler) + ' of them ' if by_scaler < n else ''}optimizer.step() did not run: "
                "GradScaler skips a step whose gradients hold inf/NaN and lowers its scale, as does a check of "
                "your own"
            )
        if n - by_scaler:
            how.append(
                f"{'at ' + str(n - by_scaler) + ' of them ' if by_scaler else ''}optimizer.step() ran and the "
                "weights stayed finite: the update was skipped or undone (zeroscan.guard, or a fused optimizer "
                "given found_inf)"
            )
        return [(-1, Finding(GLOBAL_NAME, "grad", severity, Cause.SKIPPED_STEPS, (
            f"{what}, because their gradients held inf/NaN ({skipped_words(params, skips)}); "
            f"{'; '.join(how)}; {first_words}"
        )))]
    out: list[tuple[int, Finding]] = []
    if records and not any(r.stepped for r in records):
        seen = [r for r in records if r.step >= 0]
        what = (
            f"no optimizer step was seen after the {len(seen)} monitored backward passes recorded"
            if seen else "no training step was seen"
        )
        out.append((-1, Finding(GLOBAL_NAME, "grad", Severity.WARNING, Cause.NO_STEP, (
            f"{what}: neither optimizer.step() (of the Monitor's optimizer) nor Monitor.step() ran, so this "
            "report shows the gradients as they are now; call optimizer.step() after backward(), or "
            "Monitor.step() in a loop without an optimizer"
        ))))
    latest = nonfinite_grads(params, records[-1]) if records[-1].stepped else []
    if first is not None and latest and (len(latest) > 1 or first[0] != len(records) - 1):
        # Once NaN spreads, every gradient holds it: where it began is what helps.
        out.append((-1, Finding(GLOBAL_NAME, "grad", Severity.ERROR, Cause.NONFINITE, (
            f"{first_words}; at step {records[-1].step}, {count_noun(len(latest), 'gradient')} "
            f"{'holds' if len(latest) == 1 else 'hold'} inf/NaN, and "
            "each optimizer step taken with them poisons the weights"
        ))))
    return out
