"""Mid-run changes of what trains: a parameter that trained and then
stopped is a stopped_training WARNING naming the step of the change and
what changed; what the user's own code says is meant (a freeze from the
start, progressive unfreezing with add_param_group, a schedule that ends at
0 at the run's last step, a freeze that also takes the parameters out of
the optimizer, a freeze undone) is not.

Each change runs on the plain model and on the model compiled with
torch.compile (the eager backend, on the CPU), with every step monitored
and with one in two (the change then falls between monitored steps).
Members the issue does not name: requires_grad set to False on one tensor
by hand, a whole param group deleted, an lr set to 0 by hand in
param_groups, and a freeze that is undone two steps later (healthy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn

from helpers import fresh_seed, serious
from steps import batches, loss_of, make_model
from zeroscan import Finding, Monitor, Report, Severity

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 10
AT = 5  # the step (from 0) before which the change is made
# The findings a stopped_training finding stands in place of, for the parameters it names.
SUPERSEDED = {"frozen", "not_in_optimizer", "not_updated", "frozen_in_time"}


class Run:
    """A model, its optimizer (group 0: the first layer, group 1: the rest)
    and, where a setup gives them, an lr scheduler's factor per group; a
    change edits them."""

    def __init__(self, seed: int) -> None:
        self.model = make_model(torch.Generator().manual_seed(seed))
        self.opt = torch.optim.SGD(
            [{"params": list(self.model[0].parameters())},
             {"params": list(self.model[2].parameters()) + list(self.model[4].parameters())}],
            lr=0.05,
        )
        self.factors: list[Callable[[int], float]] | None = None  # no scheduler

    def drop_from_group(self, group: int, param: nn.Parameter) -> None:
        self.opt.param_groups[group]["params"] = [p for p in self.opt.param_groups[group]["params"] if p is not param]


def evaluate_and_forget(run: Run) -> None:
    """An evaluation helper that freezes the first layer and never undoes it."""
    run.model[0].requires_grad_(False)
    with torch.no_grad():
        run.model(torch.zeros(2, 6))


def warmup_then_zero(run: Run) -> None:
    run.factors = [lambda s: min(1.0, (s + 1) / 3) if s < AT else 0.0, lambda s: 1.0]


# name -> (set up before training, the change made before step AT, the names that
# stop training, a phrase of what changed)
Change = tuple[Callable[[Run], None] | None, Callable[[Run], None], set[str], str]
STOPPING: dict[str, Change] = {
    "eval_helper_freezes_a_layer": (None, evaluate_and_forget, {"0.weight", "0.bias"}, "requires_grad set to False"),
    "requires_grad_false_by_hand": (
        None, lambda r: setattr(r.model[2].weight, "requires_grad", False), {"2.weight"}, "requires_grad set to False"
    ),
    "removed_from_its_group": (None, lambda r: r.drop_from_group(0, r.model[0].bias), {"0.bias"}, "left the optimizer"),
    "param_group_deleted": (None, lambda r: r.opt.param_groups.pop(0), {"0.weight", "0.bias"}, "left the optimizer"),
    "scheduler_warmup_then_zero": (warmup_then_zero, lambda r: None, {"0.weight", "0.bias"}, "lr dropped to 0"),
    "lr_set_to_zero_by_hand": (
        None, lambda r: r.opt.param_groups[1].__setitem__("lr", 0.0),
        {"2.weight", "2.bias", "4.weight", "4.bias"}, "lr dropped to 0",
    ),
}


def unfreeze_into_new_group(run: Run) -> None:
    run.model[0].requires_grad_(True)
    run.opt.add_param_group({"params": list(run.model[0].parameters())})


def freeze_for_good(run: Run) -> None:
    run.model[0].requires_grad_(False)
    run.opt.param_groups.pop(0)


def linear_to_zero(run: Run) -> None:
    run.factors = [lambda s: (STEPS - 1 - s) / (STEPS - 1)] * 2  # 0 at the last step only


def frozen_from_the_start(run: Run) -> None:
    run.model[0].requires_grad_(False)


# name -> (set up before training, the change made before step AT, the causes allowed in the report)
HEALTHY: dict[str, tuple[Callable[[Run], None] | None, Callable[[Run], None], set[str]]] = {
    "frozen_from_the_start": (frozen_from_the_start, lambda r: None, {"frozen"}),
    "progressive_unfreezing": (freeze_for_good, unfreeze_into_new_group, set()),
    "schedule_ends_at_zero": (linear_to_zero, lambda r: None, set()),
    "frozen_and_taken_out_of_the_optimizer": (None, freeze_for_good, {"frozen"}),
    "freeze_undone": (None, evaluate_and_forget, set()),  # undone two steps later (train)
}


def train(
    setup: Callable[[Run], None] | None, change: Callable[[Run], None], *, compiled: bool, every: int,
    undo_at: int | None = None,
) -> tuple[Report, dict[str, str]]:
    """STEPS steps with the change made before step AT; the report, and the
    Monitor's name of each parameter of the plain model ("_orig_mod.0.bias"
    for "0.bias" in the compiled one)."""
    run = Run(fresh_seed(2**31))
    if setup is not None:
        setup(run)
    sched = None if run.factors is None else torch.optim.lr_scheduler.LambdaLR(run.opt, run.factors)
    if compiled:
        torch._dynamo.reset()
    model: nn.Module = torch.compile(run.model, backend="eager") if compiled else run.model
    names = {id(p): n for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    with Monitor(model, run.opt, every=every) as monitor:
        for step, batch in enumerate(batches(g, STEPS)):
            if step == AT:
                change(run)
            if step == undo_at:
                run.model.requires_grad_(True)
            run.opt.zero_grad()
            loss_of(model, batch).backward()
            run.opt.step()
            if sched is not None:
                sched.step()
        report = monitor.report()
    return report, {n: names[id(p)] for n, p in run.model.named_parameters()}


def named(findings: list[Finding]) -> list[tuple[str, str]]:
    """(name, cause) of every finding, and of each member of a grouped one."""
    return [(m.name, str(m.cause)) for f in findings for m in (f.members or (f,))]


MODES = [pytest.param(False, 1, id="plain"), pytest.param(False, 2, id="every_2"),
         pytest.param(True, 1, id="compiled")]


@pytest.mark.parametrize(("compiled", "every"), MODES)
@pytest.mark.parametrize("case", list(STOPPING))
def test_a_parameter_that_stops_training_is_a_warning_naming_the_step(case: str, compiled: bool, every: int) -> None:
    setup, change, stopping, what = STOPPING[case]
    report, names = train(setup, change, compiled=compiled, every=every)
    expected = {names[n] for n in stopping}
    found = [f for f in report.findings if f.cause == "stopped_training"]
    assert len(found) == 1, str(report)
    (stopped,) = found
    assert stopped.severity == Severity.WARNING and set(stopped.names or (stopped.name,)) == expected, str(report)
    when = f"at step {AT}" if every == 1 else f"between steps {AT - 1} and {AT + 1}"
    assert what in stopped.message and when in stopped.message, stopped.message
    assert serious(report) == [stopped], str(report)
    assert not [(n, c) for n, c in named(report.findings) if n in expected and c in SUPERSEDED], str(report)


@pytest.mark.parametrize(("compiled", "every"), MODES)
@pytest.mark.parametrize("case", list(HEALTHY))
def test_a_change_the_code_says_is_meant_is_no_warning(case: str, compiled: bool, every: int) -> None:
    setup, change, allowed = HEALTHY[case]
    report, _ = train(setup, change, compiled=compiled, every=every,
                      undo_at=AT + 2 if case == "freeze_undone" else None)
    assert not serious(report), str(report)
    assert {c for _, c in named(report.findings)} <= allowed, str(report)
    if allowed:
        assert all(f.severity == Severity.INFO for f in report.findings), str(report)


def test_lr_zero_at_the_latest_step_alone_is_not_judged_yet() -> None:
    """lr 0 first seen at the latest step: a schedule's last step looks so;
    one more monitored step at 0 makes it a warning."""
    run = Run(fresh_seed(2**31))
    g = torch.Generator().manual_seed(0)
    reports: list[Report] = []
    with Monitor(run.model, run.opt) as monitor:
        for step, batch in enumerate(batches(g, STEPS)):
            if step == STEPS - 2:
                run.opt.param_groups[0]["lr"] = 0.0
            run.opt.zero_grad()
            loss_of(run.model, batch).backward()
            run.opt.step()
            reports.append(monitor.report())
    assert not serious(reports[-2]), str(reports[-2])
    (stopped,) = serious(reports[-1])
    assert stopped.cause == "stopped_training" and f"at step {STEPS - 2}" in stopped.message, str(reports[-1])
    assert "stayed 0 for 2 monitored steps" in stopped.message


def test_the_check_costs_a_step_one_tuple_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which group holds each parameter is read again only when the groups changed."""
    import zeroscan.monitor.changes as changes

    views: list[int] = []
    real = changes.optimizer_view

    def counting(*args: Any) -> Any:
        views.append(1)
        return real(*args)

    monkeypatch.setattr(changes, "optimizer_view", counting)
    report, _ = train(None, STOPPING["removed_from_its_group"][1], compiled=False, every=1)
    assert len(views) == 2, views  # the first step, and the step after the change
    assert serious(report)[0].cause == "stopped_training"
