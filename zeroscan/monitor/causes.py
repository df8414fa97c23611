"""Why a gradient is None: the Monitor's cause analysis.

A root forward hook keeps the grad_fn of the model's outputs from the last
forward pass of a monitored step. When a parameter that requires grad has no
gradient, the autograd graph is walked from those outputs (and from the loss
given to Monitor.step) through `Node.next_functions` to the `AccumulateGrad`
leaves; `AccumulateGrad.variable` is the parameter, so the walk says which
parameters the graph reaches (reached but no grad: backward has not run). To
tell a detached parameter from an unused one, a `Probe` (a TorchFunctionMode)
then watches one forward pass: which parameters enter which torch function in
which module, whether under torch.no_grad(), and where forward calls
.detach(), .data, .item(), .tolist() or .numpy() on a tensor that requires
grad. The probe runs on the first monitored step and again only when an
unexplained None gradient shows up, so healthy training never pays for it.
`CauseFinder` holds that state; `unregistered_state` finds tensors that
require grad but were never registered as parameters.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zeroscan.monitor.hooks import Hooks
from zeroscan.monitor.records import Param
from zeroscan.monitor.report import Finding
from zeroscan.verdicts import Cause, Severity
from zeroscan.words import listed

_DATA_GETTER = torch._C.TensorBase.__dict__.get("data")
_CUT_METHODS = {
    torch.Tensor.detach: ".detach()",
    torch.Tensor.item: ".item()",
    torch.Tensor.tolist: ".tolist()",
    torch.Tensor.numpy: ".numpy()",
}


class Probe(TorchFunctionMode):
    """Records, during one forward pass, how each parameter is used and where
    the autograd graph is cut (see the module doc)."""

    def __init__(self, pindex: dict[int, int]) -> None:
        super().__init__()
        self.pindex = pindex
        self.stack: list[str] = []
        self.ran: set[str] = set()
        self.no_grad_modules: set[str] = set()
        self.used: dict[int, str] = {}
        self.no_grad_use: dict[int, str] = {}
        self.reentrant: set[int] = set()  # used inside torch.utils.checkpoint(use_reentrant=True)
        self.detached: dict[int, str] = {}
        self.cuts: list[tuple[str, str]] = []
        self.handles: list[Any] = []
        self.active = False
        self.done = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            self._observe(func, args, kwargs)
        except Exception:  # observing must never break the forward pass
            pass
        return func(*args, **kwargs)

    def _observe(self, func: Any, args: tuple, kwargs: dict) -> None:
        where = self.stack[-1] if self.stack else ""
        cut = _CUT_METHODS.get(func)
        if cut is None and getattr(func, "__self__", None) is _DATA_GETTER and _DATA_GETTER is not None:
            cut = ".data"
        grad_on = torch.is_grad_enabled()
        for t in tensors_in(args, kwargs):
            i = self.pindex.get(id(t))
            if i is not None:
                if cut in (".detach()", ".data"):
                    self.detached.setdefault(i, where)
                elif grad_on:
                    self.used.setdefault(i, where)
                else:
                    self.no_grad_use.setdefault(i, where)
                    if in_reentrant_checkpoint():
                        self.reentrant.add(i)
        if cut is not None and args and isinstance(args[0], torch.Tensor):
            first = args[0]
            if first.requires_grad and id(first) not in self.pindex and len(self.cuts) < 16:
                self.cuts.append((cut, where))

    def enter_module(self, name: str, root_grad: bool) -> None:
        self.stack.append(name)
        self.ran.add(name)
        if root_grad and not torch.is_grad_enabled():
            self.no_grad_modules.add(name)

    def leave_module(self) -> None:
        if self.stack:
            self.stack.pop()


def in_reentrant_checkpoint() -> bool:
    """Whether the caller runs inside the forward of torch.utils.checkpoint's
    reentrant implementation (which runs its function under no_grad)."""
    frame = sys._getframe(1)
    for _ in range(64):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "forward" and code.co_filename.replace("\\", "/").endswith("torch/utils/checkpoint.py"):
            return True
        frame = frame.f_back
    return False


def tensors_in(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def output_grad_fns(output: Any, found: list[Any], depth: int = 0) -> None:
    if isinstance(output, torch.Tensor):
        if output.grad_fn is not None:
            found.append(output.grad_fn)
    elif depth < 4 and isinstance(output, (list, tuple)):
        for o in output:
            output_grad_fns(o, found, depth + 1)
    elif depth < 4 and isinstance(output, dict):
        for o in output.values():
            output_grad_fns(o, found, depth + 1)


class CauseFinder:
    """The cause analysis of one Monitor: the outputs' graph of the current
    step, the probe, and the causes found so far that cannot change."""

    def __init__(self, model: nn.Module, params: list[Param], hooks: Hooks) -> None:
        self.model = model
        self._hooks = hooks  # the Monitor's: the probe's hooks go with its others
        self._params = params
        self._pindex = {id(p.tensor): p.index for p in params}
        self._probe: Probe | None = None
        self._probe_next = False
        self._causes: dict[int, tuple[Cause, str]] = {}
        self.roots: list[Any] = []  # grad_fns of the latest monitored forward's outputs
        self.forward_seen = False
        self.forward_grad = True

    def forward_started(self) -> None:
        """A monitored forward pass of the model begins."""
        self.forward_seen = True
        self.forward_grad = torch.is_grad_enabled()
        probe = self._probe
        if probe is not None and not probe.active and not probe.done:
            probe.active = True
            probe.__enter__()

    def forward_finished(self, roots: list[Any], monitored: bool) -> None:
        """A forward pass of the model ended (also by an exception); `roots`:
        the grad_fns of its outputs."""
        probe = self._probe
        if probe is not None and probe.active:
            probe.__exit__(None, None, None)
            probe.active = False
            probe.done = True
        if monitored and torch.is_grad_enabled():
            self.roots = roots  # the latest forward pass of this step

    def step_finished(self, monitored: bool) -> None:
        """The training step ended: a used probe goes, a wanted one is armed."""
        if monitored:
            if self._probe is not None and self._probe.done:
                self.drop()
            if self._probe_next:
                self.arm()
        self.roots = []
        self.forward_seen = False

    def arm(self) -> None:
        """Probes the next monitored forward pass."""
        self._probe_next = False
        if self._probe is not None:  # still waiting for a monitored forward pass
            return
        probe = Probe(self._pindex)
        finder = self
        for name, module in self.model.named_modules():

            def pre(module: nn.Module, args: Any, label: str = name) -> None:
                if probe.active:
                    probe.enter_module(label, finder.forward_grad)

            def post(module: nn.Module, args: Any, output: Any) -> None:
                if probe.active:
                    probe.leave_module()

            probe.handles.append(self._hooks.forward_pre(module, pre))
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

    def explain(
        self, missing: list[int], loss: torch.Tensor | None, backward_seen: bool | None = None
    ) -> dict[int, tuple[Cause, str]]:
        """Why each parameter in `missing` (indices) has no gradient:
        {index: (cause, message)}; answers that cannot change are kept.
        `backward_seen`: whether a backward pass went through the outputs of
        the latest forward pass (None: not known)."""
        causes = {i: self._causes[i] for i in missing if i in self._causes}
        rest = [i for i in missing if i not in causes]
        if not rest:
            return causes
        roots = list(self.roots)
        reached = self._reachable(roots)
        from_loss = None
        if loss is not None and loss.grad_fn is not None:
            roots.append(loss.grad_fn)
            from_loss = self._reachable([loss.grad_fn])
        probe = self._probe if self._probe is not None and self._probe.done else None
        for i in rest:
            cause, message, stable = self._why_none(i, roots, reached, from_loss, probe, loss, backward_seen)
            causes[i] = (cause, message)
            if stable:
                self._causes[i] = (cause, message)
            elif probe is None:
                self._probe_next = True
        return causes

    def _reachable(self, roots: list[Any]) -> set[int]:
        found: set[int] = set()
        seen: set[int] = set()
        stack = list(roots)
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            var = getattr(node, "variable", None)
            if var is not None:
                i = self._pindex.get(id(var))
                if i is not None:
                    found.add(i)
            for nxt, _ in getattr(node, "next_functions", ()):
                if nxt is not None and id(nxt) not in seen:
                    stack.append(nxt)
        return found

    def _why_none(
        self,
        i: int,
        roots: list[Any],
        reached: set[int],
        from_loss: set[int] | None,
        probe: Probe | None,
        loss: torch.Tensor | None,
        backward_seen: bool | None,
    ) -> tuple[Cause, str, bool]:
        """(cause, message, stable): `reached` holds the parameters that the
        graph of the outputs reaches, `from_loss` those the loss reaches."""
        p = self._params[i]
        name = p.name
        if from_loss is not None and i in reached and i not in from_loss:
            return Cause.UNUSED, (
                f"{name} feeds the model's outputs, but the loss does not use the output it feeds "
                "(an auxiliary head or output left out of the loss)"
            ), False
        if (i in reached or (from_loss is not None and i in from_loss)) and backward_seen is False:
            return Cause.NO_BACKWARD, (
                f"{name} is in the autograd graph of the model's outputs, but no backward pass through "
                "those outputs ran since the forward pass: backward() was not called on a loss built from "
                "them, or the loss was rebuilt from a Python number (loss.item(), float(loss), "
                "torch.tensor(loss)), which carries no graph back to the model"
            ), False
        if (i in reached or (from_loss is not None and i in from_loss)) and backward_seen:
            return Cause.NO_BACKWARD, (
                f"backward() went through the model's outputs but left {name} without a gradient: "
                "torch.autograd.grad or backward(inputs=...) computes gradients without storing them in .grad"
            ), False
        if i in reached or (from_loss is not None and i in from_loss):
            return Cause.NO_BACKWARD, (
                f"{name} is in the autograd graph of the outputs but has no gradient: backward() has not "
                "run since the forward pass, the loss does not use these outputs, the gradient was taken "
                "with torch.autograd.grad / backward(inputs=...), or zero_grad() ran before the scan"
            ), False
        if probe is not None:
            owner = module_label(self.model, p.owner)
            if i in probe.detached:
                return Cause.DETACHED, (
                    f"{name} is detached inside the forward of {module_label(self.model, probe.detached[i])} "
                    "(.detach() or .data on the parameter): its use leaves nothing for backward; use the "
                    "parameter itself"
                ), True
            if i in probe.used:
                where = module_label(self.model, probe.used[i])
                if probe.cuts:
                    cuts = ", ".join(dict.fromkeys(f"{c} in {module_label(self.model, m)}" for c, m in probe.cuts))
                    return Cause.DETACHED, (
                        f"{name} is used in forward (by {where}) but the path from it to the outputs is cut: "
                        f"{cuts}; a detached tensor (also after a .numpy()/.item()/.tolist() round trip) "
                        "carries no gradient back"
                    ), True
                return Cause.UNUSED, (
                    f"{name} is used in forward (by {where}) but its result never reaches the model's "
                    "outputs (computed, then discarded)"
                ), True
            if i in probe.reentrant:
                where = module_label(self.model, probe.no_grad_use[i])
                return Cause.DETACHED, (
                    f"{name} is used in {where} inside torch.utils.checkpoint(..., use_reentrant=True), and "
                    "no input of that checkpoint requires grad: the reentrant checkpoint then records "
                    "nothing for backward; pass use_reentrant=False (or give it an input that requires grad)"
                ), True
            if i in probe.no_grad_use:
                where = module_label(self.model, probe.no_grad_use[i])
                message = f"{name} is used in {where} under torch.no_grad(), so nothing is recorded for backward"
                return Cause.DETACHED, message, True
            if p.owner in probe.no_grad_modules:
                return Cause.DETACHED, f"{owner} ran under torch.no_grad(), so {name} gets no gradient", True
            if p.owner in probe.ran:
                return Cause.UNUSED, f"{owner} ran in forward but never used {name}", True
            if probe.ran:
                return Cause.UNUSED, (
                    f"{owner} never ran in forward, so {name} takes no part in the loss "
                    "(a module defined but not called, or a branch not taken)"
                ), True
        if not self.forward_seen and loss is None:
            return Cause.NO_BACKWARD, (
                f"{name} has no gradient and no forward pass of the model was seen this step "
                "(call Monitor.step() after forward and backward, or pass the loss: step(loss))"
            ), False
        if not self.forward_grad:
            return Cause.DETACHED, (
                f"the model's forward ran under torch.no_grad() or inference_mode, so {name} "
                "got no gradient"
            ), False
        where = "the loss" if loss is not None else "the model's outputs"
        return Cause.NOT_REACHED, (
            f"backward from {where} does not reach {name}: it is unused in forward or detached on "
            "the way (.detach(), torch.no_grad(), a .numpy()/.item() round trip)"
            + ("" if roots else "; the outputs carry no autograd graph at all")
        ), False


def cleared_cause(name: str) -> tuple[Cause, str]:
    """`name` had a gradient when backward finished and none at the step."""
    return Cause.GRAD_CLEARED, (
        f"{name} had a gradient when backward() finished, but none at the optimizer step: "
        "zero_grad() (or .grad = None) ran between backward() and step(); clear gradients "
        "before the forward pass or after step()"
    )


def module_label(model: nn.Module, name: str) -> str:
    """A module of `model` as messages name it: its name and class."""
    module = model.get_submodule(name) if name else model
    return f"{name} ({type(module).__name__})" if name else f"the model ({type(module).__name__})"


def unregistered_state(model: nn.Module) -> list[Finding]:
    """Trainable state that `model` does not register, so that neither
    model.parameters() nor an optimizer ever sees it: tensors that require
    grad kept as plain attributes or buffers, and modules or parameters kept
    in Python lists, tuples or dicts where nn.ModuleList, nn.ParameterList,
    nn.ModuleDict or nn.ParameterDict was meant."""
    registered = {id(p) for p in model.parameters()}
    modules = {id(m) for m in model.modules()}
    out: list[Finding] = []
    for mod_name, module in model.named_modules():
        owner = module_label(model, mod_name)
        for attr, value in vars(module).items():
            name = f"{mod_name}.{attr}" if mod_name else attr
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.requires_grad:
                out.append(Finding(name, "param", Severity.WARNING, Cause.PLAIN_ATTRIBUTE, (
                    f"{name} requires grad but is a plain tensor attribute of {owner}, "
                    "not an nn.Parameter: model.parameters(), the optimizer and state_dict() never see it, "
                    f"so it is never trained; wrap it: self.{attr} = nn.Parameter(...)"
                )))
            elif isinstance(value, (list, tuple, dict)):
                out += _unregistered_in_container(name, owner, value, registered, modules)
        for attr, value in module._buffers.items():
            if isinstance(value, torch.Tensor) and value.requires_grad:
                name = f"{mod_name}.{attr}" if mod_name else attr
                out.append(Finding(name, "param", Severity.WARNING, Cause.PLAIN_ATTRIBUTE, (
                    f"{name} requires grad but is registered as a buffer, not an nn.Parameter: "
                    "the optimizer never sees it; use nn.Parameter"
                )))
    return out


def _unregistered_in_container(
    name: str, owner: str, value: list | tuple | dict, registered: set[int], modules: set[int]
) -> list[Finding]:
    """The trainable modules and parameters inside one plain container
    attribute that the model does not register."""
    items = value.items() if isinstance(value, dict) else enumerate(value)
    kind = "dict" if isinstance(value, dict) else type(value).__name__
    found: list[str] = []
    module_like = False
    for key, item in items:
        if isinstance(item, nn.Module):
            trainable = [p for p in item.parameters() if p.requires_grad]
            if id(item) not in modules and trainable and not any(id(p) in registered for p in trainable):
                found.append(f"{name}[{key!r}]")
                module_like = True
        elif isinstance(item, torch.Tensor) and item.requires_grad and id(item) not in registered:
            found.append(f"{name}[{key!r}]")
    if not found:
        return []
    if module_like:
        fix = "nn.ModuleDict" if kind == "dict" else "nn.ModuleList"
        what = "modules"
    else:
        fix = "nn.ParameterDict" if kind == "dict" else "nn.ParameterList"
        what = "parameters"
    return [Finding(name, "param", Severity.WARNING, Cause.PLAIN_ATTRIBUTE, (
        f"{name} is a plain Python {kind} on {owner} holding trainable {what} ({listed(found, 10)}): nn.Module does not "
        f"look inside a {kind}, so model.parameters(), the optimizer, state_dict() and .to(device) never "
        f"see them, and they never train; use {fix}"
    ))]
