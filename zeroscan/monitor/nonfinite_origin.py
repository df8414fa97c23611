"""Monitor(trace_nonfinite=True), the reading: where the first NaN or
infinity of the recorded gradients was born (nonfinite_trace.py records it).

Which non-finite gradients are explained: those of the first step taken on
them (neither skipped nor undone), else of the first step that held any;
their birth is looked for from the step after the last record before them
whose gradients were finite, so that a GradScaler's harmless early skips do
not stand for a later NaN that the optimizer applied.

nonfinite_walk.py walks each traced step: which non-finite value reached
the gradients (a mask's -inf that softmax consumed did not), and the first
value it descends from, in the forward pass or in the backward pass.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from zeroscan.monitor.nonfinite_trace import CHUNK, Segment, StepTrace
from zeroscan.monitor.nonfinite_walk import find_in_step, kinds_words
from zeroscan.monitor.report import GLOBAL_NAME, Finding
from zeroscan.monitor.step_record import Param, StepRecord
from zeroscan.monitor.steps import first_nonfinite, nonfinite_grads, undone
from zeroscan.verdicts import Cause, Severity
from zeroscan.words import count_noun, listed

class Origin(NamedTuple):
    """Where a non-finite value was born.

    step: the step (Monitor.steps_seen numbering); phase: "forward" or
    "backward"; micro: which forward pass of the step (0-based) of `passes`;
    where: the module named (its qualified name, "(model)" for the model
    itself), the parameter, "(input batch)" or "(outside the model)";
    kind: "activation" (forward), "grad" (backward) or "weight"; kinds:
    INFINITE | NAN bits; how: what was seen, in words.
    """

    step: int
    phase: str
    micro: int
    passes: int
    where: str
    kind: str
    kinds: int
    how: str

    def to_dict(self) -> dict[str, object]:
        return {
            "step": self.step,
            "pass": self.phase,
            "micro_batch": self.micro,
            "name": self.where,
            "kind": self.kind,
            "values": kinds_words(self.kinds),
            "how": self.how,
        }


def read_flags(steps: list[StepTrace]) -> dict[int, np.ndarray]:
    """Every segment's flag per slot (int32 [slots], by id(segment)): one copy
    per device, none for the CPU."""
    segments = [s for t in steps for s in t.segments]
    by_device: dict[torch.device, list[tuple[Segment, int, torch.Tensor]]] = {}
    for s in segments:
        for (device, chunk), buffer in s.flags.buffers.items():
            by_device.setdefault(device, []).append((s, chunk, buffer))
    host: dict[tuple[int, torch.device, int], np.ndarray] = {}
    for device, items in by_device.items():
        if device.type == "cpu":
            values = [b.numpy() for _, _, b in items]
        else:
            values = list(torch.cat([b for _, _, b in items]).cpu().numpy().reshape(len(items), CHUNK))
        for (s, chunk, _), v in zip(items, values):
            host[(id(s), device, chunk)] = v
    out: dict[int, np.ndarray] = {}
    for s in segments:
        where = np.frombuffer(s.flags.where, dtype=np.uint8)
        flags = np.zeros(len(where), dtype=np.int32)  # a slot whose buffer was never made reads 0
        for k, device in enumerate(s.flags.devices):
            for chunk in range((len(where) + CHUNK - 1) // CHUNK):
                values = host.get((id(s), device, chunk))
                if values is not None:
                    part = slice(chunk * CHUNK, min((chunk + 1) * CHUNK, len(where)))
                    here = where[part] == k
                    flags[part][here] = values[: part.stop - part.start][here]
        out[id(s)] = flags
    return out


def has_births(steps: list[StepTrace], flags: dict[int, np.ndarray]) -> list[StepTrace]:
    """The steps whose flags show any non-finite value."""
    return [t for t in steps if any(flags[id(s)].any() for s in t.segments)]


def find_origin(
    trace: StepTrace, flags: dict[int, np.ndarray], params: list[Param], bad_weights: set[int] | None
) -> Origin | None:
    """The origin of what reached the gradients in one step's passes (nonfinite_walk.py).
    bad_weights: the parameters whose weight held inf/NaN at that step (None: not scanned)."""
    found, passes = find_in_step(trace, flags, params, bad_weights)
    if found is None:
        return None
    return Origin(trace.step, found.phase, found.micro, passes, found.where, found.kind, found.kinds, found.how)


# ---- the finding ------------------------------------------------------------------


def origin_finding(
    params: list[Param], records: list[StepRecord], traces: list[StepTrace]
) -> tuple[Finding | None, Origin | None]:
    """The nonfinite_origin finding of decoded `records` (oldest first) and
    the traced steps `traces`, and the origin it names: None, None while no
    recorded gradient holds inf/NaN."""
    if first_nonfinite(params, records) is None:
        return None, None
    target, start = _target(params, records)
    flags = read_flags(traces)
    births = has_births(traces, flags)
    severity = _severity(params, records)
    ranks = _rank_words(records)
    # A birth before `start` belongs to an earlier bad run, one after the target
    # step is its consequence (weights an optimizer step poisoned).
    weights = {r.step: _bad_weights(params, r) for r in records}
    origins = [o for o in (find_origin(t, flags, params, weights.get(t.step)) for t in births) if o is not None]
    found = [o for o in origins if start <= o.step <= target]
    if not found:
        traced = [t.step for t in traces if start <= t.step <= target]
        if target not in traced:
            return Finding(GLOBAL_NAME, "grad", severity, Cause.NONFINITE_ORIGIN, (
                f"the gradients of step {target} hold inf/NaN, and the trace holds no pass of that step (a "
                "forward pass under no_grad, on another thread, or older than the steps the trace keeps), so it "
                "cannot say where they came from" + ranks
            )), None
        consumed = any(start <= t.step <= target for t in births)
        return Finding(GLOBAL_NAME, "grad", severity, Cause.NONFINITE_ORIGIN, (
            f"the gradients of step {target} hold inf/NaN, but in the traced steps that led to them "
            f"({_steps_words(traced)}) no module's forward output or backward gradient on this rank held any"
            + (" that reached them (the infinities it met were consumed harmlessly, as a mask's are)"
               if consumed else "")
            + ", nor any parameter's incoming gradient: they came in after backward made the gradients (the "
            "gradient all-reduce from another rank, or code that changed .grad)" + ranks
        )), None
    origin = found[0]
    micro = f" (forward pass {origin.micro + 1} of {origin.passes})" if origin.passes > 1 else ""
    later = _later_words(origin, [o for o in origins if o.step > origin.step])
    return Finding(origin.where, origin.kind, severity, Cause.NONFINITE_ORIGIN, (
        f"{kinds_words(origin.kinds)} was born at step {origin.step}, in the {origin.phase} pass{micro}: "
        f"{origin.how}{later}{ranks}"
    )), origin


def _target(params: list[Param], records: list[StepRecord]) -> tuple[int, int]:
    """The step whose non-finite gradients the finding explains, and the first
    step its birth can be at: the first step taken on them (not skipped nor
    undone), else the first that held any; from the step after the last
    record before it whose gradients were finite."""
    bad = [k for k, r in enumerate(records) if nonfinite_grads(params, r)]
    applied = [k for k in bad if records[k].stepped and not undone(params, records, k)]
    k = applied[0] if applied else bad[0]
    finite = [j for j in range(k) if j not in bad]
    return records[k].step, records[finite[-1]].step + 1 if finite else -1


def _steps_words(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]} to {steps[-1]}"


def pointer(origin: Origin | None, finding: Finding | None) -> str:
    """What the nonfinite and skipped_steps findings add to point at the origin."""
    if finding is None:
        return ""
    if origin is None:
        return "; see the nonfinite_origin finding for where they came from"
    return f"; born at step {origin.step} in {origin.where} ({origin.phase}): see the nonfinite_origin finding"


def _bad_weights(params: list[Param], r: StepRecord) -> set[int] | None:
    if r.rows is None:
        return None
    return {int(i) for i in np.flatnonzero(r.rows.nonfinite_weights(len(params)))}


def _severity(params: list[Param], records: list[StepRecord]) -> Severity:
    """An error once a step was taken on inf/NaN gradients and not undone;
    information while every such step was skipped (GradScaler calibrating)."""
    for k, r in enumerate(records):
        if r.stepped and nonfinite_grads(params, r) and not undone(params, records, k):
            return Severity.ERROR
    return Severity.INFO


def _later_words(origin: Origin, later: list[Origin], most: int = 3) -> str:
    """The later steps whose passes made a non-finite value again. Those whose
    origin is a weight that already held inf/NaN are the first birth's
    consequence (an optimizer step applied it), said once."""
    if not later:
        return ""
    carried = [o for o in later if o.kind == "weight"]
    fresh = [o for o in later if o.kind != "weight"]
    words = ""
    if fresh:
        same = all(o.where == origin.where and o.phase == origin.phase for o in fresh)
        steps = listed([str(o.step) for o in fresh], most)
        where = "in the same place" if same else "; ".join(
            f"step {o.step}: {o.where} ({o.phase})" for o in fresh[:most]
        )
        words += f"; born again at {count_noun(len(fresh), 'later step')} ({steps}): {where}"
    if carried:
        words += (
            f"; from step {carried[0].step} on, the weights hold inf/NaN ({carried[0].where} is the first a "
            "forward pass met), so every pass makes it again"
        )
    return words


def _rank_words(records: list[StepRecord]) -> str:
    """Across ranks: which ranks' own passes made a non-finite value, at the first
    monitored step where any did."""
    for r in records:
        if r.born_ranks is not None and r.born_ranks[1] >= 0:
            low, high = r.born_ranks
            who = f"rank {low}" if low == high else f"ranks {low} to {high} (at least two)"
            return f"; across the process group, {who} made it first, by step {r.step}"
    return ""
