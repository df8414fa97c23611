"""Why a gradient is exactly zero everywhere: the cause analysis at report() time.

`explain_zeros` looks at the graph of the latest monitored step (which
causes.CauseFinder keeps) for what makes a gradient exactly zero: a hook of
the user's on the way (a tensor hook, a post-accumulate-grad hook, a
module's backward hook); an output that enters the loss weighted by 0
(every parameter that reaches the loss only through that output has a zero
gradient); a custom autograd.Function whose backward gives that input None
or zeros; a torch.compile graph that gives zeros where an eager step gave
no gradient. A zero gradient none of these explains (a design that starts
at zero, say) gets no answer.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from zeroscan.monitor import graph
from zeroscan.monitor.labels import module_label
from zeroscan.monitor.step_record import Param, Why
from zeroscan.verdicts import Cause
from zeroscan.words import listed


def explain_zeros(
    model: nn.Module, params: list[Param], view: graph.GraphView, eager_whys: dict[int, Why], zero: list[int]
) -> dict[int, Why]:
    """Why the gradients of the parameters `zero` (indices) are exactly
    zero everywhere, where a hook, the wiring of the loss, a custom
    autograd.Function, or what an eager step saw before a compiled graph
    hid it explains it; the others are left out. The rules keep such a
    finding at INFO until it lasts (a design that starts at zero).
    `view`: the latest monitored step's graph; `eager_whys`: the latest
    answer to why each parameter had no gradient that no torch.compile graph
    hid."""
    out: dict[int, Why] = {}
    roots = view.roots
    for i in zero:
        hooks = graph.tensor_hooks(params[i].tensor)
        if hooks:
            out[i] = _hook_why(params[i].name, hooks[0])
        elif i in eager_whys and eager_whys[i].cause in (Cause.UNUSED, Cause.DETACHED) and roots and any(
            c.compiled for c in view.crossings.get(i, [])
        ):
            # A compiled graph's backward gives zeros where eager autograd gives none.
            eager = eager_whys[i]
            out[i] = Why(eager.cause, (
                f"every entry of the gradient of {params[i].name} is exactly zero, where an eager step "
                f"gave it none (a torch.compile graph gives zeros instead): {eager.message}"
            ), None if eager.root is None else f"{eager.root} (a torch.compile graph gives them zeros)")
    rest = [i for i in zero if i not in out]
    if rest:
        out.update(_module_hook_whys(model, params, rest))
    rest = [i for i in zero if i not in out]
    if rest:
        out.update(_zero_weighted_outputs(params, view, zero, rest))
    rest = [i for i in zero if i not in out]
    if rest and roots:
        out.update(_functions_on_the_way(params, rest, view))
    return out


def _functions_on_the_way(params: list[Param], zero: list[int], view: graph.GraphView) -> dict[int, Why]:
    """Zero gradients behind a custom autograd.Function on every way from
    the outputs: its backward gives that input None (which FSDP's
    gradient reduction or a compiled graph turns into zeros) or zeros."""
    out: dict[int, Why] = {}
    for i in zero:
        user = [c for c in view.crossings.get(i, []) if not c.compiled]
        if not user or i in view.free:
            continue
        named = listed(list(dict.fromkeys(f"{c.name} (input #{c.input})" for c in user)), 3)
        said = (
            f"every way from the outputs to it goes through the custom autograd.Function {named}, whose "
            "backward most likely gives that input (0-based) None, which FSDP's gradient reduction or a "
            "compiled graph turns into zeros, or zeros"
        )
        name = params[i].name
        out[i] = Why(Cause.EXACT_ZERO, f"every entry of the gradient of {name} is exactly zero; {said}",
                     f"every entry of these parameters' gradients is exactly zero; {said}")
    return out


def _module_hook_whys(model: nn.Module, params: list[Param], zero: list[int]) -> dict[int, Why]:
    """Zero gradients behind a backward hook on a module: a full backward
    hook changes the gradient of the module's inputs (so of what ran
    before it), a backward pre-hook that of its output (so also of the
    module's own parameters)."""
    modules = list(model.named_modules())
    hooked = [(k, name, hooks) for k, (name, m) in enumerate(modules) if (hooks := graph.module_backward_hooks(m))]
    if not hooked:
        return {}
    order = {name: k for k, (name, _) in enumerate(modules)}
    out: dict[int, Why] = {}
    for i in zero:
        owner = params[i].owner
        at = order.get(owner, len(modules))
        for k, name, hooks in hooked:
            inside = name == "" or owner == name or owner.startswith(name + ".")
            for how, hook in hooks:
                pre = how == "register_full_backward_pre_hook"
                if (pre and (inside or k > at)) or (not pre and not inside and k > at):
                    out[i] = _hook_why(params[i].name, (how, hook), module_label(model, name))
                    break
            if i in out:
                break
    return out


def _zero_weighted_outputs(
    params: list[Param], view: graph.GraphView, zero: list[int], rest: list[int]
) -> dict[int, Why]:
    """Zero gradients of every parameter that reaches the loss only through
    one output, while other outputs' parameters have nonzero ones: that
    output enters the loss weighted by 0."""
    roots = view.roots
    if len(roots) < 2:
        return {}
    reach = view.root_reach
    zero_set, todo = set(zero), set(rest)
    out: dict[int, Why] = {}
    for k, r in enumerate(roots):
        others = set().union(*(reach[j] for j in range(len(roots)) if j != k))
        only = {i for i in reach[k] - others if params[i].tensor.requires_grad}
        if not only or not only <= zero_set or not (others - zero_set):
            continue
        root = (
            f"every parameter that reaches the loss only through {r.label} has an exactly zero gradient, "
            f"while the other outputs' do not: {r.label} enters the loss weighted by 0 (or the loss is "
            "constant in it)"
        )
        for i in sorted(only & todo):
            out[i] = Why(Cause.EXACT_ZERO, (
                f"every entry of the gradient of {params[i].name} is exactly zero; it reaches the loss "
                f"only through {r.label}, and every parameter that does so has a zero gradient while the "
                f"other outputs' do not: {r.label} enters the loss weighted by 0 (or the loss is constant in it)"
            ), root)
    return out


def _hook_why(name: str, found: tuple[str, Any], module: str | None = None) -> Why:
    """A zero gradient with a hook of the user's on its way: on the parameter
    itself, or (`module`) a backward hook on a module."""
    how, hook = found
    label = graph.hook_label(hook)
    on = f"on {module}" if module is not None else f"on {name}"
    return Why(Cause.EXACT_ZERO, (
        f"every entry of the gradient of {name} is exactly zero, and a hook is on its way: "
        f"{label}, registered with {how} {on}; a hook that returns zeros (or zeroes .grad) does this"
    ), f"every entry of these parameters' gradients is exactly zero, and the hook {label} ({how}"
        + (f" on {module}" if module is not None else "")
        + ") is on their way: a hook that returns zeros (or zeroes .grad) does this")
