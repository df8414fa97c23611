"""A Monitor inside someone else's process: it never travels with a saved or
copied model, it is freed when the last reference to it goes, and report()
may be read from another thread while training runs."""

from __future__ import annotations

import copy
import gc
import io
import logging
import pickle
import threading
import time
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import nn

import zeroscan
from helpers import fresh_generator
from zeroscan import Monitor
from zeroscan.monitor.turns import Turns

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def make_model(g: torch.Generator) -> nn.Sequential:
    torch.manual_seed(int(torch.randint(0, 2**31, (), generator=g)))
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8), nn.GELU(), nn.Linear(8, 4), nn.Softmax(-1))


def train(model: nn.Module, opt: torch.optim.Optimizer, g: torch.Generator, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(6, 12, generator=g)).square().sum().backward()
        opt.step()


def saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def hook_counts(model: nn.Module) -> list[int]:
    """How many forward hooks each module of `model` holds."""
    return [len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._forward_hooks_always_called)
            for m in model.modules()]


# When the model is saved: right after the Monitor is made (the cause analysis
# still has its probe on every module), and after training steps.
MOMENTS = {"before any step": 0, "after steps": 3}
KINDS = {
    "plain": {},
    "activations": {"activations": True},
    "histogram, every 2": {"histogram": True, "every": 2},
    "no optimizer": {"auto": False},
}


def users_hook(module: nn.Module, args: object, output: object) -> None:
    """A hook of the user's own, which a saved model keeps."""


@pytest.mark.parametrize("moment", MOMENTS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_saved_or_copied_model_is_what_it_would_be_without_zeroscan(kind: str, moment: str) -> None:
    g = fresh_generator()
    model = make_model(g)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    train(model, opt, g, 1)
    model[1].register_forward_hook(users_hook)
    user_hooks = hook_counts(model)
    options = dict(KINDS[kind])
    monitor = Monitor(model, None if options.pop("auto", True) is False else opt, **options)
    assert hook_counts(model) != user_hooks  # the Monitor does hook the model
    if monitor.optimizer is not None:
        train(model, opt, g, MOMENTS[moment])
    got = saved(model)
    copied = copy.deepcopy(model)
    pickled = pickle.dumps(model)
    x = torch.randn(2, 12, generator=g)
    for other in (torch.load(io.BytesIO(got), weights_only=False), copied, pickle.loads(pickled)):
        assert hook_counts(other) == user_hooks
        assert list(other[1]._forward_hooks.values()) == [users_hook]
        assert all("__getstate__" not in m.__dict__ for m in other.modules())
        assert torch.equal(other(x), model(x))
    if monitor.optimizer is not None:
        train(model, opt, g, 1)  # the Monitor still watches the original
        assert monitor.report().step == MOMENTS[moment] // options.get("every", 1) * options.get("every", 1)
    monitor.close()
    assert hook_counts(model) == user_hooks  # close() removes its hooks, and only its own
    assert all("__getstate__" not in m.__dict__ for m in model.modules())
    if monitor.optimizer is not None:
        return  # the weights moved since `got`
    assert saved(model) == got  # byte for byte what the model saves without zeroscan
    assert pickle.dumps(model) == pickled


def test_dropped_monitors_are_freed_with_their_models_and_optimizers() -> None:
    """A sweep that makes a model, an optimizer and a Monitor per trial and
    never calls close()."""
    g = fresh_generator()
    alive: list[tuple[weakref.ref[nn.Module], weakref.ref[Monitor], weakref.ref[torch.optim.Optimizer]]] = []
    for trial in range(6):
        model = make_model(g)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        monitor = Monitor(model, opt, activations=trial % 2 == 0, histogram=trial % 3 == 0)
        train(model, opt, g, 2)
        assert monitor.report().step == 1
        alive.append((weakref.ref(model), weakref.ref(monitor), weakref.ref(opt)))
        del model, opt, monitor
    gc.collect()
    assert [[r() is None for r in refs] for refs in alive] == [[True] * 3] * 6


def test_a_kept_model_does_not_keep_its_dropped_monitor() -> None:
    g = fresh_generator()
    model = make_model(g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    user_hooks = hook_counts(model)
    monitor = Monitor(model, opt, activations=True)
    train(model, opt, g, 2)
    gone = weakref.ref(monitor)
    del monitor
    gc.collect()
    assert gone() is None
    assert hook_counts(model) == user_hooks  # the freed Monitor's hooks went with it
    assert not opt._optimizer_step_pre_hooks
    train(model, opt, g, 2)  # training goes on, unwatched


def test_model_assignments_after_many_monitors_reach_only_live_ones() -> None:
    g = fresh_generator()
    keep = []
    for _ in range(3):
        model = make_model(g)
        keep.append((model, Monitor(model)))
    for _ in range(5):
        Monitor(make_model(g))  # dropped at once
    gc.collect()
    model, monitor = keep[1]
    model.add_module("head", nn.Linear(4, 2))  # a new module: this Monitor takes it in
    model(torch.randn(3, 12)).sum().backward()
    monitor.step()
    assert "head.weight" in {t["name"] for t in monitor.report().tensors}


# ---- report() from another thread ------------------------------------------------------


def read_reports_while_training(make: Callable[[nn.Module, torch.optim.Optimizer], Monitor], steps: int) -> list[str]:
    """Trains for `steps` steps while another thread calls report() without
    pause; the errors that thread met."""
    g = fresh_generator()
    model = make_model(g)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = make(model, opt)
    errors: list[str] = []
    stop = threading.Event()

    def reader() -> None:  # a dashboard polling as often as it can
        while not stop.wait(0.001):
            try:
                report = monitor.report()
                assert report.step >= -1
            except Exception as err:  # noqa: BLE001 -- any error is the finding here
                errors.append(f"{type(err).__name__}: {err}")
                return

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        train(model, opt, g, steps)
    finally:
        stop.set()
        thread.join()
    final = monitor.report()
    every = monitor.every
    assert final.step == (steps - 1) // every * every  # every step recorded, none ended early by the reader
    assert not [f for f in final.findings if f.cause in ("skipped_steps", "no_step")]
    monitor.close()
    return errors


@pytest.mark.slow  # trains while another thread reports, for seconds
@pytest.mark.parametrize("options", [
    {"activations": True, "histogram": True}, {"activations": True}, {"histogram": True, "every": 3}, {},
], ids=str)
def test_report_from_another_thread_while_training(options: dict[str, object]) -> None:
    for _ in range(3):  # a race: a few tries make a regression show at almost every run
        errors = read_reports_while_training(lambda model, opt: Monitor(model, opt, **options), steps=100)
        assert errors == []


def test_report_from_another_thread_leaves_the_open_step_open() -> None:
    g = fresh_generator()
    model = make_model(g)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = Monitor(model, opt)
    train(model, opt, g, 2)
    opt.zero_grad()
    model(torch.randn(6, 12, generator=g)).square().sum().backward()  # backward done, step not yet
    seen: list[zeroscan.Report] = []
    thread = threading.Thread(target=lambda: seen.append(monitor.report()))
    thread.start()
    thread.join()
    assert seen[0].step == 1  # the two steps that ended; the third is still open
    opt.step()
    report = monitor.report()
    assert report.step == 2 and not [f for f in report.findings if f.cause == "skipped_steps"]


def test_a_waiting_step_goes_before_the_next_report() -> None:
    """A thread reading reports in a loop lets the training thread's waiting
    hook in between two reports (a plain lock would hand it back to itself)."""
    for _ in range(20):
        turns = Turns()
        order: list[str] = []
        turns.report.__enter__()

        def step() -> None:
            with turns.step:
                order.append("step")

        thread = threading.Thread(target=step)
        thread.start()
        while not turns.step_waiting:
            time.sleep(1e-4)
        turns.report.__exit__(None, None, None)
        with turns.report:
            order.append("report")
        thread.join()
        assert order == ["step", "report"]


def test_under_torch_compile_the_hooks_stay_out_of_the_compiled_code() -> None:
    """Monitors on a compiled model's wrapper and on the model inside it, one
    after another: dynamo compiles none of zeroscan's hook calls (one frame
    serving every kind of hook would hit its recompile limit)."""
    dynamo_said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            dynamo_said.append(record.getMessage())

    g = fresh_generator()
    model = make_model(g)
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    handler = Keep()
    logging.getLogger("torch._dynamo").addHandler(handler)
    try:
        for target in (compiled, model, compiled):
            monitor = Monitor(target, opt, activations=True)
            train(compiled, opt, g, 3)
            assert monitor.report().step == 2
            prefix = "_orig_mod." if target is compiled else ""
            acts = [name for name, _, _ in monitor._log.records[-1].activations]
            assert acts == [f"{prefix}1", f"{prefix}3", f"{prefix}5"]
            got = saved(compiled)
            monitor.close()
            assert saved(compiled) == got  # saved as without zeroscan
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
    assert not [m for m in dynamo_said if "recompile_limit" in m and "zeroscan" in m], dynamo_said
