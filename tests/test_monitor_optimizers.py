"""The Monitor with optimizer wrappers: a Lookahead that never ran
Optimizer.__init__, a wrapper that only duck-types an optimizer, an
optimizer whose step was replaced or patched on the instance, and
ZeroRedundancyOptimizer (two gloo ranks).

Each is scanned exactly once per optimizer step, before the step (the
weights of a monitored run are bit for bit those of an unmonitored twin),
its param groups and learning rates are read from the object that holds
them, and what cannot be hooked nor wrapped is refused in one line that
says what to pass. Members the issue does not name: the duck-typed wrapper
(not an Optimizer subclass), one that steps its optimizer at every other
call (gradient accumulation), an optimizer of one's own with no inner one,
a step patched with functools.wraps (calling the original), a step
replaced without it that calls the class's step, an lr scheduler made after
the Monitor (it wraps the Monitor's wrapped step), and two Monitors sharing
one optimizer.
"""

from __future__ import annotations

import copy
import functools
import gc
import pickle
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import fresh_seed, serious
from steps import assert_same, batches, loss_of, make_model
from world import World, spawn_world
from zeroscan import Monitor, Report

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 6


class TimmLookahead(torch.optim.Optimizer):
    """timm's Lookahead, as it is built: Optimizer.__init__ deliberately not
    called, the base optimizer's param groups as its own."""

    def __init__(self, base_optimizer: torch.optim.Optimizer, alpha: float = 0.5, k: int = 2) -> None:
        self.base_optimizer = base_optimizer
        self.alpha, self.k = alpha, k
        self.defaults = base_optimizer.defaults
        self.state: dict[Any, Any] = {}
        self.calls = 0
        self.slow = [[p.detach().clone() for p in g["params"]] for g in base_optimizer.param_groups]

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.base_optimizer.param_groups

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        loss = self.base_optimizer.step(closure)
        self.calls += 1
        if self.calls % self.k == 0:
            for group, slow in zip(self.param_groups, self.slow):
                for p, s in zip(group["params"], slow):
                    s.add_(p - s, alpha=self.alpha)
                    p.copy_(s)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base_optimizer.zero_grad(set_to_none)


class DuckWrapper:
    """A research codebase's wrapper: no Optimizer subclass, it only looks like one."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()


class Accumulating(DuckWrapper):
    """Steps its optimizer at every `every`-th call only (gradient accumulation,
    as Accelerate's wrapper does), and zeroes the gradients only after a step."""

    def __init__(self, optimizer: torch.optim.Optimizer, every: int = 2) -> None:
        super().__init__(optimizer)
        self.every, self.calls = every, 0

    def step(self) -> None:
        self.calls += 1
        if self.calls % self.every == 0:
            self.optimizer.step()

    def zero_grad(self) -> None:
        if self.calls % self.every == 0:
            self.optimizer.zero_grad()


class OwnSGD:
    """An optimizer of one's own: no torch Optimizer anywhere, no step hooks."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self.defaults = {"lr": 0.05}
        self.param_groups = [{**self.defaults, **g, "params": list(g["params"])} for g in groups]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


@torch.no_grad()
def manual_sgd(self: torch.optim.Optimizer, closure: Any = None) -> None:
    """A step put on the instance that never reaches the class's step (nor its hooks)."""
    for group in self.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.add_(p.grad, alpha=-group["lr"])


def groups_of(model: nn.Sequential) -> list[dict[str, Any]]:
    """Two param groups; the last layer's runs with lr 0 (its lr-0 hint tells
    that the groups were read from the right object)."""
    return [
        {"params": list(model[0].parameters()) + list(model[2].parameters())},
        {"params": list(model[4].parameters()), "lr": 0.0},
    ]


def sgd(model: nn.Sequential) -> torch.optim.SGD:
    return torch.optim.SGD(groups_of(model), lr=0.05, momentum=0.5)


def replaced_step(model: nn.Sequential) -> torch.optim.SGD:
    opt = sgd(model)
    opt.step = types.MethodType(manual_sgd, opt)  # type: ignore[method-assign]
    return opt


def wraps_patched(model: nn.Sequential) -> torch.optim.SGD:
    opt = sgd(model)
    original = opt.step

    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        counted.calls += 1  # type: ignore[attr-defined]
        return original(*args, **kwargs)

    counted.calls = 0  # type: ignore[attr-defined]
    opt.step = opt.patch = counted  # type: ignore[method-assign, attr-defined]
    return opt


def replaced_calling_the_class_step(model: nn.Sequential) -> torch.optim.SGD:
    """A step put on the instance, without functools.wraps, that calls the class's step (and its hooks)."""
    opt = sgd(model)
    opt.step = types.MethodType(lambda self, closure=None: type(self).step(self, closure), opt)  # type: ignore
    return opt


def scheduled(model: nn.Sequential) -> torch.optim.SGD:
    opt = sgd(model)
    opt.scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)  # type: ignore[attr-defined]
    return opt


# name -> builds the optimizer the loop steps
WRAPPERS: dict[str, Callable[[nn.Sequential], Any]] = {
    "plain": sgd,
    "timm_lookahead": lambda m: TimmLookahead(sgd(m)),
    "duck_wrapper": lambda m: DuckWrapper(sgd(m)),
    "accumulating_wrapper": lambda m: Accumulating(sgd(m)),
    "own_optimizer": lambda m: OwnSGD(groups_of(m)),
    "lookahead_of_own_optimizer": lambda m: TimmLookahead(OwnSGD(groups_of(m))),  # type: ignore[arg-type]
    "step_replaced_on_instance": replaced_step,
    "step_patched_with_wraps": wraps_patched,
    "step_replaced_calling_the_class_step": replaced_calling_the_class_step,
    "scheduler_before_monitor": scheduled,
}


def run(build: Callable[[nn.Sequential], Any], seed: int, monitored: bool, *, scheduler_after: bool = False,
        calls: int = STEPS) -> tuple[nn.Sequential, Any, Report | None, dict[str, float]]:
    """`calls` loop steps (zero_grad, backward, step) of the shared small
    model; the Monitor's report, and the weights' norms before the last step."""
    g = torch.Generator().manual_seed(seed)
    model = make_model(g)
    opt = build(model)
    monitor = Monitor(model, opt) if monitored else None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.95**s) if scheduler_after else None
    norms: dict[str, float] = {}
    for batch in batches(g, calls):
        opt.zero_grad()
        loss_of(model, batch).backward()
        norms = {n: float(p.detach().double().norm()) for n, p in model.named_parameters()}
        opt.step()
        if sched is not None:
            sched.step()
    report = None
    if monitor is not None:
        report = monitor.report()
        monitor.close()
    return model, opt, report, norms


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The step numbers at which the Monitor scanned at an optimizer step."""
    seen: list[int] = []
    real = Monitor._on_optimizer_step

    def counting(self: Monitor, *args: Any) -> None:
        seen.append(self.steps_seen)
        real(self, *args)

    monkeypatch.setattr(Monitor, "_on_optimizer_step", counting)
    return seen


def inner_steps(opt: Any, calls: int) -> int:
    return calls // opt.every if isinstance(opt, Accumulating) else calls


@pytest.mark.parametrize("scheduler_after", [False, True], ids=["", "scheduler_after_monitor"])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_each_optimizer_step_is_scanned_once_before_it_runs(
    wrapper: str, scheduler_after: bool, scans: list[int]
) -> None:
    if scheduler_after and wrapper in ("duck_wrapper", "accumulating_wrapper", "own_optimizer"):
        pytest.skip("an lr scheduler takes a torch.optim.Optimizer only")
    if scheduler_after and wrapper == "step_patched_with_wraps":
        pytest.skip("torch's lr scheduler cannot wrap a step patched with a plain function, zeroscan or not")
    seed = fresh_seed(2**31)
    build = WRAPPERS[wrapper]
    model, opt, report, before_last = run(build, seed, True, scheduler_after=scheduler_after)
    twin, _, _, _ = run(build, seed, False, scheduler_after=scheduler_after)
    assert report is not None
    taken = inner_steps(opt, STEPS)
    assert scans == list(range(taken)), f"scanned at {scans}, {taken} optimizer steps"
    assert report.history["steps"] == list(range(taken)), str(report)
    scanned = {t["name"]: t["norm"] for t in report.tensors if t["kind"] == "weight"}
    assert scanned == pytest.approx(before_last, rel=1e-6)  # the weights as the last step found them
    # The Monitor changes nothing of what the step does.
    assert_same({n: p.detach() for n, p in model.named_parameters()},
                {n: p.detach() for n, p in twin.named_parameters()})
    assert not serious(report), str(report)
    # Read from what holds the param groups: the group at lr 0 is named, no parameter is missing.
    (hint,) = report.findings
    assert hint.cause == "not_updated" and "lr=0" in hint.message and set(hint.names) == {"4.weight", "4.bias"}, (
        str(report)
    )
    if wrapper == "step_patched_with_wraps":
        assert opt.patch.calls == taken  # the patch ran once per step


# Wrapped on the instance: where no step hook is reached, or may not be.
WRAPPED = ["own_optimizer", "step_replaced_on_instance", "step_replaced_calling_the_class_step"]


@pytest.mark.parametrize("wrapper", WRAPPED + ["step_patched_with_wraps", "scheduler_before_monitor"])
def test_a_wrapped_step_is_put_back_when_the_monitor_goes(wrapper: str) -> None:
    """A step that says it calls the one it replaced (functools.wraps, an lr
    scheduler's) is left alone: the Monitor's pre-hook keeps its place among
    the others. Any other is wrapped, and put back."""
    g = torch.Generator().manual_seed(fresh_seed(2**31))
    model = make_model(g)
    opt = WRAPPERS[wrapper](model)
    before = vars(opt).get("step")
    monitor = Monitor(model, opt)
    assert (vars(opt).get("step") is not before) == (wrapper in WRAPPED)
    monitor.close()
    assert vars(opt).get("step") is before
    monitor = Monitor(model, opt)
    ref = weakref.ref(monitor)
    del monitor
    gc.collect()
    assert ref() is None
    assert vars(opt).get("step") is before  # the freed Monitor's finalizer put it back too
    for batch in batches(g, 2):  # and the loop goes on as before
        opt.zero_grad()
        loss_of(model, batch).backward()
        opt.step()


@pytest.mark.parametrize("wrapper", ["plain", *WRAPPED, "timm_lookahead"])
def test_two_monitors_of_one_optimizer_scan_once_each(wrapper: str, scans: list[int]) -> None:
    """Two halves of a model, each with its own Monitor, share one optimizer."""
    g = torch.Generator().manual_seed(fresh_seed(2**31))
    model = make_model(g)
    opt = WRAPPERS[wrapper](model)
    with Monitor(model[0], opt) as first, Monitor(model[4], opt) as second:
        for batch in batches(g, STEPS):
            opt.zero_grad()
            loss_of(model, batch).backward()
            opt.step()
    assert sorted(scans) == sorted(list(range(STEPS)) * 2), scans
    for monitor in (first, second):
        assert monitor.report().history["steps"] == list(range(STEPS))


def test_a_copied_or_pickled_wrapper_steps_without_the_monitor(scans: list[int]) -> None:
    g = torch.Generator().manual_seed(fresh_seed(2**31))
    model = make_model(g)
    opt = OwnSGD(groups_of(model))
    monitor = Monitor(model, opt)
    twin = copy.deepcopy((model, opt))
    loaded = pickle.loads(pickle.dumps((model, opt)))
    for m, o in (twin, loaded):
        for batch in batches(g, 2):
            o.zero_grad()
            loss_of(m, batch).backward()
            before = {n: p.detach().clone() for n, p in m.named_parameters()}
            o.step()
            assert any(not torch.equal(before[n], p) for n, p in m.named_parameters())
    assert scans == [] and monitor.steps_seen == 0  # the copies' steps are theirs alone
    monitor.close()


class Slotted:
    """Duck-typed, with no __dict__: its step can be neither hooked nor wrapped."""

    __slots__ = ("param_groups",)

    def __init__(self, params: Iterator[nn.Parameter]) -> None:
        self.param_groups = [{"params": list(params), "lr": 0.1}]

    def step(self) -> None:
        for p in self.param_groups[0]["params"]:
            p.data.add_(p.grad, alpha=-0.1)


class NoGroups(torch.optim.Optimizer):
    """A wrapper that never ran Optimizer.__init__ and holds no param groups."""

    def __init__(self) -> None:
        pass

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        pass


# name -> (the optimizer, a regex the one-line error matches)
REFUSED: dict[str, tuple[Callable[[nn.Module], Any], str]] = {
    "not_an_optimizer": (lambda m: [m.weight], r"optimizer must be a torch\.optim\.Optimizer .* got list$"),
    "no_param_groups": (
        lambda m: NoGroups(), r"optimizer NoGroups has no param_groups .* pass the torch\.optim\.Optimizer",
    ),
    "step_not_wrappable": (
        lambda m: Slotted(m.parameters()),
        r"optimizer Slotted has no step hooks .* cannot be wrapped \(.*__dict__.*\); pass the "
        r"torch\.optim\.Optimizer it wraps, or pass auto=False and call monitor\.step\(\) once per step$",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_cannot_be_hooked_is_refused_in_one_line(case: str) -> None:
    model = nn.Linear(3, 2)
    build, pattern = REFUSED[case]
    with pytest.raises(TypeError, match=r"^zeroscan\.Monitor: " + pattern) as raised:
        Monitor(model, build(model))
    assert "\n" not in str(raised.value)
    assert not model._forward_hooks and not model._forward_pre_hooks  # nothing left on the model
    if case == "step_not_wrappable":  # what the message says to pass works
        opt = build(model)
        with Monitor(model, opt, auto=False) as monitor:
            for _ in range(3):
                model(torch.randn(4, 3)).square().mean().backward()
                monitor.step()
                opt.step()
                model.zero_grad()
        assert monitor.report().history["steps"] == [0, 1, 2]


# ------------------------------------------------------ ZeroRedundancyOptimizer on two gloo ranks


def check_zero_redundancy(rank: int, world_size: int, seed: int) -> str:
    """ZeroRedundancyOptimizer under DDP: its param groups hold every
    parameter while its local optimizer holds this rank's shard: no
    not_in_optimizer, one scan per step, and no warning."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.05)
    local = sum(len(g["params"]) for g in opt.optim.param_groups)
    assert 0 < local < len(list(model.parameters())), local  # the shard is part of the model
    counted: list[int] = []
    with Monitor(model, opt) as monitor:
        real = monitor._on_optimizer_step
        monitor._on_optimizer_step = lambda *a: counted.append(1) or real(*a)  # type: ignore[method-assign]
        g = torch.Generator().manual_seed(seed + rank)
        for _ in range(STEPS):
            opt.zero_grad()
            ddp(torch.randn(8, 6, generator=g)).square().mean().backward()
            opt.step()
    report = monitor.report()
    assert len(counted) == STEPS and report.history["steps"] == list(range(STEPS)), str(report)
    assert report.findings == [], str(report)
    return f"{len(counted)} scans"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    if not dist.is_available():
        pytest.skip("this torch has no torch.distributed")
    return spawn_world(2, {"zero_redundancy": check_zero_redundancy}, tmp_path_factory,
                       timeout_s=90.0, collective_timeout_s=30.0)


def test_zero_redundancy_optimizer_on_two_ranks(world: World) -> None:
    world.assert_passed("zero_redundancy")
