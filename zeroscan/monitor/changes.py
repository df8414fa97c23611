"""Mid-run changes of what trains: a parameter that trained and then stopped.

A parameter trains at a monitored step when it requires grad, has a
gradient, and is in the optimizer in a param group whose lr is not 0. One
that trained at some kept step and then stopped, up to the latest step, is
a "stopped_training" WARNING that names the step of the change and what
changed:

- frozen: requires_grad set to False while it is still in the optimizer
  (an evaluation or export helper that forgot to undo its
  requires_grad_(False) does this). A parameter frozen from its first
  step stays the plain INFO "frozen" (a backbone frozen by design), and so
  does one that was frozen and taken out of the optimizer: taking it out
  says the freeze is meant.
- left the optimizer: its param group no longer holds it (or the group
  is gone) while it still requires grad: backward still computes its
  gradient and nothing applies it (in place of "not_in_optimizer", which
  does not know it ever was in).
- lr 0: its param group's lr dropped to 0 and stayed 0 for at least two
  monitored steps, the latest among them, while steps went on. A schedule
  that ends at 0 (cosine or linear to 0) reaches it at the run's last
  step, which is the latest step the report sees, and not before: lr 0 at
  the latest monitored step alone is not judged, lr 0 at two or more is
  training that goes on with nothing moving.

What moves the other way is healthy: a parameter frozen at first that is
unfrozen, or added with add_param_group (progressive unfreezing), never
trained and then stopped. A change older than the kept history is no
longer seen as one. Which param group held each parameter is read at each
monitored step only when the groups changed (Memberships), so a step costs
one tuple per group; without an optimizer nothing here is judged.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from zeroscan.monitor.grouping import group_findings
from zeroscan.monitor.optimizer import groups_fingerprint, optimizer_view
from zeroscan.monitor.report import Finding
from zeroscan.monitor.series import Series
from zeroscan.monitor.step_record import Param, StepRecord
from zeroscan.verdicts import Cause, Severity

TRAINS, FROZEN, LEFT, LR_ZERO, OTHER = range(5)  # what a parameter does at a step
# The findings each change stands in place of, for the parameters it names.
SUPERSEDES = {
    FROZEN: {Cause.FROZEN},
    LEFT: {Cause.NOT_IN_OPTIMIZER},
    LR_ZERO: {Cause.NOT_UPDATED, Cause.FROZEN_IN_TIME},
}


class Memberships:
    """Which param group held each parameter (by index) at each monitored
    step: a view is made when the param groups changed and holds until the
    next one."""

    def __init__(self) -> None:
        self._fingerprint: tuple[tuple[int, int, int], ...] | None = None
        self._steps: list[int] = []  # the first step of each view, ascending
        self._views: list[dict[int, int]] = []

    def observe(self, step: int, holder: object, params: list[Param], kept: Sequence[StepRecord]) -> None:
        """The param groups of `holder` as step `step` runs with them; views
        that none of the `kept` records (oldest first) reads are dropped."""
        oldest = kept[0].step if kept else step
        fingerprint = groups_fingerprint(holder)
        if fingerprint != self._fingerprint or not self._views:
            self._fingerprint = fingerprint
            view = optimizer_view(holder, params)
            assert view is not None
            if self._steps and self._steps[-1] >= step:  # a step seen again (renumbered records): the later wins
                cut = bisect.bisect_left(self._steps, step)
                del self._steps[cut:], self._views[cut:]
            self._steps.append(step)
            self._views.append(view)
        while len(self._steps) >= 2 and self._steps[1] <= oldest:
            del self._steps[0], self._views[0]

    @property
    def seen(self) -> bool:
        """Whether any step was seen with an optimizer."""
        return bool(self._views)

    def at(self, step: int) -> dict[int, int] | None:
        """The view step `step` ran with; None if no view reaches back to it."""
        k = bisect.bisect_right(self._steps, step) - 1
        return self._views[k] if k >= 0 else None

    def renumber(self, new_index: dict[int, int]) -> None:
        """After the model changed (see step_record.renumber); the next step makes a view afresh."""
        self._views = [{new_index[i]: g for i, g in v.items() if i in new_index} for v in self._views]
        self._fingerprint = None


@dataclass(frozen=True)
class Change:
    """What a parameter did at each judged step, [R, P] each."""

    doing: np.ndarray  # TRAINS, FROZEN, LEFT, LR_ZERO or OTHER
    group: np.ndarray  # its param group's number, -1 for none
    lr: np.ndarray  # its param group's lr (NaN: none, or not a number)


def change_findings(
    params: list[Param], records: list[StepRecord], memberships: Memberships | None
) -> tuple[list[Finding], dict[str, set[Cause]]]:
    """The stopped_training findings over the judged, decoded `records`
    (oldest first), one per root cause, and for each parameter they name
    the causes of the findings they stand in place of."""
    steps = [r for r in records if r.stepped and r.lrs is not None]
    if memberships is None or not memberships.seen or len(steps) < 2:
        return [], {}
    change = _what_each_did(params, steps, memberships)
    found: list[Finding] = []
    superseded: dict[str, set[Cause]] = {}
    for i in np.flatnonzero(np.isin(change.doing[-1], list(SUPERSEDES))).tolist():
        finding = _stopped(params[i], steps, change, i)
        if finding is not None:
            found.append(finding)
            superseded[params[i].name] = SUPERSEDES[int(change.doing[-1, i])]
    return group_findings(found), superseded


def _what_each_did(params: list[Param], steps: list[StepRecord], memberships: Memberships) -> Change:
    shape = (len(steps), len(params))
    requires = np.ones(shape, dtype=bool)
    group = np.full(shape, -1, dtype=np.int64)
    lr = np.full(shape, np.nan)
    known = np.zeros(len(steps), dtype=bool)
    arrays: dict[int, np.ndarray] = {}  # a view's groups as an array, once per view
    for k, r in enumerate(steps):
        flags = r.requires_grad[: len(params)]
        requires[k, : len(flags)] = flags
        view = memberships.at(r.step)
        if view is None:
            continue
        known[k] = True
        if id(view) not in arrays:
            at = np.full(len(params), -1, dtype=np.int64)
            for i, g in view.items():
                if i < len(params):
                    at[i] = g
            arrays[id(view)] = at
        group[k] = arrays[id(view)]
        rates = np.array([_number(x) for x in r.lrs or ()] + [math.nan])  # index -1: no group
        lr[k] = rates[np.where(group[k] < len(rates) - 1, group[k], -1)]
    present = Series(steps, len(params)).grad_present()
    member = group >= 0
    doing = np.full(shape, OTHER, dtype=np.int64)
    doing[requires & member & (lr == 0)] = LR_ZERO
    doing[requires & member & present & ~(lr == 0)] = TRAINS
    doing[requires & ~member] = LEFT
    doing[~requires & member] = FROZEN
    doing[~known] = OTHER
    return Change(doing, group, lr)


def _number(lr: object) -> float:
    if isinstance(lr, torch.Tensor) and lr.numel() == 1:
        return float(lr)  # report() reads it (the step only copied it)
    if isinstance(lr, (int, float)) and not isinstance(lr, bool):
        return float(lr)
    return math.nan


def _stopped(p: Param, steps: list[StepRecord], change: Change, i: int) -> Finding | None:
    """The finding of parameter `i` if it trained and then stopped (see the module doc)."""
    doing = change.doing[:, i]
    now = int(doing[-1])
    start = len(doing) - 1
    while start > 0 and doing[start - 1] == now:
        start -= 1
    trained = np.flatnonzero(doing[:start] == TRAINS)
    if not len(trained) or (now == LR_ZERO and len(doing) - start < 2):
        return None
    last = int(trained[-1])
    until, at = steps[last].step, steps[start].step
    before = steps[start - 1].step
    when = f"at step {at}" if before + 1 == at else f"between steps {before} and {at} (the monitored steps around it)"
    group = int(change.group[last, i])
    name = p.name
    if now == FROZEN:
        what = (
            f"frozen {when} (requires_grad set to False) while still in the optimizer's param group "
            f"{int(change.group[-1, i])}, after training until step {until}"
        )
        cure = (
            "A requires_grad_(False) that was not undone (an evaluation or export helper) does this: call "
            "requires_grad_(True) again. A freeze that is meant takes the frozen parameters out of the optimizer too"
        )
        return _finding(
            p, f"{name} was {what}: it gets no gradient, so it no longer trains. {cure}",
            f"these parameters were {what}: they get no gradient, so they no longer train. {cure}",
        )
    if now == LEFT:
        what = f"left the optimizer {when} (param group {group} no longer holds it), after training until step {until}"
        return _finding(p, (
            f"{name} {what}: it still requires grad, so backward computes its gradient, and optimizer.step() no "
            "longer applies it; put it back in a param group, or call requires_grad_(False) if it is meant to "
            "stay fixed"
        ), (
            f"these parameters {what.replace('holds it', 'holds them')}: they still require grad, so backward "
            "computes their gradients, and optimizer.step() no longer applies them; put them back in a param "
            "group, or call requires_grad_(False) if they are meant to stay fixed"
        ))
    held = len(doing) - start
    what = (
        f"param group {group}'s lr dropped to 0 {when} (it was {change.lr[last, i]:.3g} at step {until}) and stayed 0 "
        f"for {held} monitored steps while training went on"
    )
    why = (
        "nothing of the group moves. A schedule that ends at 0 reaches it at the run's last step only; check the "
        "scheduler's length (total steps) or a param_groups[...]['lr'] set by hand"
    )
    return _finding(p, f"{name} stopped training: its {what}: {why}", f"{what}: {why}")


def _finding(p: Param, message: str, root: str) -> Finding:
    return Finding(p.name, "param", Severity.WARNING, Cause.STOPPED_TRAINING, message, root=root)


def without_superseded(findings: list[Finding], superseded: dict[str, set[Cause]]) -> list[Finding]:
    """`findings` less those about a parameter that a stopped_training finding
    explains (a finding that stands for several tensors keeps the others)."""
    if not superseded:
        return findings

    def gone(f: Finding) -> bool:
        return f.cause in superseded.get(f.name, ())

    out: list[Finding] = []
    for f in findings:
        if not f.members:
            if not gone(f):
                out.append(f)
            continue
        kept = [m for m in f.members if not gone(m)]
        if len(kept) == len(f.members):
            out.append(f)
        elif kept:
            out.extend(group_findings(kept))
    return out


def merged(findings: list[Finding], changes: list[Finding]) -> list[Finding]:
    """The report's findings with `changes` among them, ranked by severity
    (a change comes after the findings of its severity that were there)."""
    return sorted(findings + changes, key=lambda f: -int(f.severity))
