"""The Monitor itself: its hooks, its lifecycle, and when it scans.

A monitored step runs one way: the hooks here decide when to read, then
step_reads.py gathers the step's tensors (grad_source.py) and scans them
into a StepRecord (scanner.py, zeroscan's native stats_many), and a report
decodes the records and hands them to the rules (rules.py, with the rule
book for values, zeroscan/value_rules.py), whose findings compose.py puts
into a Report. What is read of the optimizer is optimizer.py, why a
gradient is None is causes.py, the exchange across ranks is ranks.py, where
a NaN was born is nonfinite_trace.py (recording) and nonfinite_origin.py
(reading).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroscan.monitor.activations import ActivationScans, activation_modules, scannable
from zeroscan.monitor.backward import BackwardWatch
from zeroscan.monitor.causes import CauseFinder
from zeroscan.monitor.changes import Memberships
from zeroscan.monitor.compose import compose_report
from zeroscan.monitor.grad_source import GradReads
from zeroscan.monitor.hooks import Hooks, weak_hook
from zeroscan.monitor.open_step import OpenSteps
from zeroscan.monitor.optimizer import step_lrs
from zeroscan.monitor.optimizer_hook import attach_step
from zeroscan.monitor.options import check_step_call, nonfinite_trace, set_up
from zeroscan.monitor.report import Report, Thresholds
from zeroscan.monitor.scanner import Scanner
from zeroscan.monitor.step_reads import StepReads
from zeroscan.monitor.step_log import StepLog
from zeroscan.monitor.step_record import StepRecord
from zeroscan.monitor.structure import StructureWatch, carried_over
from zeroscan.monitor.turns import Turns

class Monitor:
    """Watches a model's gradients, weights and (optionally) activations.

    A monitored step reads every gradient once, as optimizer.step() takes it
    (from its step pre-hook, or Monitor.step()), and every weight once, in
    the same scan; a step that no optimizer step takes is read from the
    gradients backward left, held until the loop lets them go. Until the
    loop is seen letting its gradients go after a step, and in a loop that
    zeroes them in place, the gradients are also read when backward ends
    (deferred.py says what each rule then sees).

    model: the nn.Module whose parameters are scanned (named as in
        model.named_parameters(); tied parameters are scanned once).
    optimizer: optional; enables the "not_in_optimizer" check, lr-0 hints,
        the stopped_training check (changes.py), and (auto=True) scanning
        at each optimizer step; a wrapper of one (a Lookahead) is scanned at
        the step of the one it wraps (optimizer_hook.py); a DeepSpeed engine
        or ZeRO optimizer, or a Megatron-core optimizer, at its own step,
        reading the gradients where it keeps them (frameworks.py).
    every: scan one step in `every` (steps are counted from 0; step 0 is scanned).
    history: how many monitored steps the on-device ring keeps.
    activations: hook nn.ReLU / nn.ReLU6 / nn.GELU (dead units) and
        nn.Softmax (saturated rows) modules.
    thresholds: a Thresholds (defaults documented there).
    process_group: a torch.distributed process group (dist.group.WORLD for
        all ranks): global findings, sharded tensors merged and replicas
        compared across its ranks; building the Monitor and each monitored
        step are then collectives (ranks.py). None: this rank alone, or the
        mesh's group where every parameter is a DTensor on one mesh.
    histogram: also count, in the same scans, the exact log2-magnitude
        histogram of every gradient and weight (Report.histograms; see
        grad_histograms.py for what it keeps). Not with a process_group yet.
    trace_nonfinite: flag on the device, at every step, which module call
        first made inf/NaN from finite inputs, forward or backward, so that
        the report names where a non-finite gradient was born (a
        nonfinite_origin finding); costs and limits: nonfinite_trace.py.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Any | None = None,  # or a wrapper of one (optimizer.py)
        every: int = 1,
        *,
        history: int = 64,
        activations: bool = False,
        auto: bool = True,
        thresholds: Thresholds | None = None,
        process_group: dist.ProcessGroup | None = None,
        histogram: bool = False,
        trace_nonfinite: bool = False,
    ) -> None:
        op = "zeroscan.Monitor"
        setup = set_up(op, model, optimizer, every, history, trace_nonfinite, thresholds, process_group, histogram)
        self.thresholds, self.model, self.optimizer, self.every = setup.thresholds, model, optimizer, every
        self._params, self._framework, self._groups = setup.params, setup.framework, setup.groups
        self._ranks, self._mesh_warning, self.histogram = setup.ranks, setup.mesh_warning, setup.histogram
        self._memberships = Memberships()  # which param group held each parameter, at each step
        # Hooks hold this Monitor weakly, stay out of a pickled or copied model (hooks.py), and go with it.
        self._hooks = Hooks()
        self._finalizer = weakref.finalize(self, Hooks.remove_all, self._hooks)
        self._finalizer.atexit = False  # at exit the process, hooks and all, goes anyway
        self._auto = bool(auto and optimizer is not None)
        if self._auto:  # first: where it cannot be hooked, nothing else is on the model yet
            framework = self._framework
            owner, after = (optimizer, None) if framework is None else (framework.step_owner, "_after_framework_step")
            attach_step(op, owner, weak_hook(self, "_on_optimizer_step"), self._hooks,
                        after=None if after is None else weak_hook(self, after))
        # Where each gradient is read (grad_source.py): one that a framework moves after
        # backward is read at the step, and which parameters backward reached is told by a hook.
        self._grads = GradReads(setup.source, self._params, self._hooks)
        self._reads = StepReads(self._grads, Scanner(self._ranks), self.histogram)
        self._last_stepped: StepRecord | None = None  # its framework's step may say it skipped
        # The step path (hooks, possibly on autograd's threads) and report() from any
        # thread take turns, a waiting step first (turns.py).
        self._turns = Turns()
        self._training_thread: int | None = None  # the thread of the latest forward pass
        self._causes = CauseFinder(model, self._params, self._hooks)
        self._log = StepLog(history, self._ranks, self.histogram)  # the monitored steps kept
        self._count = 0
        self._closed = False
        self._activations = ActivationScans()  # this step's; the next step gets a new one
        self._in_auto = False
        self._steps = OpenSteps(self._reads)  # the step backward opened (deferred.py)
        self._watch = BackwardWatch(weak_hook(self, "_backward_started"), weak_hook(self, "_backward_finished"))
        self._structure = StructureWatch(model)
        self._hooks.forward_pre(model, weak_hook(self, "_root_pre"))
        self._hooks.forward(model, weak_hook(self, "_root_post"), always_call=True)
        if activations:
            for name, tag, module in activation_modules(model):
                self._hooks.forward(module, weak_hook(self, "_on_activation", name, tag))
        # After the root hooks above, which run first: _root_pre resets the trace's calls.
        self._trace = nonfinite_trace(setup, model, self._hooks, history, every) if trace_nonfinite else None
        self._causes.arm()  # the first monitored forward pass is probed

    # ---- lifecycle -------------------------------------------------------

    def __enter__(self) -> Monitor:
        self._check_open("__enter__")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Removes every hook this Monitor registered; safe to call twice.
        report() keeps working on what was recorded."""
        with self._turns.step:
            if self._closed:
                return
            self._closed = True
            # A closed Monitor holds no gradient, read first where a report() may still end the step.
            self._steps.let_go(self._params, read=self._ranks is None)
            self._causes.close()
            self._finalizer()  # removes the hooks, once: it will not run again when the Monitor is freed
            self._structure.remove()
            self._activations.scans = []

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def steps_seen(self) -> int:
        return self._count

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"zeroscan.Monitor.{what}: this Monitor is closed; create a new one")

    def _monitored(self) -> bool:
        return not self._closed and self._count % self.every == 0

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Monitor({type(self.model).__name__}, {len(self._params)} parameters, every={self.every}, {state})"

    # ---- hooks -----------------------------------------------------------

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        with self._turns.step:
            self._training_thread = threading.get_ident()
            self._watch.reset()
            self._steps.forward_started(self._params)
            if self._trace is not None:
                self._trace.forward_started()
            if self._monitored():
                self._causes.forward_started()

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        with self._turns.step:
            roots = self._watch.watch_output(output) if torch.is_grad_enabled() and not self._closed else []
            self._causes.forward_finished(roots, self._monitored())

    def _on_activation(self, name: str, tag: str, module: nn.Module, args: Any, output: Any) -> None:
        if not scannable(output):
            return
        with self._turns.step:
            if self._monitored():
                self._activations.scan(name, tag, module, output)

    def _on_optimizer_step(self) -> None:
        with self._turns.step:
            self._in_auto = True
            try:
                self._advance(None)
            finally:
                self._in_auto = False

    def _backward_started(self) -> None:
        with self._turns.step:
            self._steps.backward_started(self._params)

    def _backward_finished(self) -> None:
        with self._turns.step:
            if not self._closed:
                self._open_step()

    def _open_step(self) -> None:
        """Backward ended: the step it ends, if any, and the step it opens."""
        self._refresh_structure()
        open_step = self._steps.take()
        if open_step is not None and self._steps.touched:  # reset or changed, and no step ran: a skipped step
            self._end_step(open_step.record, stepped=False)
        self._close_trace()  # the passes since the last close are this step's
        record = None
        if self._monitored():  # the gradients as backward left them: a skipped step keeps these
            record = StepRecord(self._count)
            record.stepped = None
        self._steps.open(record, self._params, self._causes, self._ranks is not None)

    # ---- stepping --------------------------------------------------------

    def step(self, loss: torch.Tensor | None = None) -> None:
        """Marks the end of one training step (call after backward, before
        zero_grad). Scans on monitored steps; never reads the results. The
        learning rates recorded for the step are the optimizer's param
        groups' as they are now: call it before optimizer.step() (and before
        the scheduler steps), as the optimizer hook of auto=True does."""
        self._check_open("step")
        check_step_call(self._auto and not self._in_auto, loss)
        with self._turns.step:
            self._advance(loss)

    def _advance(self, loss: torch.Tensor | None) -> None:
        """The optimizer step runs now: the step that backward opened ends,
        scanned as it is now (after clipping and unscaling)."""
        self._refresh_structure()
        self._close_trace()  # passes no backward watch closed (none, usually)
        open_step = self._steps.take()
        opened = open_step is not None and open_step.record is not None  # monitored when backward ended
        record = open_step.record if opened else StepRecord(self._count) if self._monitored() else None
        if record is not None:
            backward = open_step.grads if opened else None
            self._reads.at_step(record, self._params, loss, backward, self._activations, self._causes, self._watch)
        if record is not None and self._groups is not None:  # the rates and groups this step runs with
            record.lrs = step_lrs(self._groups)
            self._memberships.observe(record.step, self._groups, self._params, self._log.records)
        self._causes.stamp(record, open_step)  # what the step ran under: autocast, GradScaler (context.py)
        self._steps.habit.stepped(self._params)
        self._end_step(record, stepped=True)
        self._last_stepped = record
        self._grads.stepped(self._params)

    def _after_framework_step(self, returned: Any) -> None:
        with self._turns.step:  # a framework's step returned: it may have updated nothing (frameworks.py)
            if self._last_stepped is not None and self._framework is not None:
                self._framework.judge(self._last_stepped, returned)
            self._last_stepped = None

    def _end_step(self, record: StepRecord | None, stepped: bool) -> None:
        """One step ends (`record`: its scan, None when it was not monitored)."""
        if record is not None:
            record.stepped = stepped
            self._log.keep(record)
        self._count += 1
        self._causes.step_finished(record is not None, self._watch.fired)
        self._activations = ActivationScans()

    # ---- reporting -------------------------------------------------------

    def report(self) -> Report:
        """Reads the recorded history back (one copy per device) and judges it.
        With no step recorded it scans the gradients as they are now and says
        that no step was seen. With a process group it reads the merged
        summaries and issues no collective: any rank may call it, alone.
        Safe from any thread while training runs (turns.py); from another
        thread than the training one it judges the steps that have ended."""
        with self._turns.report:
            return self._report()

    def _report(self) -> Report:
        # Across ranks only the step path, which every rank runs, takes in a change of the
        # model (its next merge then checks the ranks agree): one rank taking it in alone
        # would pack other rows than the others at the next step.
        self._refresh_structure(check=self._ranks is None)
        open_step = self._steps.step
        on_training_thread = self._training_thread in (None, threading.get_ident())
        if open_step is not None and on_training_thread and self._ranks is None:
            # A backward pass with no step after it: GradScaler skipped the step (its
            # unscaling bumps no version counter, so nothing else tells), or no step
            # follows at all. Judged as such: a skip only if its gradients hold inf/NaN.
            # Across ranks the step stays open (ending it merges it, a collective that
            # only the ranks calling report() would make): the next backward pass ends it.
            self._steps.read_held(self._params)
            self._steps.take()
            self._end_step(open_step.record, stepped=False)
        recorded = self._log.decoded()
        if not recorded:  # this rank's own scan, now: no merge was started for it
            open_record = self._steps.step.record if self._steps.step is not None else None
            recorded = [self._reads.now(open_record, self._params, self._activations, self._causes, self._watch)]
        traced = list(self._trace.steps) if self._trace is not None else None
        return compose_report(
            self._params, recorded, self.thresholds, self._groups, self.model, traced, self._causes, self._memberships,
            [self._mesh_warning] if self._mesh_warning is not None else [], self._grads.source.where,
        )

    def _close_trace(self) -> None:
        """Ends the trace's segment as this step's (NonfiniteTrace.end_step)."""
        if self._trace is not None and not self._closed:
            self._trace.end_step(self._count, self.model, self._params, self._structure.retrace)
            self._structure.retrace = False

    def _refresh_structure(self, check: bool = False) -> None:
        """Takes in a change of the model (structure.py); `check`: compare the parameters anyway."""
        params = self._structure.take_in(self._params, check)
        if params is None:
            return
        new_index = carried_over(self._params, params)
        self._log.renumber(params, new_index)
        self._memberships.renumber(new_index)
        self._grads.renumber(params, new_index)
        self._steps.renumber(params, new_index)
        self._params = params
        self._causes.drop()
        self._causes = CauseFinder(self.model, params, self._hooks)
        self._causes.arm()
