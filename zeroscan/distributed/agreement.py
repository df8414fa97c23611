"""The ranks agree on what a collective call merges before it merges it.

Every collective call of zeroscan (zeroscan.distributed's, the Monitor's
exchange across ranks) first checks that every rank of the group brings the
same things: as many tensors, each with the dtype and the shape that must
agree (a DTensor's global shape, not its local shard's; nothing for the
pieces of a hand-sharded tensor, whose sizes differ by design), and the
same options. The merge's own collectives have sizes that follow from those
(an all-reduce of N rows): ranks that made them with different sizes abort
in gloo and hang or mix tensors up in NCCL. The check cannot mismatch
itself: it is one all-reduce of two int64 words, the same on every rank
whatever the ranks pass: the least and (as ~) the greatest of a 64-bit
fingerprint of what each rank merges, read back on the host.

When they differ, every rank raises the same one-line ValueError naming the
call, what differs and on which ranks. Finding that takes a few more small
collectives, on that path only, and the same on every rank: the least and
greatest count and options, then each item's (up to the common count), then
one all_gather_object of the differing value. Every rank has then made the
same collectives, so the group is left usable.

A rank that refuses its own arguments (a list element that is not a tensor)
takes part with its refusal, and every rank raises it: the other ranks are
not left waiting in a merge that rank never joins.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from zeroscan.distributed.common import comm_device
from zeroscan.words import span

Item = tuple[str, str]  # an item's label ("tensors[1]", a parameter's name) and what must agree about it
SHOWN = 3  # values a message shows; the rest are counted


class Merged(NamedTuple):
    """What one rank brings to a collective call; every rank must bring the same.

    noun: what the items are ("tensors", "rows", "parameters").
    count: how many.
    items: per item, its label and the words that must agree about it
        (only what must agree); empty: only the count must.
    options: the call's options that must agree, as words ("tol=None").
    refusal: this rank's own error about its arguments (a TypeError or ValueError).
    """

    noun: str
    count: int
    items: Sequence[Item] = ()
    options: str = ""
    refusal: Exception | None = None


class Difference(NamedTuple):
    """What the ranks disagree on: `kind` "refusal", "count", "options" or
    "item" (`index`: the first item that differs); `values`: each distinct
    value with the global ranks holding it, in order of their lowest rank.
    A value: a (type name, message) pair, a count, the options' words, an Item."""

    kind: str
    index: int | None
    values: list[tuple[object, tuple[int, ...]]]


Explain = Callable[[Difference], str | None]  # a call's own wording of a Difference; None: the common one


def tensor_words(dtype: torch.dtype, shape: Sequence[int], placements: Sequence[object] | None = None) -> str:
    """A tensor as an item's words: "float32 [4, 3]", and a DTensor's
    placements: "float32 [4, 3] DTensor (Shard(dim=0))"."""
    words = f"{str(dtype).removeprefix('torch.')} {list(shape)}"
    return words if placements is None else f"{words} DTensor ({', '.join(repr(p) for p in placements)})"


def check_agreement(op: str, group: dist.ProcessGroup, merged: Merged, *, explain: Explain | None = None) -> None:
    """Returns when every rank of `group` brings what this one does (and
    none refused its arguments); else raises the same error on every rank.
    A COLLECTIVE: every rank of the group calls it, before the merge."""
    device = comm_device(group, torch.device("cpu"))  # gloo's CPU when the group has it: no device wait
    low, high = _min_max([_fingerprint(op, merged)], group, device)
    if low != high:
        raise _error(op, merged, _difference(merged, group, device), explain)
    if merged.refusal is not None:  # every rank refused alike
        raise merged.refusal


def _hash(value: object) -> int:
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _refusal(merged: Merged) -> tuple[str, str] | None:
    e = merged.refusal
    return None if e is None else (type(e).__name__, str(e).split("\n", 1)[0])


def _fingerprint(op: str, merged: Merged) -> int:
    return _hash((op, merged.noun, _refusal(merged), merged.count, merged.options, tuple(merged.items)))


def _min_max(values: Sequence[int], group: dist.ProcessGroup, device: torch.device) -> tuple[list[int], list[int]]:
    """The least and greatest of each of `values` (int64s) over the ranks:
    one all-reduce of 2 words each, read back."""
    k = len(values)
    words = torch.tensor([*values, *(~v for v in values)], dtype=torch.int64, device=device)
    dist.all_reduce(words, op=dist.ReduceOp.MIN, group=group)
    host = words.tolist()
    return host[:k], [~w for w in host[k:]]


def _differs(spread: tuple[list[int], list[int]]) -> int | None:
    """The first position whose least and greatest differ, if any."""
    return next((i for i, (lo, hi) in enumerate(zip(*spread)) if lo != hi), None)


def _difference(merged: Merged, group: dist.ProcessGroup, device: torch.device) -> Difference:
    """What differs and on which ranks (the failure path: a few small
    collectives, the same on every rank)."""
    refusal = _refusal(merged)
    fields = _differs(_min_max([_hash(refusal), merged.count, _hash(merged.options)], group, device))
    kind, index, value = "item", None, None
    if fields is not None:
        kind = ("refusal", "count", "options")[fields]
        value = (refusal, merged.count, merged.options)[fields]
    elif merged.items:  # the same count everywhere: the items pair up
        index = _differs(_min_max([_hash(item) for item in merged.items], group, device))
        value = None if index is None else merged.items[index]
    gathered: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    ranks = dist.get_process_group_ranks(group)
    values: dict[str, tuple[object, list[int]]] = {}
    for rank, v in zip(ranks, gathered):
        values.setdefault(repr(v), (v, []))[1].append(rank)
    return Difference(kind, index, [(v, tuple(r)) for v, r in values.values()])


def _error(op: str, merged: Merged, d: Difference, explain: Explain | None) -> Exception:
    """The one error every rank raises for `d`: the same words everywhere."""
    if d.kind == "refusal":
        (kind, message), ranks = next((v, r) for v, r in d.values if v is not None)  # type: ignore[misc]
        cls = TypeError if kind == "TypeError" else ValueError
        return cls(f"{message} (on {span(ranks)}; every rank of the group raises it, none merges)")
    message = explain(d) if explain is not None else None
    if message is not None:
        return ValueError(message)
    noun = merged.noun
    shown = d.values[:SHOWN]
    more = f", and {len(d.values) - SHOWN} more" if len(d.values) > SHOWN else ""
    if d.kind == "count":
        what = ", ".join(f"{span(r)}: {v} {noun}" for v, r in shown)
        must = f"as many {noun}, in the same order"
    elif d.kind == "options":
        what = ", ".join(f"{span(r)}: {v}" for v, r in shown)
        must = "the same options"
    elif d.index is not None:
        what = ", ".join(f"{span(r)}: {v[0]} is {v[1]}" for v, r in shown)  # type: ignore[index]
        must = f"the same {noun}, in the same order"
    else:  # fingerprints that differ while every field hashes alike (a collision of 64-bit hashes)
        what = "their fingerprints differ"
        must = f"the same {noun} in the same order"
    return ValueError(f"{op}: the ranks disagree on what they merge ({what}{more}); every rank must pass {must}")
