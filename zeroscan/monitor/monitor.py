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
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroscan.monitor import step_record
from zeroscan.monitor.activations import ActivationScans, activation_modules, scannable
from zeroscan.monitor.backward import BackwardWatch, grads_touched, reset_kind
from zeroscan.monitor.causes import CauseFinder
from zeroscan.monitor.changes import Memberships
from zeroscan.monitor.compose import compose_report
from zeroscan.monitor.deferred import OpenStep, ResetHabit
from zeroscan.monitor.frameworks import gradient_source, recognize
from zeroscan.monitor.grad_histograms import check_histogram, free_earlier_fields
from zeroscan.monitor.grad_source import GradReads
from zeroscan.monitor.graph import Root, output_roots
from zeroscan.monitor.hooks import Hooks, weak_hook
from zeroscan.monitor.nonfinite_trace import NonfiniteTrace
from zeroscan.monitor.optimizer import param_groups_holder, step_lrs
from zeroscan.monitor.optimizer_hook import attach_step
from zeroscan.monitor.options import check_options
from zeroscan.monitor.ranks import RankExchange, check_group, decode, default_group
from zeroscan.monitor.report import Report, Thresholds
from zeroscan.monitor.scanner import Scanner
from zeroscan.monitor.step_reads import StepReads
from zeroscan.monitor.step_record import StepRecord, renumber
from zeroscan.monitor.structure import StructureWatch, carried_over
from zeroscan.monitor.turns import Turns

MAX_TRACED_STEPS = 1024  # with every > 1, steps the trace keeps at most (about 14 KiB each)


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
        all ranks): the report then shows global findings, sharded tensors
        merged and replicas compared across the group's ranks (see the module
        doc). Every DTensor parameter's device mesh must hold exactly the
        group's ranks. Building the Monitor is then a collective (every rank
        of the group checks that the others monitor the same parameters), and
        so is each monitored step. None (the default): this rank alone, or,
        where every parameter is a DTensor on one mesh, that mesh's group
        (ranks.default_group; otherwise a WARNING says what to pass).
    histogram: also count, in the same scans, the exact log2-magnitude
        histogram of every gradient and weight (Report.histograms; see
        grad_histograms.py for what it keeps). Not with a process_group yet.
    trace_nonfinite: at every step (monitored or not), flag on the device
        whether each module call's inputs and outputs, the gradients backward
        brings them, and each parameter's incoming gradient hold inf/NaN, so
        that once a gradient holds inf/NaN the report names where it was born
        (a nonfinite_origin finding, and Report.nonfinite_origin): the step,
        the pass, and the first module whose output or gradient went
        non-finite from finite inputs. One native pass per tensor, no host
        sync; what it costs and cannot see: nonfinite_trace.py and the README.
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
        self.thresholds = check_options(op, model, every, history, trace_nonfinite, thresholds)
        framework = recognize(optimizer)  # DeepSpeed's, Megatron's: their own step, groups and gradients
        groups = None if optimizer is None else param_groups_holder(op, optimizer, framework)  # whose lrs are read
        self.model = model
        self.optimizer = optimizer
        self._groups = groups
        self._memberships = Memberships()  # which param group held each parameter, at each step
        self.every = every
        self._params = step_record.collect_params(model)
        self._framework = framework
        process_group, self._mesh_warning = default_group(process_group, self._params)
        group = check_group(op, process_group, self._params)
        histogram = check_histogram(op, histogram, group)
        self._ranks = None if group is None else RankExchange(group, self._params, self.thresholds.replica_rtol)
        source = gradient_source(op, framework, groups, self._params)
        # Hooks hold this Monitor weakly, stay out of a pickled or copied model (hooks.py), and go with it.
        self._hooks = Hooks()
        self._finalizer = weakref.finalize(self, Hooks.remove_all, self._hooks)
        self._finalizer.atexit = False  # at exit the process, hooks and all, goes anyway
        self._auto = bool(auto and optimizer is not None)
        if self._auto:  # first: where it cannot be hooked, nothing else is on the model yet
            owner, after = (optimizer, None) if framework is None else (framework.step_owner, "_after_framework_step")
            attach_step(op, owner, weak_hook(self, "_on_optimizer_step"), self._hooks,
                        after=None if after is None else weak_hook(self, after))
        # Where each gradient is read (grad_source.py): one that a framework moves after
        # backward is read at the step, and which parameters backward reached is told by a hook.
        self._grads = GradReads(source, self._params, self._hooks)
        self._reads = StepReads(self._grads, Scanner(self._ranks), histogram)
        self._last_stepped: StepRecord | None = None  # its framework's step may say it skipped
        # The step path (hooks, possibly on autograd's threads) and report() from any
        # thread take turns, a waiting step first (turns.py).
        self._turns = Turns()
        self._training_thread: int | None = None  # the thread of the latest forward pass
        self._causes = CauseFinder(model, self._params, self._hooks)
        self._records: deque[StepRecord] = deque(maxlen=history)
        self._count = 0
        self._closed = False
        self._activations = ActivationScans()  # this step's; the next step gets a new one
        self._in_auto = False
        self._open: OpenStep | None = None
        self._open_touched = False
        self._habit = ResetHabit()  # whether the gradients can wait for optimizer.step() (deferred.py)
        self._watch = BackwardWatch(weak_hook(self, "_backward_started"), weak_hook(self, "_backward_finished"))
        self._structure = StructureWatch(model)
        self._hooks.forward_pre(model, weak_hook(self, "_root_pre"))
        self._hooks.forward(model, weak_hook(self, "_root_post"), always_call=True)
        if activations:
            for name, tag, module in activation_modules(model):
                self._hooks.forward(module, weak_hook(self, "_on_activation", name, tag))
        # After the root hooks above, which run first: _root_pre resets the trace's calls.
        # The trace keeps as many steps as the records span (every monitored step of
        # `history`, and the steps between them), up to MAX_TRACED_STEPS.
        kept = min(history * every, max(history, MAX_TRACED_STEPS))
        self._trace = NonfiniteTrace(model, self._params, self._hooks, kept) if trace_nonfinite else None
        self._retrace = False  # the model changed: the trace hooks it again at the next step
        if self._trace is not None and self._ranks is not None:
            self._trace.exchanging = True
            self._ranks.born = self._trace.born_words
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
            open_step = self._open
            if open_step is not None and open_step.pending is not None:  # a closed Monitor holds no gradient
                if self._ranks is None:  # a report() may still end the step; across ranks no step path will
                    self._read_pending(open_step)
                self._open = open_step._replace(pending=None)
            self._causes.close()
            self._finalizer()  # removes the hooks, once: it will not run again when the Monitor is freed
            self._structure.remove()
            self._activations.scans = []

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def histogram(self) -> bool:
        return self._reads.histogram

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
            self._habit.observe(self._params)
            open_step = self._open
            if open_step is not None and open_step.pending is not None and grads_touched(self._params, open_step.grads):
                self._read_pending(open_step)  # a step not taken, its gradients let go: freed as soon as read
            if self._trace is not None:
                self._trace.forward_started()
            if self._monitored():
                self._causes.forward_started()

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        with self._turns.step:
            roots: list[Root] = []
            if torch.is_grad_enabled() and not self._closed:
                tensors: list[torch.Tensor] = []
                output_roots(output, roots, tensors)
                self._watch.watch([t.grad_fn for t in tensors], tensors)
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
        # Read now, before this pass accumulates into .grad: gradients left as the
        # last backward pass left them mean gradient accumulation (the step goes on).
        with self._turns.step:
            self._habit.observe(self._params, last=True)
            open_step = self._open
            self._open_touched = open_step is not None and self._grads.touched(self._params, open_step.grads)
            if self._open_touched:
                assert open_step is not None
                self._read_pending(open_step)  # before this pass writes gradients (into the same memory, maybe)

    def _backward_finished(self) -> None:
        with self._turns.step:
            self._on_backward_finished()

    def _on_backward_finished(self) -> None:
        if self._closed:
            return
        self._refresh_structure()
        open_step = self._open
        if open_step is not None:
            self._open = None
            if self._open_touched:  # reset or changed, and no step ran: a skipped step
                self._end_step(open_step.record, stepped=False)
        self._close_trace()  # the passes since the last close are this step's
        record = None
        pending = None
        if self._monitored():  # the gradients as backward left them: a skipped step keeps these
            record = StepRecord(self._count)
            record.stepped = None
            pending = self._reads.at_backward_end(
                record, self._params, self._causes, self._habit.defer, self._ranks is not None
            )
        self._open = OpenStep(record, self._grads.state(self._params), pending)

    def _read_pending(self, open_step: OpenStep) -> None:
        """The open step's gradients were touched with no optimizer step: its
        record reads the gradients backward left, held since (deferred.py),
        and the Monitor learns how the loop resets them."""
        pending = open_step.pending
        if pending is None or open_step.record is None:
            return
        kind = reset_kind(self._params, open_step.grads)
        if kind is not None:  # zeroed in place: nothing of a later skip would be left to read
            self._habit.learn(in_place=kind == "in place")
        if self._open is open_step:
            self._open = open_step._replace(pending=None)
        self._reads.held(open_step.record, pending, self._params)

    # ---- stepping --------------------------------------------------------

    def step(self, loss: torch.Tensor | None = None) -> None:
        """Marks the end of one training step (call after backward, before
        zero_grad). Scans on monitored steps; never reads the results. The
        learning rates recorded for the step are the optimizer's param
        groups' as they are now: call it before optimizer.step() (and before
        the scheduler steps), as the optimizer hook of auto=True does."""
        self._check_open("step")
        if self._auto and not self._in_auto:
            raise RuntimeError(
                "zeroscan.Monitor.step: this Monitor already scans at every optimizer.step() "
                "(it was given an optimizer with auto=True); drop the manual step() call, "
                "or create the Monitor with auto=False"
            )
        if loss is not None and not isinstance(loss, torch.Tensor):
            raise TypeError(f"zeroscan.Monitor.step: loss must be a tensor or None, got {type(loss).__name__}")
        with self._turns.step:
            self._advance(loss)

    def _advance(self, loss: torch.Tensor | None) -> None:
        """The optimizer step runs now: the step that backward opened ends,
        scanned as it is now (after clipping and unscaling)."""
        self._refresh_structure()
        self._close_trace()  # passes no backward watch closed (none, usually)
        open_step, self._open = self._open, None
        record = None
        if open_step is not None and open_step.record is not None:
            record = open_step.record
            self._reads.at_step(record, self._params, loss, open_step.grads, self._activations, self._causes, self._watch)
        elif self._monitored():
            record = StepRecord(self._count)
            self._reads.at_step(record, self._params, loss, None, self._activations, self._causes, self._watch)
        if record is not None and self._groups is not None:  # the rates and groups this step runs with
            record.lrs = step_lrs(self._groups)
            self._memberships.observe(record.step, self._groups, self._params, self._records)
        self._causes.stamp(record, open_step)  # what the step ran under: autocast, GradScaler (context.py)
        self._habit.stepped(self._params)
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
        monitored = record is not None
        if record is not None:
            record.stepped = stepped
            if self._ranks is not None:
                record.exchange = self._ranks.start(record)
                record.groups, record.fields = [], []  # the summary is all this step keeps
            if self.histogram:
                free_earlier_fields(self._records, record)
            self._records.append(record)
        self._count += 1
        self._causes.step_finished(monitored, self._watch.fired)
        self._activations = ActivationScans()

    # ---- reporting -------------------------------------------------------

    def report(self) -> Report:
        """Reads the recorded history back (one copy per device) and judges it.
        With no step recorded it scans the gradients as they are now (as the
        last backward pass left them) and says that no step was seen.
        With a process group it reads the recorded steps' merged summaries
        and issues no collective, so any rank may call it at any point of a
        step, alone (see the package doc).

        Safe from any thread while training runs (a logger's, a dashboard's):
        the training thread's hooks wait while a report is being made, and go
        before the next one (turns.py); a report made on another thread than
        the training one judges the steps
        that have ended, leaving a step that is between backward and
        optimizer.step() open."""
        with self._turns.report:
            return self._report()

    def _report(self) -> Report:
        # Across ranks only the step path, which every rank runs, takes in a change of the
        # model (its next merge then checks the ranks agree): one rank taking it in alone
        # would pack other rows than the others at the next step.
        self._refresh_structure(check=self._ranks is None)
        open_step = self._open
        on_training_thread = self._training_thread in (None, threading.get_ident())
        if open_step is not None and on_training_thread and self._ranks is None:
            # A backward pass with no step after it: GradScaler skipped the step (its
            # unscaling bumps no version counter, so nothing else tells), or no step
            # follows at all. Judged as such: a skip only if its gradients hold inf/NaN.
            # Across ranks the step stays open (ending it merges it, a collective that
            # only the ranks calling report() would make): the next backward pass ends it.
            self._read_pending(open_step)
            self._open = None
            self._end_step(open_step.record, stepped=False)
        recorded = list(self._records)
        decode(recorded, self._ranks)
        if not recorded:  # this rank's own scan: no merge was started for it
            # An open step's gradients were read when backward ended: no step has been taken
            # yet, so the Monitor does not know yet whether they may wait (deferred.py).
            open_record = self._open.record if self._open is not None else None
            recorded = [self._reads.now(open_record, self._params, self._activations, self._causes, self._watch)]
        traced = list(self._trace.steps) if self._trace is not None else None
        return compose_report(
            self._params, recorded, self.thresholds, self._groups, self.model, traced, self._causes, self._memberships,
            [self._mesh_warning] if self._mesh_warning is not None else [], self._grads.source.where,
        )

    def _close_trace(self) -> None:
        """Ends the trace's segment as this step's (NonfiniteTrace.end_step)."""
        if self._trace is not None and not self._closed:
            self._trace.end_step(self._count, self.model, self._params, self._retrace)
            self._retrace = False

    # ---- the model as it is now ---------------------------------------------

    def _refresh_structure(self, check: bool = False) -> None:
        """Takes in a change of the model's modules or parameters (see
        structure.py); `check` also compares the parameters themselves."""
        changed = self._structure.changed
        if not (changed or check):
            return
        params = step_record.collect_params(self.model)
        now = [(p.name, id(p.tensor)) for p in params]
        self._structure.rebuild()
        same = now == [(p.name, id(p.tensor)) for p in self._params]
        self._retrace = self._retrace or changed or not same  # the trace hooks every module as it is now
        if same:
            return
        # The records kept so far are read back (a rare host sync) and renumbered.
        recorded = list(self._records)
        decode(recorded, self._ranks)
        if self._ranks is not None:
            self._ranks.set_params(params)
        new_index = carried_over(self._params, params)
        requires_grad = tuple(p.tensor.requires_grad for p in params)
        for r in recorded:
            renumber(r, new_index, requires_grad)
        self._memberships.renumber(new_index)
        self._grads.renumber(params, new_index)
        self._habit.forget()
        if self._open is not None:
            self._open = self._open.renumbered(new_index, requires_grad, self._grads.state(params))
        self._params = params
        self._causes.drop()
        self._causes = CauseFinder(self.model, params, self._hooks)
        self._causes.arm()
