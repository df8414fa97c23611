"""What one monitored step reads: the bytes of every tensor the Monitor's
scans take, counted over whole training steps.

A dispatch mode records each zeroscan scan (stats_many, stats_many_hist)
that runs while it is active, in backward too, with the memory each scanned
tensor views. A gradient or weight read "once" is one scan of its whole
memory; a scan of part of a gradient is a witness (monitor/deferred.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import fresh_generator
from steps import batches, loss_of, make_model
from zeroscan import Monitor

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SCANS = frozenset({"zeroscan::stats_many", "zeroscan::stats_many_hist"})


class Span(NamedTuple):
    """The memory one scanned tensor views (contiguous here): [start, start + nbytes)."""

    start: int
    nbytes: int


def span(t: torch.Tensor) -> Span:
    assert t.is_contiguous()
    return Span(t.data_ptr(), t.numel() * t.element_size())


class ScanReads(TorchDispatchMode):
    """The spans of every tensor that a zeroscan scan reads while active,
    apart from those read while optimizer.step() runs (`at_step`)."""

    def __init__(self) -> None:
        super().__init__()
        self.at_step = False
        self.spans: dict[bool, list[Span]] = {False: [], True: []}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func._schema.name in SCANS:
            self.spans[self.at_step] += [span(t) for t in args[0]]
        return func(*args, **(kwargs or {}))


class Reads(NamedTuple):
    """How scans read each gradient and weight: whole reads of each, and the
    values read of part of a gradient (each such part, as a count of values)."""

    grads: dict[str, int]
    weights: dict[str, int]
    parts: list[int]
    other: list[Span]


def reads(model: nn.Module, spans: list[Span]) -> Reads:
    """Sorts `spans` by the parameter (as the step left it) whose gradient or weight they read."""
    named = list(model.named_parameters())
    grads = {n: 0 for n, _ in named}
    weights = {n: 0 for n, _ in named}
    parts: list[int] = []
    other: list[Span] = []
    for s in spans:
        for n, p in named:
            g = p.grad
            if s == span(p.detach()):
                weights[n] += 1
            elif g is not None and s == span(g):
                grads[n] += 1
            elif g is not None and g.data_ptr() <= s.start and s.start + s.nbytes <= span(g).start + span(g).nbytes:
                parts.append(s.nbytes // g.element_size())
            else:
                continue
            break
        else:
            other.append(s)
    return Reads(grads, weights, parts, other)


def clipped_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> None:
    """The usual step: zero_grad (set_to_none), forward, backward, clipping, optimizer.step()."""
    opt.zero_grad()
    loss_of(model, batch).backward()
    nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()


def accumulated_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> None:
    """Four backward passes into the same gradients, then one optimizer step."""
    opt.zero_grad()
    x, y = batch
    for part in range(4):
        loss_of(model, (x[2 * part : 2 * part + 2], y[2 * part : 2 * part + 2])).backward()
    opt.step()


def read_by_step(
    step: Callable[[nn.Module, torch.optim.Optimizer, Any], None], steps: int = 4
) -> list[tuple[Reads, Reads]]:
    """What each of `steps` monitored steps of `step` read (every=1): outside
    optimizer.step() (when backward ended) and inside it."""
    g = fresh_generator()
    model = make_model(g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mode = ScanReads()

    def entering(*args: object) -> None:  # registered before the Monitor's own pre-hook: runs first
        mode.at_step = True

    def leaving(*args: object) -> None:
        mode.at_step = False

    opt.register_step_pre_hook(entering)
    opt.register_step_post_hook(leaving)
    out = []
    with Monitor(model, opt):
        for batch in batches(g, steps):
            mode.spans = {False: [], True: []}
            with mode:
                step(model, opt, batch)
            out.append((reads(model, mode.spans[False]), reads(model, mode.spans[True])))
    return out


@pytest.mark.parametrize("step", [clipped_step, accumulated_step], ids=["clipped", "accumulated"])
def test_a_step_reads_each_gradient_once_and_each_weight_once(step: Callable[..., None]) -> None:
    """Once the Monitor has seen the loop let go of a step's gradients
    (zero_grad() sets them to None), it reads every gradient once per step, at
    optimizer.step(), after clipping, whatever the number of backward passes;
    and every weight once. When a backward pass ends it reads only a witness:
    the first 64 values of at most 8 gradients larger than that
    (monitor/deferred.py). The
    first step reads every gradient when each backward pass ends as well: the
    Monitor does not know yet whether the loop zeroes gradients in place,
    which would leave nothing to read of a step that optimizer.step() skips."""
    passes = 4 if step is accumulated_step else 1
    (first_backward, first_step), *later = read_by_step(step)
    assert set(first_backward.grads.values()) == {passes} and first_backward.parts == []
    assert set(first_step.grads.values()) == {1} and set(first_step.weights.values()) == {1}
    for backward, at_step in later:
        read = {n: backward.grads[n] + at_step.grads[n] for n in at_step.grads}
        assert set(read.values()) == {1}, read  # each gradient's bytes once a step ...
        assert set(at_step.grads.values()) == {1}  # ... at optimizer.step()
        assert set(backward.weights.values()) == {0} and set(at_step.weights.values()) == {1}  # each weight's once
        assert at_step.parts == [] and backward.other == at_step.other == []
        # When backward ends, the witness: the first values of some larger gradients.
        assert 0 < len(backward.parts) <= 8 * passes and set(backward.parts) == {64}, backward.parts


def test_a_loop_that_zeroes_gradients_in_place_keeps_both_reads() -> None:
    """zero_grad(set_to_none=False) zeroes the same tensors in place: a step
    that optimizer.step() then skips would leave nothing to read, so the
    Monitor reads the gradients when backward ends too (two reads a step)."""

    def in_place(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> None:
        opt.zero_grad(set_to_none=False)
        loss_of(model, batch).backward()
        opt.step()

    for backward, at_step in read_by_step(in_place):
        assert set(backward.grads.values()) == {1} and set(backward.weights.values()) == {0}
        assert set(at_step.grads.values()) == {1} and set(at_step.weights.values()) == {1}
        assert backward.parts == at_step.parts == [] and backward.other == at_step.other == []


@pytest.mark.parametrize("clip", [False, True], ids=["unscaled", "unscaled and clipped"])
def test_the_rows_are_the_gradients_that_optimizer_step_takes(clip: bool) -> None:
    """Read once, at optimizer.step(): after GradScaler's unscaling (which
    bumps no version counter, so only a read can see it) and after clipping."""
    g = fresh_generator()
    model = make_model(g)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    taken: dict[str, float] = {}

    def at_step(*args: object) -> None:  # registered after the Monitor's pre-hook: what it read
        taken.update({n: float(p.grad.double().norm()) for n, p in model.named_parameters()})

    monitor = Monitor(model, opt)
    opt.register_step_pre_hook(at_step)
    for batch in batches(g, 4):
        opt.zero_grad()
        scaler.scale(loss_of(model, batch)).backward()
        if clip:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        scaler.step(opt)
        scaler.update()
    rows = {t["name"]: t["norm"] for t in monitor.report().tensors if t["kind"] == "grad"}
    assert rows == pytest.approx(taken, rel=1e-6)
