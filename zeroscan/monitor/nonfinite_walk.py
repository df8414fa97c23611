"""Monitor(trace_nonfinite=True), the walk over one step's passes: which
non-finite value reached the gradients, and where it was born.

Not every non-finite value is trouble. An additive attention mask (-inf
above the diagonal, or at padding), the -inf a running max starts from, the
-inf log-probability of a masked token and the inf sentinels of top-k,
max-pool padding or a distance matrix are part of the computation: softmax
or a masked reduction consumes them, and the call that took them returns
finite values. Such a value is "absorbed" once a call that took it returned
only finite values, and it is never named as an origin.

The trouble is what the gradients hold: a NaN if any gradient that reached
a parameter held one (or, where no parameter's gradient was flagged, if any
flag of the step is a NaN), else an infinity. Its origin is the first
non-finite value it descends from:

- forward, for a NaN: the first NaN the pass made. It descends from the
  non-finite inputs of the call that made it, unless they were absorbed (an
  inf − inf or 0 × inf there makes the NaN from an infinity, which is then
  the origin); with none, it was born in that call (in its own code, or in
  a weight it holds);
- backward: the first gradient that holds a non-finite value (for an
  infinity, this comes before the forward pass: a model may return a
  masked -inf that the loss consumes). A gradient made from a forward value
  that held a live (not absorbed) non-finite value descends from it (0 *
  inf in the backward); the gradient reaching the model's output descends
  from an infinity the model returned; else it was born in that backward.
  A NaN gradient after one that held inf descends from the inf;
- where no gradient arrival tells (past the hooks' cap), for an infinity:
  the first non-finite value the model returned.

A value first met as an input, made by the calling module's code, descends
from that module's live non-finite inputs, else was born in its code; for a
top-level call, it came in with the input batch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from zeroscan.monitor.nonfinite_trace import (
    MAX_HOOKED, NO_PASS, PARAMETER, ForwardPass, FrozenCall, Segment, StepTrace,
)
from zeroscan.monitor.step_record import Param
from zeroscan.words import listed

INFINITE, NAN = 1, 2  # the kinds bits of csrc/nonfinite.h


class Found(NamedTuple):
    """Where a non-finite value was born: the module named (or the parameter,
    "(input batch)", "(outside the model)"), "activation", "grad" or
    "weight", "forward" or "backward", the INFINITE | NAN bits, what was seen
    in words, and the pass (0-based, in the step) it was seen in."""

    where: str
    kind: str
    phase: str
    kinds: int
    how: str
    micro: int = 0


def kinds_words(kinds: int) -> str:
    return {INFINITE: "inf", NAN: "NaN", INFINITE | NAN: "NaN and inf"}.get(kinds, "inf/NaN")


def find_in_step(
    trace: StepTrace, flags: dict[int, np.ndarray], params: list[Param], bad_weights: set[int] | None
) -> tuple[Found | None, int]:
    """The origin of the trouble in one step's passes, and how many passes the step had."""
    want_nan = _wants_nan(trace, flags)
    micro = 0
    for segment in trace.segments:
        values = flags[id(segment)]
        flows = [PassFlow(p, values, params, bad_weights) for p in segment.passes]
        if want_nan:
            for k, flow in enumerate(flows):
                if flow.first_nan is not None:
                    return flow.trouble(flow.first_nan, "NaN")._replace(micro=micro + k), _count(trace)
        found = _backward(segment, flows, values, want_nan)
        if found is not None:
            if segment.hooks >= MAX_HOOKED:
                found = found._replace(how=f"{found.how} (the trace followed the gradients of the first "
                                           f"{MAX_HOOKED} tensors of this step's passes, and of the parameters)")
            return found._replace(micro=micro + found.micro), _count(trace)
        # No gradient arrival told (past the hooks' cap, say): an infinity the model returned.
        for k, flow in enumerate(flows):
            if flow.returned is not None:
                return flow.trouble(flow.returned, kinds_words(INFINITE))._replace(micro=micro + k), _count(trace)
        micro += len(flows)
    return None, _count(trace)


def _count(trace: StepTrace) -> int:
    return sum(len(s.passes) for s in trace.segments)


def _wants_nan(trace: StepTrace, flags: dict[int, np.ndarray]) -> bool:
    """Whether the trouble is a NaN: what the parameters' gradients held, or
    where none was flagged, what any flag of the step holds."""
    reached = 0
    for s in trace.segments:
        rows = np.asarray(s.arrivals).reshape(-1, 4)
        slots = rows[rows[:, 1] == PARAMETER, 3]
        slots = slots[slots >= 0]
        reached |= int(np.bitwise_or.reduce(flags[id(s)][slots])) if len(slots) else 0
    if reached:
        return bool(reached & NAN)
    return any(bool((flags[id(s)] & NAN).any()) for s in trace.segments)


class Seen(NamedTuple):
    """A tracked non-finite value: the Found of its origin, the origin's
    place among the pass's origins (earlier first), and how the trouble came
    from it in words ("" where it is the origin's own value)."""

    origin: Found
    order: int
    via: str = ""


class PassFlow:
    """One forward pass's flags, walked in the order its calls began and
    returned: where each non-finite value came from (`seen`, by tracked
    tensor), which were absorbed, the first NaN made, and the first
    non-finite value the top-level call returned."""

    def __init__(self, fpass: ForwardPass, values: np.ndarray, params: list[Param], bad: set[int] | None) -> None:
        self.fpass = fpass
        self._values = values
        self._params = params
        self._bad_weights = bad
        self.seen: dict[int, Seen] = {}
        self.absorbed: set[int] = set()
        self.first_nan: Seen | None = None
        self.returned: Seen | None = None
        self._unseen: list[str] = []  # "what M returned: a T", for calls returned so far
        self._met: dict[int, list[int]] = {}  # per call: its inputs, then what its children returned so far
        for event in fpass.events:
            number, returned = divmod(event, 2)
            if returned:
                self._returned(number)
            else:
                self._began(number)

    def bits(self, tracked: int) -> int:
        slot = self.fpass.fslots[tracked]
        return int(self._values[slot]) if slot >= 0 else 0

    def live(self, tracked: tuple[int, ...]) -> list[int]:
        """Those of `tracked` that hold a non-finite value no call absorbed."""
        return [t for t in tracked if self.bits(t) and t not in self.absorbed]

    @staticmethod
    def trouble(seen: Seen, what: str) -> Found:
        """The origin of `seen`, with how the trouble (`what`: "NaN", "inf") came from it."""
        if not seen.via:
            return seen.origin
        return seen.origin._replace(how=f"{seen.origin.how}; the {what} that reached the gradients descends "
                                        f"from it: {seen.via}")

    # ---- the walk ------------------------------------------------------------

    def _note(self, tracked: int, seen: Seen) -> None:
        self.seen[tracked] = seen
        if self.first_nan is None and self.bits(tracked) & NAN:
            self.first_nan = seen

    def _began(self, number: int) -> None:
        call = self.fpass.calls[number]
        self._met[number] = list(call.inputs)
        if call.parent < 0:
            self._unseen += [f"{call.name}'s input: a {t}" for t in call.unseen_in]
        for k, t in enumerate(call.inputs):
            bits = self.bits(t)
            if bits and t not in self.seen:
                self._note(t, self._made_before(call, call.labels[k], bits))

    def _returned(self, number: int) -> None:
        fpass = self.fpass
        call = fpass.calls[number]
        bad_out = [t for t in call.outputs if self.bits(t)]
        if not bad_out:
            self.absorbed.update(t for t in call.inputs if self.bits(t))
        for t in bad_out:
            if t not in self.seen:
                self._note(t, self._made_in(number, self.bits(t)))
        if call.parent < 0 and bad_out and self.returned is None:
            self.returned = self.seen[bad_out[0]]
        if call.parent >= 0:
            self._met.setdefault(call.parent, []).extend(call.outputs)
        self._unseen += [f"what {call.name} returned: a {t}" for t in call.unseen_out]

    def _descends(self, maker: int, bits: int, made: str) -> Seen | None:
        """A value call `maker`'s code made, from the live non-finite values its
        code had met (its inputs, and what its children returned), if any: it
        descends from the earliest of their origins."""
        live = self.live(tuple(self._met.get(maker, ())))
        if not live:
            return None
        first = min((self.seen[t] for t in live if t in self.seen), key=lambda s: s.order, default=None)
        if first is None:
            return None
        had = 0
        for t in live:
            had |= self.bits(t)
        via = first.via
        if bits & NAN and not had & NAN and not via:
            via = f"{made} NaN from that inf (inf - inf, or 0 * inf)"
        return Seen(first.origin, first.order, via)

    def _born(self, found: Found) -> Seen:
        return Seen(found, len(self.seen))

    def _made_in(self, number: int, bits: int) -> Seen:
        """A non-finite value call `number` returned, first met there."""
        call = self.fpass.calls[number]
        what = kinds_words(bits)
        descended = self._descends(number, bits, f"{call.name} returned")
        if descended is not None:
            return descended
        held = _held_weights(call.name, self._params, self._bad_weights)
        if held:
            return self._born(Found(held[0], "weight", "forward", bits, (
                f"{call.name} returned {what} from finite inputs, and its "
                f"{'parameter' if len(held) == 1 else 'parameters'} {listed(held, 3)} "
                f"{'holds' if len(held) == 1 else 'hold'} inf/NaN at this step: a non-finite weight"
            )))
        inner = [c.name for c in self.fpass.calls[number + 1:] if c.parent == number]
        own = f" (in its own code: the modules it called, {listed(inner, 3)}, returned finite values)" if inner else ""
        consumed = [call.labels[k] for k, t in enumerate(call.inputs) if self.bits(t)]
        inputs = "its inputs were finite"
        if consumed:
            inputs = f"its only non-finite inputs ({listed(consumed, 3)}) were consumed harmlessly (a mask)"
        if call.unseen_in:
            inputs += f" (of what the trace could see: not inside a {listed(list(call.unseen_in), 2)})"
        how = f"{call.name} returned {what} while {inputs}{own}"
        return self._born(Found(call.name, "activation", "forward", bits, how))

    def _made_before(self, call: FrozenCall, label: str, bits: int) -> Seen:
        """A non-finite value first met as an input of `call`: made by the
        code that called it."""
        fpass = self.fpass
        what = kinds_words(bits)
        name, parent_number = call.name, call.parent
        if parent_number < 0:
            batch = name == "(model)"
            where = "(input batch)" if batch else "(outside the model)"
            return self._born(Found(where, "activation", "forward", bits, (
                f"{name} was called with {what} in {label}: it came in with the input batch" if batch else
                f"{name} was called with {what} in {label}, made by code outside the model's forward"
            )))
        parent = fpass.calls[parent_number]
        descended = self._descends(parent_number, bits, f"{parent.name}'s code made")
        if descended is not None:
            return descended
        before = "while every module before returned finite values"
        if self._unseen:
            before = (f"while every module output before it that the trace could see was finite (it could not "
                      f"look into {listed(self._unseen, 2)})")
        return self._born(Found(parent.name, "activation", "forward", bits, (
            f"{parent.name} called {name} with {what} in {label}, {before}: made in {parent.name}'s own "
            "forward code, before that call"
        )))


def _held_weights(module: str, params: list[Param], bad_weights: set[int] | None) -> list[str]:
    """The parameters in `module` (or below it) whose weight held inf/NaN."""
    if not bad_weights:
        return []
    prefix = "" if module == "(model)" else module + "."
    return [params[i].name for i in sorted(bad_weights) if params[i].name.startswith(prefix)]


# ---- backward ----------------------------------------------------------------------


def _backward(segment: Segment, flows: list[PassFlow], values: np.ndarray, want_nan: bool) -> Found | None:
    """The first gradient of the segment's backward pass that holds the
    trouble. A NaN that came after a gradient holding inf descends from that
    inf (inf - inf, 0 * inf in a backward function): the inf's origin is named."""
    rows = np.asarray(segment.arrivals).reshape(-1, 4).tolist()
    for k, (_, _, _, slot) in enumerate(rows):
        kinds = int(values[slot]) if slot >= 0 else 0
        if not kinds:
            continue
        found = _arrival(rows[k], flows, kinds)
        if found is None:
            continue
        if not want_nan or kinds & NAN:
            return found
        nan = next((r for r in rows[k + 1:] if r[3] >= 0 and int(values[r[3]]) & NAN), None)
        if nan is None:
            return found
        later = _arrival(nan, flows, int(values[nan[3]]))
        where = f" at {later.where}" if later is not None else ""
        return found._replace(how=f"{found.how}; the NaN that reached the gradients descends from it: a later "
                                  f"gradient{where} held NaN made from that inf (inf - inf, or 0 * inf)")
    return None


def _arrival(row: list[int], flows: list[PassFlow], kinds: int) -> Found | None:
    """Where the non-finite gradient of one arrival row was born."""
    number, what, index, _ = row
    words = kinds_words(kinds)
    if what == PARAMETER:
        if not flows:
            return None
        name, owner = flows[0].fpass.params[index]
        owner = owner or "(model)"
        found = Found(owner, "grad", "backward", kinds, (
            f"the gradient {owner}'s backward gave its parameter {name} held {words}, while every gradient "
            "before it was finite"
        ), len(flows) - 1)
        return _from_forward(found, [(k, f, c) for k, f in enumerate(flows) for c in f.fpass.calls if c.name == owner])
    if number == NO_PASS or number >= len(flows):
        return None
    return _tensor_arrival(flows[number], number, index, words, kinds)


def _tensor_arrival(flow: PassFlow, number: int, index: int, words: str, kinds: int) -> Found:
    calls = flow.fpass.calls
    takers = [c for c in calls if index in c.inputs]
    if takers:
        taker = max(takers, key=lambda c: c.depth)
        label = taker.labels[taker.inputs.index(index)]
        found = Found(taker.name, "grad", "backward", kinds, (
            f"the gradient {taker.name}'s backward gave its input {label} held {words}, while the gradients "
            "it received were finite"
        ), number)
        return _from_forward(found, [(number, flow, taker)])
    makers = [(n, c) for n, c in enumerate(calls) if index in c.outputs]
    if not makers or min(c.depth for _, c in makers) == 0:
        outer = makers[0][1].name if makers else "the model"
        if flow.returned is not None and flow.bits(index):
            origin = flow.returned.origin
            return origin._replace(how=f"{origin.how}; the {words} gradient descends from it: the output of "
                                       f"{outer} held that value, and the loss's backward met it (0 * inf)",
                                   micro=number)
        return Found("(outside the model)", "grad", "backward", kinds, (
            f"the gradient reaching the output of {outer} held {words}: made outside the model, by the loss "
            "or the gradient given to backward()"
        ), number)
    _, maker = max(makers, key=lambda nc: nc[1].depth)
    parent = calls[maker.parent].name
    found = Found(parent, "grad", "backward", kinds, (
        f"the gradient reaching the output of {maker.name} held {words}, while every gradient before it was "
        f"finite: made in the backward of {parent}'s own code, which used that output"
    ), number)
    return _from_forward(found, [(number, flow, calls[maker.parent])])


def _from_forward(found: Found, calls: list[tuple[int, PassFlow, FrozenCall]]) -> Found:
    """A backward birth in a module whose forward held a live non-finite
    value: the gradient descends from that value (0 * inf in the backward)."""
    for number, flow, call in calls:
        live = flow.live(call.inputs + call.outputs)
        seen = [flow.seen[t] for t in live if t in flow.seen]
        if seen:
            origin = seen[0].origin
            return origin._replace(how=(
                f"{origin.how}; the {kinds_words(found.kinds)} gradient descends from it: "
                f"{call.name}'s forward held that value, and its backward made {kinds_words(found.kinds)} "
                "from it (0 * inf)"
            ), micro=number)
    return found
