"""Why a gradient is None or exactly zero: the Monitor's cause analysis.

A root forward hook keeps the outputs of the last forward pass of a
monitored step (graph.Root: where each sits in the output, and its grad_fn),
and the backward watch (backward.py) says which of them backward went
through. When a parameter that requires grad has no gradient, the analysis
goes from what is surest to what is least sure:

- the engine itself: when backward finishes, an AccumulateGrad node that
  the engine was told not to run means torch.autograd.grad or
  backward(inputs=...) left the parameter out (`backward_finished`);
- the graph (graph.py): a parameter reached only through outputs that
  backward never went through feeds an output left out of the loss; one
  reached through a custom autograd.Function (or a torch.compile graph)
  whose backward gave it nothing is cut there;
- the probe (probe.py), on one forward pass: a parameter that feeds a
  result kept with its graph that the loss never used (an auxiliary loss
  left out, kept.py), one used before a cut (.detach(), .data, no_grad, an
  .item() round trip, ...) or under no_grad, in a module that never ran, or
  never used at all.

The probe runs on the first monitored step and again only when an
unexplained None gradient shows up, so healthy training never pays for it.
Under torch.compile the probed forward pass runs eagerly: dynamo captures no
graph while the probe's mode is active (its observer is compiler-disabled),
so the probe sees each op, where a compiled graph's one backward node would
stand for all of them.

A gradient that is exactly zero everywhere is explained at report() time
(`explain_zeros`), from the graph of the latest monitored step kept here:
by a hook of the user's on the way, or an output that enters the loss
weighted by 0 (zero_causes.py).

Each answer (step_record.Why) carries its root: the cause worded for every
parameter it explains, so that one root cause is one finding.

Beside the answers, what a step ran under (autocast, a GradScaler, writes
into the gradients after backward, a pipeline stage; context.py) goes with
its record as its optimizer step runs (`stamp`), for the rules to read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zeroscan.monitor import graph, zero_causes
from zeroscan.monitor.context import ContextWatch
from zeroscan.monitor.deferred import OpenStep
from zeroscan.monitor.graph import Root
from zeroscan.monitor.hooks import Hooks
from zeroscan.monitor.kept import KeptGraphs, unused_result_why
from zeroscan.monitor.labels import module_label
from zeroscan.monitor.probe import Probe
from zeroscan.monitor.step_record import Param, StepRecord, Why
from zeroscan.verdicts import Cause
from zeroscan.words import is_are, listed

# The root of an answer that a torch.compile graph hides (see _why_none_in_graph).
COMPILED_ROOT = (
    "these parameters enter a torch.compile graph whose backward gives them no gradient: their path to the "
    "outputs is cut inside the compiled code (a .detach(), .data, torch.no_grad() or an .item()/.tolist() "
    "round trip), or the output they feed never enters the loss; torch.compile hides which, so zeroscan "
    "probes the next monitored forward pass (run eagerly) to find it"
)
MAX_ENGINE_QUERIES = 256  # parameters without a gradient asked about per backward pass (an idle MoE has many)
CUT_HELP = "a cut tensor (also after a .numpy()/.item()/.tolist() round trip) carries no gradient back"


class CauseFinder:
    """The cause analysis of one Monitor: the outputs' graph of the current
    step, the probe, and the causes found so far that cannot change."""

    def __init__(self, model: nn.Module, params: list[Param], hooks: Hooks) -> None:
        self.model = model
        self._hooks = hooks  # the Monitor's: the probe's hooks go with its others
        self._params = params
        self._pindex = {id(p.tensor): p.index for p in params}
        # The graph walks' index: also the tensors a wrapper put in a parameter's place
        # during forward (FSDP2's unsharded parameters), as the probe saw them.
        self._walk_index = dict(self._pindex)
        self._by_owner: dict[str, dict[str, int]] = {}
        for p in params:
            for name in (p.name, *p.aliases):
                owner, _, attr = name.rpartition(".")
                self._by_owner.setdefault(owner, {})[attr] = p.index
        self._probe: Probe | None = None
        self._probe_next = False
        self._causes: dict[int, Why] = {}
        self._eager: dict[int, Why] = {}  # the latest answer not hidden by a torch.compile graph
        self.roots: list[Root] = []  # the outputs of the latest monitored forward pass
        # The outputs of the latest monitored step, and those a gradient reached (by
        # position), kept for report(): explain_zeros reads them.
        self.latest: list[Root] = []
        self.latest_fired: set[int] = set()
        self.not_stored: set[int] = set()  # left out of the latest backward pass by the engine
        self.queried: set[int] = set()  # those the engine was asked about
        self._closed_view: graph.GraphView | None = None  # the latest graph's answers, once closed
        self._asked: tuple | None = None  # what explain() was last asked, and its answers
        self._answers: dict[int, Why] = {}
        self.forward_seen = False
        self.forward_grad = True
        self.context = ContextWatch(params)  # what a step ran under, beside the scan (context.py)
        self._kept: KeptGraphs | None = None  # what explain() found kept by the probed pass

    def forward_started(self) -> None:
        """A monitored forward pass of the model begins."""
        self.forward_seen = True
        self.forward_grad = torch.is_grad_enabled()
        self.context.forward_started()
        self.latest = []  # a step's graph is held no longer than until the next one begins
        probe = self._probe
        if probe is not None and not probe.active and not probe.done:
            probe.active = True
            probe.__enter__()

    def forward_finished(self, roots: list[Root], monitored: bool) -> None:
        """A forward pass of the model ended (also by an exception); `roots`:
        its outputs."""
        probe = self._probe
        if probe is not None and probe.active:
            probe.__exit__(None, None, None)
            probe.active = False
            probe.done = True
            self._walk_index = dict(probe.pindex)  # the parameters, and the stand-ins this probe saw
            if monitored and torch.is_grad_enabled():
                self.context.probed(probe.half, probe.input_cut, [r.node for r in roots], self._walk_index)
        if monitored and torch.is_grad_enabled():
            self.roots = roots  # the latest forward pass of this step

    def backward_finished(self, missing: list[int]) -> None:
        """Runs as a backward pass through the outputs finishes, while the
        engine still holds it: which of the parameters `missing` (no
        gradient) it was told not to accumulate into (torch.autograd.grad,
        or backward(inputs=...) without them)."""
        self.not_stored = set()
        self.queried = set()
        for i in missing[:MAX_ENGINE_QUERIES]:
            try:
                node = torch.autograd.graph.get_gradient_edge(self._params[i].tensor).node
                if not torch._C._will_engine_execute_node(node):
                    self.not_stored.add(i)
                self.queried.add(i)
            except RuntimeError as err:  # torch refuses a leaf's node inside autograd.grad
                if "autograd.grad" in str(err):
                    self.not_stored.add(i)
                    self.queried.add(i)
            except Exception:  # a wrapper's parameter with no node of its own: nothing known
                pass

    def stamp(self, record: StepRecord | None, open_step: OpenStep | None) -> None:
        """The optimizer step of `record` (None: not monitored) runs now: what
        it ran under goes with it (context.py); `open_step`: the step that
        backward opened, with the gradients as backward() left them."""
        if record is None:
            return
        try:
            record.context = self.context.stamp(open_step.grads if open_step is not None else None)
        except Exception:  # what the step ran under is a hint: never worth breaking the step for
            record.context = None

    def step_finished(self, monitored: bool, fired: set[int]) -> None:
        """The training step ended: a used probe goes, a wanted one is armed;
        `fired`: the outputs (by position) that a gradient reached."""
        if monitored:
            if self._probe is not None and self._probe.done:
                self.drop()
            if self._probe_next:
                self.arm()
            if self.roots:
                self.latest, self.latest_fired = self.roots, set(fired)
        self.roots = []
        self.not_stored = set()
        self.forward_seen = False
        self._kept = None

    def arm(self) -> None:
        """Probes the next monitored forward pass."""
        self._probe_next = False
        if self._probe is not None:  # still waiting for a monitored forward pass
            return
        probe = Probe(self._pindex, self._by_owner)
        finder = self
        for name, module in self.model.named_modules():

            def pre(module: nn.Module, args: Any, kwargs: dict[str, Any], label: str = name) -> None:
                if probe.active:
                    probe.enter_module(label, module, finder.forward_grad, args, kwargs)
                elif probe.done:  # called after the model's forward, before the step ends
                    probe.outside.setdefault(label, torch.is_grad_enabled())

            def post(module: nn.Module, args: Any, output: Any) -> None:
                if probe.active:
                    probe.leave_module(output)

            probe.handles.append(self._hooks.forward_pre(module, pre, with_kwargs=True))
            probe.handles.append(self._hooks.forward(module, post, always_call=True))
        self._probe = probe

    def drop(self) -> None:
        probe = self._probe
        if probe is None:
            return
        if probe.active:
            probe.__exit__(None, None, None)
            probe.active = False
        for h in probe.handles:
            self._hooks.remove(h)
        probe.handles.clear()
        self._probe = None

    def close(self) -> None:
        """The Monitor closes: the probe goes, and no graph of the model is
        held (what report() will ask of the latest one is worked out first)."""
        self.drop()
        self.roots = []
        if self.latest:
            try:
                self._closed_view = self._latest_view(set(range(len(self._params)))).without_graph()
            except graph.TooDeep:  # nothing known of that graph, rather than walking it
                self._closed_view = None
        self.latest = []

    def _latest_view(self, targets: set[int]) -> graph.GraphView:
        """The graph of the latest monitored step, as far as backward went through it."""
        if not self.latest and self._closed_view is not None:
            return self._closed_view
        roots = [r for k, r in enumerate(self.latest) if k in self.latest_fired]
        return graph.GraphView(roots, set(range(len(roots))), None, self._walk_index, self._pindex, targets)

    def explain(
        self, missing: list[int], loss: torch.Tensor | None, backward_seen: bool | None, fired: set[int]
    ) -> dict[int, Why]:
        """Why each parameter in `missing` (indices) has no gradient; answers
        that cannot change are kept. `backward_seen`: whether a backward pass
        went through the outputs of the latest forward pass (None: not
        known); `fired`: which outputs a gradient reached (by position). A
        step that asks what the step before asked, in the same
        circumstances, gets the same answers without another look."""
        causes = {i: self._causes[i] for i in missing if i in self._causes}
        rest = [i for i in missing if i not in causes]
        if not rest:
            return causes
        probe = self._probe if self._probe is not None and self._probe.done else None
        asked = (
            tuple(rest), frozenset(fired), len(self.roots), backward_seen, loss is None, probe is None,
            frozenset(self.not_stored), self.forward_seen, self.forward_grad,
        )
        if probe is None and asked == self._asked:
            return causes | {i: self._answers[i] for i in rest if i in self._answers}
        view = graph.GraphView(
            self.roots, fired, loss.grad_fn if loss is not None else None, self._walk_index, self._pindex, set(rest)
        )
        self._kept = None if probe is None else KeptGraphs(
            self.model, probe.outputs, probe.taken, [r.node for r in self.roots], self._walk_index
        )
        try:
            answers = self._answer(rest, view, probe, loss, backward_seen)
        except graph.TooDeep:  # the graph is too deep to walk: no cause is claimed
            answers = {}
        self._kept = None  # holds graphs: no longer than the question
        self._asked, self._answers = asked, answers
        return causes | answers

    def _answer(
        self, rest: list[int], view: graph.GraphView, probe: Probe | None, loss: torch.Tensor | None,
        backward_seen: bool | None,
    ) -> dict[int, Why]:
        answers = {}
        for i in rest:
            why, stable, wants_probe = self._why_none(i, view, probe, loss, backward_seen)
            if why.root is COMPILED_ROOT and i in self._eager:
                why = self._eager[i]  # what an eager step saw says more than the compiled graph
            elif why.root is not COMPILED_ROOT:
                self._eager[i] = why
            answers[i] = why
            if stable:
                self._causes[i] = why
            if wants_probe and probe is None:
                self._probe_next = True
        return answers

    def _why_none(
        self, i: int, view: graph.GraphView, probe: Probe | None, loss: torch.Tensor | None, backward_seen: bool | None
    ) -> tuple[Why, bool, bool]:
        """(why, stable, whether a probe would tell more) for parameter `i` (see explain)."""
        name = self._params[i].name
        in_graph = i in view.reached or (view.from_loss is not None and i in view.from_loss)
        if in_graph:
            return self._why_none_in_graph(i, name, view, backward_seen)
        if probe is not None:
            why = self._why_none_probed(i, name, probe)
            if why is not None:
                return why, True, False
        if not self.forward_seen and loss is None:
            return Why(Cause.NO_BACKWARD, (
                f"{name} has no gradient and no forward pass of the model was seen this step "
                "(call Monitor.step() after forward and backward, or pass the loss: step(loss))"
            )), False, True
        if not self.forward_grad:
            root = "the model's forward ran under torch.no_grad() or inference_mode, so no parameter got a gradient"
            return Why(Cause.DETACHED, (
                f"the model's forward ran under torch.no_grad() or inference_mode, so {name} got no gradient"
            ), root), False, True
        where = "the loss" if loss is not None else "the model's outputs"
        return Why(Cause.NOT_REACHED, (
            f"backward from {where} does not reach {name}: it is unused in forward or detached on "
            "the way (.detach(), torch.no_grad(), a .numpy()/.item() round trip)"
            + ("" if view.nodes else "; the outputs carry no autograd graph at all")
        )), False, True

    def _why_none_in_graph(
        self, i: int, name: str, view: graph.GraphView, backward_seen: bool | None
    ) -> tuple[Why, bool, bool]:
        """Parameter `i` is in the graph of the outputs (or of the loss) and got no gradient."""
        if view.from_loss is not None and i in view.reached and i not in view.from_loss:
            root = (
                "these parameters feed the model's outputs, but the loss does not use the output they feed "
                "(an auxiliary head or output left out of the loss)"
            )
            return Why(Cause.UNUSED, (
                f"{name} feeds the model's outputs, but the loss does not use the output it feeds "
                "(an auxiliary head or output left out of the loss)"
            ), root), False, False
        if backward_seen is False:
            return Why(Cause.NO_BACKWARD, (
                f"{name} is in the autograd graph of the model's outputs, but no backward pass through "
                "those outputs ran since the forward pass: backward() was not called on a loss built from "
                "them, or the loss was rebuilt from a Python number (loss.item(), float(loss), "
                "torch.tensor(loss)), which carries no graph back to the model"
            ), "no backward pass through the model's outputs ran since the forward pass (backward() not "
                "called on a loss built from them, or a loss rebuilt from a Python number)"), False, False
        if backward_seen and i in self.not_stored and i in view.own:
            return Why(Cause.NO_BACKWARD, (
                f"the backward pass through the model's outputs was told to leave {name} out: "
                "torch.autograd.grad, or backward(inputs=...) without it, computes gradients without "
                "storing them in .grad"
            ), "the backward pass was told to leave these parameters out: torch.autograd.grad, or "
                "backward(inputs=...) without them, computes gradients without storing them in .grad"), False, False
        if backward_seen and view.some_left_out and i not in view.from_fired:
            labels = view.left_out.get(i, [])
            which = listed(labels, 4) if labels else "an output of the model"
            root = (
                f"{which} {is_are(len(labels) or 1)} computed but never enter{'s' if len(labels) <= 1 else ''} "
                "the loss: backward never went through it, so the parameters that feed only it get no "
                "gradient (a head or an auxiliary loss left out of the total loss)"
            )
            return Why(Cause.UNUSED, (
                f"{name} feeds only {which}, which is computed but never enters the loss: backward went "
                "through the model's other outputs only (a head or an auxiliary loss left out of the total loss)"
            ), root), False, False
        hooks = graph.tensor_hooks(self._params[i].tensor)
        if backward_seen and hooks:
            how, hook = hooks[0]
            return Why(Cause.NO_BACKWARD, (
                f"backward() reached {name} but left its .grad None, and a hook is on it: "
                f"{graph.hook_label(hook)} ({how}); a hook that sets .grad to None (an optimizer run "
                "in backward, say) does this"
            )), False, False
        crossings = view.crossings.get(i, []) if backward_seen else []
        if any(c.compiled for c in crossings):
            return Why(Cause.DETACHED, (
                f"{name} enters the torch.compile graph, whose backward gives it no gradient: its path to the "
                "outputs is cut inside the compiled code (a .detach(), .data, torch.no_grad() or an "
                ".item()/.tolist() round trip), or the output it feeds never enters the loss; torch.compile "
                "hides which, so zeroscan probes the next monitored forward pass (run eagerly) to find it"
            ), COMPILED_ROOT), False, True
        if crossings and i not in view.free:  # every way from the outputs to it crosses a Function
            named = listed(list(dict.fromkeys(f"{c.name} (input #{c.input})" for c in crossings)), 3)
            root = (
                f"every way from the outputs to these parameters goes through the custom autograd.Function "
                f"{named}, whose backward returns None for that input (0-based), which cuts the path; return "
                "a gradient for that input, or mark it non-differentiable on purpose"
            )
            return Why(Cause.DETACHED, (
                f"{name} gets no gradient, and every way from the outputs to it goes through the custom "
                f"autograd.Function {named}: its backward returns None for that input (0-based); return a "
                "gradient for that input, or mark it non-differentiable on purpose"
            ), root), False, False
        if backward_seen:
            asked = "" if i in self.queried and i in view.own else (
                "zeroscan could not ask the autograd engine whether torch.autograd.grad or backward(inputs=...) "
                "left it out, and "
            )
            told = "" if asked else "no torch.autograd.grad or backward(inputs=...) call, "
            return Why(Cause.NO_BACKWARD, (
                f"backward() went through the model's outputs, whose graph reaches {name}, but left it "
                f"without a gradient; {asked}{told}no custom autograd.Function or hook on the way explains it"
            )), False, False
        return Why(Cause.NO_BACKWARD, (
            f"{name} is in the autograd graph of the outputs but has no gradient: backward() has not "
            "run since the forward pass, the loss does not use these outputs, the gradient was taken "
            "with torch.autograd.grad / backward(inputs=...), or zero_grad() ran before the scan"
        )), False, False

    def _why_none_probed(self, i: int, name: str, probe: Probe) -> Why | None:
        """What the probe saw of parameter `i` (not in the graph of the outputs)."""
        p = self._params[i]
        label = lambda where: module_label(self.model, where)  # noqa: E731
        owner = label(p.owner)
        if i in probe.detached:
            where = label(probe.detached[i])
            return Why(Cause.DETACHED, (
                f"{name} is detached inside the forward of {where} (.detach() or .data on the parameter): "
                "its use leaves nothing for backward; use the parameter itself"
            ), f"these parameters are detached inside the forward of {where} (.detach() or .data on the "
                "parameter): their use leaves nothing for backward; use the parameters themselves")
        if i in probe.used:
            where = label(probe.used[i])
            kept = self._kept.feeding(p) if self._kept is not None else None
            if kept is not None:  # an auxiliary loss left out: what the loss lacks, before any cut
                return unused_result_why(name, kept)
            if probe.cuts:
                cuts = ", ".join(dict.fromkeys(f"{c} in {label(m)}" for c, m in probe.cuts))
                return Why(Cause.DETACHED, (
                    f"{name} is used in forward (by {where}) but the path from it to the outputs is cut: "
                    f"{cuts}; {CUT_HELP}"
                ), f"the path from these parameters to the model's outputs is cut: {cuts}; they are used "
                    f"before the cut, and {CUT_HELP}")
            return Why(Cause.UNUSED, (
                f"{name} is used in forward (by {where}) but its result never reaches the model's "
                "outputs (computed, then discarded)"
            ), "these parameters are used in forward, but their results never reach the model's outputs "
                "(computed, then discarded)")
        if i in probe.reentrant:
            where = label(probe.no_grad_use[i])
            return Why(Cause.DETACHED, (
                f"{name} is used in {where} inside torch.utils.checkpoint(..., use_reentrant=True), and "
                "no input of that checkpoint requires grad: the reentrant checkpoint then records "
                "nothing for backward; pass use_reentrant=False (or give it an input that requires grad)"
            ), f"these parameters are used in {where} inside torch.utils.checkpoint(..., use_reentrant=True) "
                "with no input that requires grad, so it records nothing for backward; pass use_reentrant=False")
        if i in probe.no_grad_use:
            where = label(probe.no_grad_use[i])
            return said_of_each(Cause.DETACHED, name, (
                f"used in {where} under torch.no_grad() (or inference_mode), so nothing is recorded for backward"
            ))
        if p.owner in probe.no_grad_modules:
            return Why(Cause.DETACHED, f"{owner} ran under torch.no_grad(), so {name} gets no gradient",
                       f"{owner} ran under torch.no_grad(), so its parameters get no gradient")
        if p.owner not in probe.ran and p.owner in probe.outside:
            if probe.outside[p.owner]:
                return Why(Cause.UNUSED, (
                    f"{owner} ran outside the model's forward, and what it computed never reached the loss, "
                    f"so {name} gets no gradient"
                ), f"{owner} ran outside the model's forward, and what it computed never reached the loss")
            return Why(Cause.DETACHED, (
                f"{owner} ran outside the model's forward under torch.no_grad() (an auxiliary loss computed "
                f"under no_grad), so {name} gets no gradient"
            ), f"{owner} ran outside the model's forward under torch.no_grad() (an auxiliary loss computed "
                "under no_grad), so its parameters get no gradient")
        if p.owner in probe.ran:
            return Why(Cause.UNUSED, f"{owner} ran in forward but never used {name}",
                       f"{owner} ran in forward but never used these parameters")
        if probe.ran:
            return Why(Cause.UNUSED, (
                f"{owner} never ran in forward, so {name} takes no part in the loss "
                "(a module defined but not called, or a branch not taken)"
            ), f"{owner} never ran in forward (a module defined but not called, or a branch not taken), "
                "so its parameters take no part in the loss")
        return None

    def explain_zeros(self, zero: list[int]) -> dict[int, Why]:
        """Why the gradients of the parameters `zero` (indices) are exactly
        zero everywhere, where the latest monitored step's graph tells
        (zero_causes.py); the others are left out."""
        try:
            return zero_causes.explain_zeros(self.model, self._params, self._latest_view(set(zero)), self._eager, zero)
        except graph.TooDeep:  # the graph is too deep to walk: no cause is claimed
            return {}


def said_of_each(cause: str, name: str, predicate: str) -> Why:
    """A Why saying `predicate` of parameter `name` ("<name> is <predicate>")
    and, as its root, of every parameter it explains."""
    return Why(cause, f"{name} is {predicate}", f"these parameters are {predicate}")


def cleared_cause(name: str) -> Why:
    """`name` had a gradient when backward finished and none at the optimizer step."""
    return Why(Cause.GRAD_CLEARED, (
        f"{name} had a gradient when backward() finished, but none at the optimizer step: "
        "zero_grad() (or .grad = None) ran between backward() and step(); clear gradients "
        "before the forward pass or after step()"
    ), "these parameters had a gradient when backward() finished, but none at the optimizer step: "
        "zero_grad() (or .grad = None) ran between backward() and step()")
