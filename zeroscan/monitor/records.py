"""What one monitored step leaves behind, and reading it back.

A `Slot` is one scanned tensor of a parameter: its gradient or its weight.
A `Param` is a parameter as the Monitor knows it. A `StepRecord` holds one
monitored step's raw result buffers, still on their devices, until
report() decodes them (one copy per device) into rows keyed by Slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from zeroscan import distributed as zdist
from zeroscan.ops import scannable_form
from zeroscan.record import NUM_FIELDS, Row, decode

SlotKind = Literal["grad", "weight"]


class Slot(NamedTuple):
    """The gradient or the weight of parameter number `param`. Across ranks,
    each slot has a row of the packed buffer (`row`): 2 per parameter."""

    param: int
    kind: SlotKind

    @classmethod
    def grad(cls, param: int) -> Slot:
        return cls(param, "grad")

    @classmethod
    def weight(cls, param: int) -> Slot:
        return cls(param, "weight")

    @classmethod
    def at_row(cls, row: int) -> Slot:
        return cls(row // 2, "grad" if row % 2 == 0 else "weight")

    @property
    def row(self) -> int:
        return 2 * self.param + (self.kind == "weight")


def slot_rows(params: int) -> int:
    """Rows of the packed buffer for `params` parameters (a grad and a weight each)."""
    return 2 * params


ScannedRow = tuple[Row, tuple[int, ...]]  # a decoded result row and its raw int64 words


@dataclass
class Param:
    index: int
    name: str
    aliases: tuple[str, ...]
    tensor: torch.Tensor
    owner: str  # qualified name of the module holding it, "" for the root
    embedding: bool  # rows of tokens absent from a batch get zero gradient by design


class Activation(NamedTuple):
    """A decoded activation scan: the output and its per-unit summary."""

    name: str
    tag: str  # "relu" or "softmax"
    output: Row
    unit: Row


class StepRecord:
    """One monitored step: raw result buffers (still on their devices) and
    what the Python side knew at that step."""

    __slots__ = (
        "step", "stepped", "groups", "requires_grad", "none_causes", "activations", "notes", "rows", "acts",
        "gather", "rank_findings", "shard_ranks", "sharded", "uncounted", "cleared", "before_step",
    )

    def __init__(self, step: int) -> None:
        self.step = step
        # True: optimizer.step() (or Monitor.step()) ran on these gradients. False: the
        # gradients were reset after a backward pass without a step (a GradScaler skip,
        # or a backward pass that no step follows); None: the step is still open.
        self.stepped: bool | None = True
        # Per device: slots, int64 [N, 16]. Groups scanned later (a gradient changed
        # between the end of backward and the step) come later and win.
        self.groups: list[tuple[list[Slot], torch.Tensor]] = []
        self.requires_grad: tuple[bool, ...] = ()
        self.none_causes: dict[int, tuple[str, str]] = {}  # param -> (cause, message)
        self.activations: list[tuple[str, str, torch.Tensor]] = []  # name, "relu"|"softmax", [2, 16]
        self.notes: list[tuple[str, str]] = []  # (name, why it was not scanned)
        self.rows: dict[Slot, ScannedRow] | None = None  # set when decoded
        self.acts: list[Activation] | None = None
        # Across ranks: the pending all_gather of this step's packed rows (dropped once
        # decoded), findings about ranks that disagree, and for slots whose merged
        # shards hold non-finite values the ranks whose shards hold them.
        self.gather: zdist.PendingMerge[zdist.GatheredRows] | None = None
        self.rank_findings: dict[Slot, Any] = {}
        self.shard_ranks: dict[Slot, tuple[int, ...]] = {}
        self.sharded: list[Slot] = []  # across ranks: slots scanned through a local shard
        self.uncounted: list[Slot] = []  # ... whose shard another rank contributes
        # Parameters whose gradient existed when backward ended but was gone at the
        # step (zero_grad() in between), and the rows that the step's scan replaced.
        self.cleared: list[int] = []
        self.before_step: dict[Slot, Row] = {}

    def row(self, slot: Slot) -> Row | None:
        """The decoded fields of `slot` at this step, or None if not scanned."""
        scanned = (self.rows or {}).get(slot)
        return scanned[0] if scanned is not None else None


def collect_params(model: nn.Module) -> list[Param]:
    """The model's parameters, tied ones once, with every other name they go by."""
    aliases: dict[int, list[str]] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(t), []).append(name)
    embedding_ids = {
        id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
    }
    params = []
    for name, t in model.named_parameters():
        params.append(Param(
            index=len(params),
            name=name,
            aliases=tuple(a for a in aliases[id(t)] if a != name),
            tensor=t,
            owner=name.rsplit(".", 1)[0] if "." in name else "",
            embedding=id(t) in embedding_ids,
        ))
    return params


def native_many(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One native scan of tensors on one device: int64 [N, 16], not read."""
    return torch.ops.zeroscan.stats_many.default(tensors, None)


def scan_by_device(
    tensors: list[torch.Tensor], slots: list[Slot], params: list[Param], notes: list[tuple[str, str]]
) -> list[tuple[list[Slot], torch.Tensor]]:
    """One native scan per device of what can be scanned of `tensors` (see
    zeroscan.ops.scannable_form); a note in `notes` for each that cannot."""
    by_device: dict[torch.device, tuple[list[Slot], list[torch.Tensor]]] = {}
    for t, slot in zip(tensors, slots):
        ready, why = scannable_form(t)
        if ready is None:
            notes.append((f"{params[slot.param].name}:{slot.kind}", f"not scanned: it {why}"))
            continue
        entry = by_device.setdefault(ready.device, ([], []))
        entry[0].append(slot)
        entry[1].append(ready)
    groups = []
    for group_slots, group in by_device.values():
        try:
            groups.append((group_slots, native_many(group)))
        except (RuntimeError, ValueError, TypeError) as err:
            for slot in group_slots:
                notes.append((f"{params[slot.param].name}:{slot.kind}", f"not scanned: {err}"))
    return groups


def unit_peak(out: torch.Tensor, *, nonneg: bool) -> torch.Tensor:
    """Per-unit max |output| over the batch: 0 means the unit is dead.
    Units are the last dim, or dim 1 (channels) for 4-D and 5-D outputs."""
    if out.dim() == 0 or out.numel() == 0:
        return out.reshape(-1)
    mags = out if nonneg else out.abs()
    unit_dim = 1 if out.dim() >= 4 else out.dim() - 1
    dims = tuple(d for d in range(out.dim()) if d != unit_dim)
    return mags.amax(dim=dims) if dims else mags


def softmax_gap(out: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """1 - max probability per row: <= eps means the row is saturated."""
    if out.dim() == 0 or out.numel() == 0:
        return out.reshape(-1)
    dim = getattr(module, "dim", None)
    dim = -1 if dim is None else dim
    return (1.0 - out.amax(dim=dim)).reshape(-1)


def decode_records(records: list[StepRecord], *, own_rows: bool = True) -> None:
    """Host-decodes every record not decoded yet: one copy per device.
    own_rows=False decodes the activations only (the rows come from elsewhere)."""
    pending: list[tuple[StepRecord, str, int, torch.Tensor]] = []
    for r in records:
        if r.rows is None:
            for k, (_, buf) in enumerate(r.groups if own_rows else []):
                pending.append((r, "group", k, buf))
            for k, (_, _, buf) in enumerate(r.activations):
                pending.append((r, "act", k, buf))
    by_device: dict[torch.device, list[tuple[StepRecord, str, int, torch.Tensor]]] = {}
    for item in pending:
        by_device.setdefault(item[3].device, []).append(item)
    decoded: dict[tuple[int, str, int], tuple[list[Row], list[list[int]]]] = {}
    for items in by_device.values():
        host = torch.cat([buf.reshape(-1, NUM_FIELDS) for *_, buf in items]).to("cpu")
        fields = decode(host)
        raw = host.tolist()
        start = 0
        for r, what, k, buf in items:
            n = buf.reshape(-1, NUM_FIELDS).shape[0]
            decoded[(id(r), what, k)] = (fields[start:start + n], raw[start:start + n])
            start += n
    for r in records:
        if r.rows is not None:
            continue
        rows: dict[Slot, ScannedRow] = {}
        for k, (slots, _) in enumerate(r.groups if own_rows else []):
            fields, raw = decoded[(id(r), "group", k)]
            for slot, f, w in zip(slots, fields, raw):
                if slot in rows:
                    r.before_step[slot] = rows[slot][0]
                rows[slot] = (f, tuple(w))
        acts = []
        for k, (name, tag, _) in enumerate(r.activations):
            fields, _ = decoded[(id(r), "act", k)]
            acts.append(Activation(name, tag, fields[0], fields[1]))
        r.rows = rows
        r.acts = acts
        drop_cleared(r)


def drop_cleared(r: StepRecord) -> None:
    """The gradients cleared between backward and the step are not the step's:
    their rows at the end of backward move to before_step."""
    for i in r.cleared:
        scanned = (r.rows or {}).pop(Slot.grad(i), None)
        if scanned is not None:
            r.before_step[Slot.grad(i)] = scanned[0]


def renumber(r: StepRecord, new_index: dict[int, int], requires_grad: tuple[bool, ...]) -> None:
    """Renumbers a record's parameters after the model changed: `new_index`
    maps old parameter numbers to new ones (a parameter gone maps nowhere,
    and its rows are dropped); `requires_grad` fills in the new parameters."""

    def slot(s: Slot) -> Slot:
        return Slot(new_index.get(s.param, -1), s.kind)  # -1: no parameter reads it

    def keyed(d: dict[Slot, Any]) -> dict[Slot, Any]:
        return {slot(s): v for s, v in d.items() if s.param in new_index}

    r.groups = [([slot(s) for s in slots], buffer) for slots, buffer in r.groups]
    if r.rows is not None:
        r.rows = keyed(r.rows)
    r.before_step = keyed(r.before_step)
    r.rank_findings = keyed(r.rank_findings)
    r.shard_ranks = keyed(r.shard_ranks)
    r.sharded = [slot(s) for s in r.sharded]
    r.uncounted = [slot(s) for s in r.uncounted]
    r.none_causes = {new_index[i]: v for i, v in r.none_causes.items() if i in new_index}
    r.cleared = [new_index[i] for i in r.cleared if i in new_index]
    old = {new_index[i]: v for i, v in enumerate(r.requires_grad) if i in new_index}
    r.requires_grad = tuple(old.get(j, v) for j, v in enumerate(requires_grad))


def unchanged_for(records: list[StepRecord], param: int) -> int:
    """How many of the latest records hold a bit-identical scan of the weight of `param`."""
    slot = Slot.weight(param)
    last = (records[-1].rows or {}).get(slot) if records else None
    if last is None:
        return 0
    count = 0
    for r in reversed(records):
        row = (r.rows or {}).get(slot)
        if row is None or row[1] != last[1]:
            break
        count += 1
    return count


def tensor_dict(name: str, kind: str, f: Row) -> dict[str, Any]:
    """One entry of Report.tensors."""
    n = int(f["numel"])
    return {
        "name": name,
        "kind": kind,
        "numel": n,
        "zero_fraction": int(f["zeros"]) / n if n else 0.0,
        "subnormal_fraction": int(f["subnormal"]) / n if n else 0.0,
        "near_zero_fraction": int(f["near_zero"]) / n if n else 0.0,
        "nan": int(f["nan"]),
        "inf": int(f["posinf"]) + int(f["neginf"]),
        "norm": float(f["norm"]),
        "mean": float(f["mean"]),
        "std": float(f["std"]),
        "min_abs": float(f["min_abs"]),
        "max_abs": float(f["max_abs"]),
    }


def nonfinite_words(f: Row) -> str:
    parts = [f"{int(f[k])} {label}" for k, label in (("nan", "NaN"), ("posinf", "+inf"), ("neginf", "-inf")) if f[k]]
    return " and ".join(parts) + f" among {int(f['numel'])} values"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
