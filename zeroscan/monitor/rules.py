"""The Monitor's rules: from what was recorded to findings.

`judge` is a pure function of the parameters, the decoded step records, the
thresholds and what the optimizer holds; it reads no tensor data and runs no
scan, so every rule can be tested on synthetic records without a model.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from zeroscan.monitor.changes import Memberships, change_findings, merged, without_superseded
from zeroscan.monitor.drift import history_findings
from zeroscan.monitor.grouping import group_findings
from zeroscan.monitor.optimizer import OptimizerView
from zeroscan.monitor.precision import fp16_underflow
from zeroscan.monitor.structural import structural_zero
from zeroscan.monitor.whole_model import all_zero_finding, input_cut_finding
from zeroscan.monitor.step_record import Activation, Param, Slot, StepRecord, Unscanned, Why
from zeroscan.monitor.report import GLOBAL_NAME, Finding, Thresholds
from zeroscan.monitor.series import Series
from zeroscan.monitor.steps import nothing_ran, step_findings
from zeroscan.ops import FLOAT_DTYPES, INT_DTYPES
from zeroscan.result_row import Column, Row
from zeroscan.value_rules import Limits, Values, verdict_of
from zeroscan.verdicts import Cause, Severity, Verdict
from zeroscan.words import RankSet, count_noun, dtype_name, is_are, listed, nonfinite_words

WEIGHT_RMS_FLOOR = 1e-2  # see Thresholds.exploding



def judge(
    params: list[Param],
    records: list[StepRecord],
    basis: list[StepRecord],
    thresholds: Thresholds,
    optimizer: OptimizerView,
    model_findings: list[Finding],
    memberships: Memberships | None = None,
    origin_pointer: str = "",
    grads_from: str = ".grad",
) -> list[Finding]:
    """Every finding over decoded `records` (oldest first; `basis`: the
    records the rules judge a step by, steps.judged_records of them), ranked
    by severity then by parameter order, one per root cause (grouping.py),
    with the stopped_training findings among them (changes.py). `model_findings`
    (about the model itself, such as unregistered state) rank after the
    parameters' own. The nonfinite and skipped_steps findings end with
    `origin_pointer` (nonfinite_origin.pointer), and each gradient finding
    says where the gradient was read where it is not .grad (`grads_from`)."""
    found: list[tuple[int, Finding]] = [(len(params), f) for f in model_findings]
    series = Series(basis, len(params))
    found += _optimizer_findings(params, series, optimizer)
    if records:
        found += step_findings(params, records, thresholds)
        found += _latest_findings(params, series, thresholds, optimizer)
        found += history_findings(params, series, thresholds)
    found.sort(key=lambda of: (-int(of[1].severity), of[0]))
    changes, superseded = change_findings(params, records, memberships)
    findings = merged(without_superseded(group_findings([f for _, f in found]), superseded), changes)
    return [_worded(f, origin_pointer, grads_from) for f in findings]


def _worded(finding: Finding, origin_pointer: str, grads_from: str) -> Finding:
    """`finding` as the report says it: pointing at where the inf/NaN was
    born, saying where its gradient was read."""
    message = finding.message
    if origin_pointer and finding.cause in (Cause.NONFINITE, Cause.SKIPPED_STEPS):
        message += origin_pointer
    if grads_from != ".grad" and finding.kind == "grad":
        message = f"{message} (gradient read from {grads_from})"
    return finding if message == finding.message else dataclasses.replace(finding, message=message)


def _optimizer_findings(params: list[Param], series: Series, optimizer: OptimizerView) -> list[tuple[int, Finding]]:
    if optimizer is None:
        return []
    out = []
    for p in params:
        if p.tensor.requires_grad and p.index not in optimizer:
            unchanged = series.unchanged_for(p.index)
            since = f"; its value has not changed for {unchanged} monitored steps" if unchanged > 1 else ""
            out.append((p.index, Finding(p.name, "param", Severity.WARNING, Cause.NOT_IN_OPTIMIZER, (
                f"{p.name} requires grad but is in none of the optimizer's param groups, so "
                f"optimizer.step() never updates it{since}; pass it to the optimizer "
                "(or set requires_grad_(False) if it is meant to stay fixed)"
            ), root=(
                "these parameters require grad but are in none of the optimizer's param groups, so "
                "optimizer.step() never updates them; pass them to the optimizer (or set "
                "requires_grad_(False) if they are meant to stay fixed)"
            ))))
    return out


def _latest_findings(
    params: list[Param], series: Series, th: Thresholds, optimizer: OptimizerView
) -> list[tuple[int, Finding]]:
    records = series.records
    rec = records[-1]
    out: list[tuple[int, Finding]] = []
    dead = [a.name for a in rec.acts or [] if a.tag == "relu" and a.unit["numel"] and a.unit["zeros"] == a.unit["numel"]]
    subnormal = rec.rows.gather(series.grad_rows, [Column.SUBNORMAL])[0] if rec.rows is not None else None
    underflowing = subnormal is not None and bool((subnormal > 0).any())
    whole = all_zero_finding(series) if rec.stepped is not False else None
    # No step and no gradient yet: step_findings says so once, for every parameter.
    quiet_none = nothing_ran(params, records)
    # A gradient that exists but could not be read has its own note (not_scanned).
    unread_grads = {u.name for u in rec.unscanned if u.kind == "grad"}
    if whole is not None:
        out.append((-1, whole))
    cut = input_cut_finding(rec.context)
    if cut is not None:
        out.append((-1, cut))
    for p in params:
        i, name = p.index, p.name
        grad, w = rec.row(Slot.grad(i)), rec.row(Slot.weight(i))
        for slot in (Slot.grad(i), Slot.weight(i)):
            if slot in rec.rank_findings:
                out.append((i, rec.rank_findings[slot]))
        if w is not None and w["nan"] + w["posinf"] + w["neginf"]:
            out.append((i, in_shards(Finding(name, "weight", Severity.ERROR, Cause.NONFINITE, (
                f"{name} holds {nonfinite_words(w)}: the weights are already poisoned; "
                "look for the first step where the gradient went non-finite"
            )), rec.shard_ranks.get(Slot.weight(i)))))
        if i >= len(rec.requires_grad):
            continue
        if not rec.requires_grad[i]:
            out.append((i, Finding(name, "param", Severity.INFO, Cause.FROZEN, (
                f"{name} has requires_grad=False (frozen), so it gets no gradient; "
                "if it should train, call requires_grad_(True) and give it to the optimizer"
            ), root=(
                "these parameters have requires_grad=False (frozen), so they get no gradient; if they "
                "should train, call requires_grad_(True) and give them to the optimizer"
            ))))
            continue
        if grad is None:
            if not quiet_none and name not in unread_grads:
                out.append((i, _none_finding(p, series)))
            continue
        if rec.stepped is False:  # skipped: scaled, non-finite gradients (see the skipped_steps finding)
            continue
        if whole is not None:
            continue
        finding = _grad_finding(p, params, grad, w, dead, series, underflowing, th, rec.zero_causes.get(i))
        if finding is not None:
            if finding.cause == Cause.NONFINITE:
                finding = in_shards(finding, rec.shard_ranks.get(Slot.grad(i)))
            out.append((i, finding))
        elif optimizer is None or i in optimizer:
            finding = _update_finding(p, series, th, optimizer)
            if finding is not None:
                # No update can move a weight by its rounding noise, and none needs to: the noise is the finding.
                out.append((i, structural_zero(p, params, series) or finding))
    base = len(params)
    for k, act in enumerate(rec.acts or []):
        finding = _activation_finding(act, th)
        if finding is not None:
            out.append((base + k, finding))
    for k, (name, why) in enumerate(rec.notes):
        out.append((base + k, Finding(name, "param", Severity.INFO, Cause.NOT_SCANNED, why)))
    if rec.unscanned:
        out.append((base + len(rec.notes), _unscanned_finding(rec.unscanned)))
    return out


SCANNED_DTYPES = tuple(dtype_name(d) for d in FLOAT_DTYPES + INT_DTYPES)


def _unscanned_finding(unscanned: list[Unscanned]) -> Finding:
    """One finding for every tensor of the step that the native scan cannot
    read (zeroscan.ops.scannable_form): each is named with its dtype."""
    seen = list({(u.name, u.kind): u for u in unscanned}.values())  # a gradient refused twice in a step
    odd_dtype = any(u.dtype not in SCANNED_DTYPES and not u.dtype.startswith("complex") for u in seen)
    scans = (
        f" (zeroscan scans {', '.join(SCANNED_DTYPES)}, and complex tensors as real pairs)" if odd_dtype else ""
    )
    if len(seen) == 1:
        u = seen[0]
        return Finding(u.name, u.kind, Severity.INFO, Cause.NOT_SCANNED, (
            f"{u.label} {u.why}, so it is left out of this report; every other tensor is scanned{scans}"
        ))
    first_with: dict[str, str] = {}
    for u in seen:
        first_with.setdefault(u.why, u.label)
    reasons = "; ".join(f"{label} {why}" for why, label in list(first_with.items())[:3])
    return Finding(GLOBAL_NAME, "param", Severity.INFO, Cause.NOT_SCANNED, (
        f"{count_noun(len(seen), 'tensor')} {is_are(len(seen))} left out of this report, every other tensor is "
        f"scanned: {listed([f'{u.label} ({u.dtype})' for u in seen], 6)}; {reasons}{scans}"
    ))


def _none_finding(p: Param, series: Series) -> Finding:
    """A parameter that requires grad has no gradient at the latest step."""
    records = series.records
    rec = records[-1]
    had = series.had_grad(p.index)
    if had:
        return Finding(p.name, "grad", Severity.INFO, Cause.CONDITIONAL, (
            f"{p.name} has no gradient at step {rec.step}, but had one at {had} of the "
            f"{len(records) - 1} monitored steps before it: conditional computation (a mixture-of-experts "
            "router that sent it no tokens, a branch not taken) that trains it at other steps"
        ))
    why = rec.none_causes.get(p.index, Why(Cause.NOT_REACHED, f"{p.name} has no gradient"))
    severity = Severity.ERROR if why.cause == Cause.DETACHED else Severity.WARNING
    return Finding(p.name, "grad", severity, Cause(why.cause), why.message, root=why.root)


def _grad_finding(
    p: Param,
    params: list[Param],
    g: Row,
    w: Row | None,
    dead: list[str],
    series: Series,
    underflowing: bool,
    th: Thresholds,
    zero_why: Why | None = None,
) -> Finding | None:
    """What the gradient's values say, by the rule book of zeroscan/value_rules.py
    (its verdicts in its order), worded for a gradient: where its zeros come
    from, how it compares with its weight. `zero_why`: why the gradient is
    exactly zero, where the cause analysis knows; `params`: every parameter
    (a gradient's neighbours tell its scale)."""
    name = p.name
    # A gradient's tiny values are its subnormal ones: its healthy entries are often below eps.
    values = Values.of_row(g, p.tensor.dtype, tiny="subnormal")
    limits = Limits(th.mostly_zero, th.partial_underflow)
    rule = verdict_of(values, limits)
    verdict = Verdict.HEALTHY if rule is None else rule.verdict
    if verdict is Verdict.EMPTY:
        return None
    if verdict is Verdict.NONFINITE:
        return Finding(name, "grad", Severity.ERROR, Cause.NONFINITE, (
            f"the gradient of {name} holds {nonfinite_words(g)}: an overflow, a division by zero, "
            "log/sqrt of a non-positive value, or a torch.where whose unselected branch is NaN; "
            "the optimizer step will poison the weights (use GradScaler / anomaly mode to find it)"
        ))
    if verdict is Verdict.EXACT_ZERO:
        return _zero_grad_finding(p, params, g, dead, series, underflowing, th, zero_why)
    n, zeros, nonzero, sub = values.numel, values.zeros, values.nonzero, values.subnormal
    dtype = dtype_name(p.tensor.dtype)
    if verdict is Verdict.UNDERFLOW:
        return Finding(name, "grad", Severity.ERROR, Cause.UNDERFLOW, (
            f"every nonzero entry of the gradient of {name} ({nonzero} of {n}) is subnormal in "
            f"{dtype} (|g| up to {g['max_abs']:.3g}); the rest underflowed to zero. Scale the "
            "loss (torch.amp.GradScaler), use bfloat16, or keep float32 master gradients"
        ))
    if verdict is Verdict.PARTIAL_UNDERFLOW:
        return Finding(name, "grad", Severity.WARNING, Cause.UNDERFLOW, (
            f"{100 * sub / nonzero:.3g}% of the nonzero gradient entries of {name} are subnormal in "
            f"{dtype} (and {100 * zeros / n:.3g}% are exactly zero): the gradient is underflowing; "
            "scale the loss (torch.amp.GradScaler) or use bfloat16"
        ))
    half = fp16_underflow(p, g, series.records[-1].context, th)
    if half is not None:
        return half
    if verdict is Verdict.MOSTLY_ZERO and not p.embedding:
        noise = structural_zero(p, params, series)
        if noise is not None:  # rounding noise, most of whose sums cancelled exactly
            return noise
        counts = series.zero_counts(p.index)
        fixed = len(counts) >= 2 and len(set(counts)) == 1
        why = (
            f"the same {zeros} entries at each of the last {len(counts)} monitored steps: a fixed mask, "
            "slice or torch.where blocks the gradient to the unselected elements, which never train"
            if fixed
            else "those elements got no gradient this step (a mask or torch.where that does not select "
            "them, dead ReLU units, sparse inputs)"
        )
        return Finding(name, "grad", Severity.INFO, Cause.MOSTLY_ZERO, (
            f"{100 * zeros / n:.3g}% of the gradient entries of {name} are exactly zero; {why}"
        ))
    if rule is not None and verdict not in _WEIGHED_BY_NORMS:  # a rule this module has no words of its own for
        return Finding(name, "grad", verdict.severity, verdict.cause, f"the gradient of {name}: {rule.says(values, limits)}")
    if w is None:
        return None
    w_norm, g_norm = float(w["norm"]), float(g["norm"])
    if not (w_norm > 0 and math.isfinite(w_norm)):
        return None
    ratio = g_norm / w_norm
    if ratio < th.vanishing:
        noise = structural_zero(p, params, series)
        if noise is not None:  # zero in exact arithmetic: no step could move it, and none needs to
            return noise
        return Finding(name, "grad", Severity.WARNING, Cause.VANISHING, (
            f"the gradient of {name} is vanishing: ||g||/||w|| = {ratio:.2e} (||g|| = {g_norm:.3g}, "
            f"||w|| = {w_norm:.3g}), below {th.vanishing:.0e}; plain SGD cannot move this weight"
        ))
    # A near-zero weight (a bias that starts at 0) makes the ratio huge without
    # anything exploding: its norm counts as at least WEIGHT_RMS_FLOOR per entry.
    scale = max(w_norm, WEIGHT_RMS_FLOOR * math.sqrt(int(w["numel"])))
    if g_norm / scale > th.exploding:
        return Finding(name, "grad", Severity.ERROR, Cause.EXPLODING, (
            f"the gradient of {name} is exploding: ||g||/||w|| = {ratio:.3g} (||g|| = {g_norm:.3g}, "
            f"||w|| = {w_norm:.3g}); clip gradients, lower the learning rate, or check the loss scale"
        ))
    return None


# Verdicts after which a gradient is judged by its size against its weight's.
_WEIGHED_BY_NORMS = frozenset({Verdict.MOSTLY_ZERO, Verdict.CONSTANT, Verdict.HEALTHY})


def _zero_grad_finding(
    p: Param,
    params: list[Param],
    g: Row,
    dead: list[str],
    series: Series,
    underflowing: bool,
    th: Thresholds,
    zero_why: Why | None,
) -> Finding:
    """Every entry of the gradient is exactly zero: underflowed, by design at
    a first step, cut by something the cause analysis named, rounding noise
    that cancelled, or dead units, a mask, a constant loss."""
    name = p.name
    n = int(g["numel"])
    streak = series.zero_streak(p.index)
    lasting = streak >= th.zero_window or (streak >= 2 and series.unchanged_for(p.index) >= streak)
    if underflowing and p.tensor.dtype in (torch.float16, torch.bfloat16):
        return Finding(name, "grad", Severity.WARNING, Cause.UNDERFLOW, (
            f"every entry of the gradient of {name} is exactly zero while other {dtype_name(p.tensor.dtype)} "
            "gradients of this step are subnormal: it most likely underflowed to zero. Scale the "
            "loss (torch.amp.GradScaler), use bfloat16, or keep float32 master gradients"
        ))
    # A design that starts at zero is zero from the first monitored step: after a nonzero one, it is not that.
    half = fp16_underflow(p, g, series.records[-1].context, th, lasting or streak < len(series.records))
    if half is not None:
        return half
    if zero_why is not None and lasting:  # a hook, an output weighted by 0, a Function, a compiled cut
        # Named once the zeros last: before that a design that starts at zero (LoRA's B = 0) is
        # likelier, whatever sits on the way, and the INFO below says so.
        severity = Severity.ERROR if zero_why.cause == Cause.DETACHED else Severity.WARNING
        return Finding(name, "grad", severity, Cause(zero_why.cause), zero_why.message, root=zero_why.root)
    # An exact cancellation of what is otherwise rounding noise: once the zeros last, or where an
    # earlier monitored step showed the noise (a one-element shift's sum cancels now and then).
    noise_seen = any(c < n for c in series.zero_counts(p.index))
    noise = structural_zero(p, params, series) if lasting or noise_seen else None
    if noise is not None:
        return noise
    if dead:
        why = (
            f"the activation{'s' if len(dead) > 1 else ''} {', '.join(dead)} "
            f"{'are' if len(dead) > 1 else 'is'} dead (every unit zero for the whole batch) "
            "and pass no gradient"
        )
    else:
        why = (
            "a dead ReLU, a mask or torch.where that selects none of these elements, "
            "a multiplication by zero, or a loss that is constant in this parameter"
        )
    if lasting:
        return Finding(name, "grad", Severity.WARNING, Cause.EXACT_ZERO, (
            f"every entry of the gradient of {name} is exactly zero, at the last {streak} monitored "
            f"steps: {why}; it does not train"
        ), root=(
            f"every entry of these parameters' gradients is exactly zero, at the last {streak} monitored "
            f"steps: {why}; they do not train"
        ))
    step = series.records[-1].step
    by_design = (
        "A parameter that starts at zero by design does this at its first step (LoRA's A while B = 0, "
        f"the blocks of zero_init_residual); a warning if it lasts {th.zero_window} monitored steps"
    )
    return Finding(name, "grad", Severity.INFO, Cause.EXACT_ZERO, (
        f"every entry of the gradient of {name} is exactly zero at step {step}: {why}. {by_design}"
    ), root=f"every entry of these parameters' gradients is exactly zero at step {step}: {why}. {by_design}")


def _update_finding(p: Param, series: Series, th: Thresholds, optimizer: OptimizerView) -> Finding | None:
    if not series.weight_same_last(p.index):  # also: fewer than 2 steps, or a weight not scanned at both
        return None
    prev, last = series.records[-2], series.records[-1]
    g = prev.row(Slot.grad(p.index))
    if g is None:
        return None
    if not (float(g["norm"]) > 0 and g["nan"] + g["posinf"] + g["neginf"] == 0):
        return None
    w = last.row(Slot.weight(p.index))
    if w is None or int(w["numel"]) == 0:
        return None
    unchanged = series.unchanged_for(p.index)
    group = optimizer.get(p.index) if optimizer is not None else None
    lr = prev.lrs[group] if group is not None and prev.lrs is not None and group < len(prev.lrs) else None
    if isinstance(lr, torch.Tensor):
        lr = float(lr)  # report() reads it (the step only copied it)
    if group is not None and prev.lrs is not None and group >= len(prev.lrs):
        return None  # its param group was added after that step: it was not in the optimizer then
    if isinstance(lr, (int, float)) and lr == 0:
        return _zero_lr_finding(p, prev.step, group, unchanged, th)
    reasons = _no_update_reasons(p, w, g, optimizer, lr)
    if unchanged >= th.frozen_window:
        return Finding(p.name, "weight", Severity.WARNING, Cause.FROZEN_IN_TIME, (
            f"{p.name} has not changed for {unchanged} monitored steps although its gradient is "
            f"nonzero (||g|| = {float(g['norm']):.3g}): {reasons}"
        ))
    return Finding(p.name, "weight", Severity.WARNING, Cause.NOT_UPDATED, (
        f"{p.name} did not change across the last optimizer step although its gradient was nonzero "
        f"(||g|| = {float(g['norm']):.3g}): {reasons}"
    ))


def _zero_lr_finding(p: Param, step: int, group: int | None, unchanged: int, th: Thresholds) -> Finding:
    """A weight that did not move at a step its param group ran with lr 0:
    the learning rate is the cause (a warmup from 0 at its first step; for
    frozen_window steps in a row, a schedule stuck at 0)."""
    if unchanged >= th.frozen_window:
        return Finding(p.name, "weight", Severity.WARNING, Cause.FROZEN_IN_TIME, (
            f"{p.name} has not changed for {unchanged} monitored steps, and its param group {group} ran with "
            f"lr=0 at step {step}: a learning rate schedule that stays at 0 trains nothing"
        ), root=(
            f"param group {group} ran with lr=0 at step {step}, and its weights have not changed for "
            f"{unchanged} monitored steps: a learning rate schedule that stays at 0 trains nothing"
        ))
    return Finding(p.name, "weight", Severity.INFO, Cause.NOT_UPDATED, (
        f"{p.name} did not change at step {step}, which its param group {group} ran with lr=0 "
        "(a warmup that starts from 0 does this at its first step)"
    ), root=(
        f"param group {group} ran step {step} with lr=0, so its weights did not change "
        "(a warmup that starts from 0 does this at its first step)"
    ))


def _no_update_reasons(p: Param, w: Row, g: Row, optimizer: OptimizerView, lr: object) -> str:
    """Why a weight did not move although its gradient was nonzero; `lr`:
    the rate its param group ran that step with (None: not known)."""
    dtype = p.tensor.dtype
    ulp = float(w["max_abs"]) * (torch.finfo(dtype).eps if dtype.is_floating_point else 1.0)
    below = (
        f"an update below the weight's resolution (one ulp of {dtype_name(dtype)} at |w| = "
        f"{float(w['max_abs']):.3g} is about {ulp:.2g}, |g| is at most {float(g['max_abs']):.3g})"
    )
    if optimizer is not None and p.index in optimizer:
        # Steps that GradScaler skipped are told apart (steps.py), so a skip is no cause here.
        return f"lr={lr}: {below}" if lr is not None else below
    return f"lr 0, a parameter missing from the optimizer, or {below}"


def _activation_finding(act: Activation, th: Thresholds) -> Finding | None:
    name, out, unit = act.name, act.output, act.unit
    if out["nan"] + out["posinf"] + out["neginf"]:
        return Finding(name, "activation", Severity.ERROR, Cause.NONFINITE, (
            f"the output of {name} holds {nonfinite_words(out)}"
        ))
    n = int(unit["numel"])
    if n == 0:
        return None
    if act.tag == "relu":
        dead = int(unit["zeros"])
        if dead == n:
            return Finding(name, "activation", Severity.ERROR, Cause.DEAD_UNITS, (
                f"all {n} units of {name} are exactly zero for the whole batch (a dead layer): it "
                "passes neither signal nor gradient; check the init/bias of the layer before it, "
                "lower the learning rate, or use LeakyReLU/GELU"
            ))
        if dead / n >= th.dead_units:
            return Finding(name, "activation", Severity.WARNING, Cause.DEAD_UNITS, (
                f"{dead} of {n} units of {name} ({100 * dead / n:.3g}%) {is_are(dead)} "
                "exactly zero for the whole "
                "batch (dead ReLU units get no gradient and cannot recover)"
            ))
        return None
    saturated = int(unit["zeros"]) + int(unit["near_zero"])
    if saturated / n >= th.saturated:
        return Finding(name, "activation", Severity.WARNING, Cause.SATURATED_SOFTMAX, (
            f"{saturated} of {n} softmax rows of {name} ({100 * saturated / n:.3g}%) "
            f"{'puts all its' if saturated == 1 else 'put all their'} mass "
            "on one entry (1 - max p within eps): the softmax gradient through them is ~0; "
            "scale the logits down (temperature, 1/sqrt(d) in attention) or check for huge logits"
        ))
    return None


def in_shards(finding: Finding, ranks: RankSet | None) -> Finding:
    """A non-finite finding of a sharded tensor, with the ranks whose shards hold the values."""
    if ranks is None or not ranks.count:
        return finding
    where = f"rank {ranks.first}'s shard" if ranks.count == 1 else f"the shards of {ranks.words()}"
    return dataclasses.replace(finding, ranks=ranks.named, message=f"{finding.message}; the values are in {where}")
