"""What one monitored step leaves behind, and reading it back.

A `Slot` is one scanned tensor of a parameter: its gradient or its weight,
numbered by `Slot.row` (2 per parameter). A `Param` is a parameter as the
Monitor knows it. A `StepRecord` holds one monitored step's raw result
buffers, still on their devices, until report() reads them back (one copy
per device, none on the CPU) into a RowTable (table.py). With
Monitor(histogram=True) the same scans also count each tensor's histogram
fields, kept beside the rows (`StepRecord.fields`) and read back with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch import nn

from zeroscan.monitor.table import FieldBlock, RowTable
from zeroscan.result_row import NUM_FIELDS, Row, decode
from zeroscan.words import RankSet

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


def grad_row(param: int) -> int:
    """Slot.grad(param).row, without making the Slot (the step path makes thousands)."""
    return 2 * param


def weight_row(param: int) -> int:
    return 2 * param + 1


@dataclass
class Param:
    index: int
    name: str
    aliases: tuple[str, ...]
    tensor: torch.Tensor
    owner: str  # qualified name of the module holding it, "" for the root
    embedding: bool  # rows of tokens absent from a batch get zero gradient by design


class Why(NamedTuple):
    """Why a parameter's gradient is None or exactly zero (the cause
    analysis): its cause, the message about this parameter, and `root`: the
    cause itself, worded for every parameter it explains, so that the report
    gives one finding per root cause (None: this parameter's own)."""

    cause: str
    message: str
    root: str | None = None


class Activation(NamedTuple):
    """A decoded activation scan: the output and its per-unit summary."""

    name: str
    tag: str  # "relu" or "softmax"
    output: Row
    unit: Row


class Unscanned(NamedTuple):
    """A tensor the native scan cannot read (zeroscan.ops.scannable_form), left out of a step."""

    name: str  # the parameter's
    kind: SlotKind
    dtype: str
    why: str  # a phrase that follows the tensor's name

    @property
    def label(self) -> str:
        return self.name if self.kind == "weight" else f"the gradient of {self.name}"


class Scan(NamedTuple):
    """One native scan of tensors on one device, not read: their Slot rows,
    their result rows int64 [K, 16] and, when the histograms are counted,
    their histogram fields."""

    slots: list[int]
    rows: torch.Tensor
    fields: FieldBlock | None


class StepRecord:
    """One monitored step: raw result buffers (still on their devices) and
    what the Python side knew at that step."""

    __slots__ = (
        "step", "stepped", "groups", "fields", "requires_grad", "none_causes", "activations", "notes", "unscanned",
        "rows", "acts", "exchange", "rank_findings", "shard_ranks", "sharded", "uncounted", "cleared",
        "zero_causes", "lrs", "born_ranks", "witness", "context", "skipped_by",
    )

    def __init__(self, step: int) -> None:
        self.step = step
        # True: optimizer.step() (or Monitor.step()) ran on these gradients. False: the
        # gradients were reset after a backward pass without a step (a GradScaler skip,
        # or a backward pass that no step follows); None: the step is still open.
        self.stepped: bool | None = True
        self.skipped_by: str | None = None  # the framework whose step skipped itself (frameworks.py)
        # Per device: Slot rows (Slot.row), int64 [N, 16]. Groups scanned later (a
        # gradient changed between the end of backward and the step) come later and win.
        self.groups: list[tuple[list[int], torch.Tensor]] = []
        # Beside each group: its histogram fields, on its device until decoded (then
        # the RowTable holds them), or None (scanned without, or dropped).
        self.fields: list[FieldBlock | None] = []
        self.requires_grad: tuple[bool, ...] = ()
        self.none_causes: dict[int, Why] = {}  # param -> why its gradient is None
        # param -> why its gradient is exactly zero: found afresh by each report() for the
        # step it judges (so never renumbered).
        self.zero_causes: dict[int, Why] = {}
        # Each optimizer param group's learning rate as this step ran (None: no optimizer).
        self.lrs: tuple[object, ...] | None = None
        self.activations: list[tuple[str, str, torch.Tensor]] = []  # name, "relu"|"softmax", [2, 16]
        self.notes: list[tuple[str, str]] = []  # (name, why it was not scanned)
        self.unscanned: list[Unscanned] = []  # tensors of a dtype (or form) the scan cannot read
        # Set when decoded: the rows by Slot row; a gradient's row that the step's scan
        # replaced (or that zero_grad() cleared before the step) is its row `before`.
        self.rows: RowTable | None = None
        self.acts: list[Activation] | None = None
        # Across ranks: the merged summary of this step's rows (zeroscan.distributed.allreduce, on the
        # device; dropped once decoded), findings about ranks that disagree, and for slots
        # whose merged shards hold non-finite values the ranks whose shards hold them.
        self.exchange: torch.Tensor | None = None
        self.rank_findings: dict[Slot, Any] = {}
        self.shard_ranks: dict[Slot, RankSet] = {}
        self.sharded: list[Slot] = []  # across ranks: slots scanned through a local shard
        self.uncounted: list[Slot] = []  # ... whose shard another rank contributes
        # Parameters whose gradient existed when backward ended but was gone at the
        # step (zero_grad() in between).
        self.cleared: list[int] = []
        # Across ranks, with trace_nonfinite: the least and greatest global rank whose
        # traced passes made a non-finite value since the previous monitored step.
        self.born_ranks: tuple[int, int] | None = None
        # The first values of a few gradients, read when backward ended while the step's
        # own read waits for optimizer.step() (deferred.py): decoded as rows `before` only.
        self.witness: Scan | None = None
        # What the step ran under beside the scan (autocast, GradScaler, writes into the
        # gradients after backward: context.StepContext), set at its optimizer step.
        self.context: Any = None

    def add(self, scans: list[Scan]) -> None:
        """Keeps the results of `scans`, later than those kept so far."""
        for scan in scans:
            self.groups.append((scan.slots, scan.rows))
            self.fields.append(scan.fields)

    def drop_histograms(self) -> None:
        """Frees this step's histogram fields, on the device or decoded."""
        self.fields = [None] * len(self.groups)
        if self.rows is not None:
            self.rows.drop_histograms()

    def row(self, slot: Slot) -> Row | None:
        """The decoded fields of `slot` at this step, or None if not scanned."""
        return None if self.rows is None else self.rows.row(slot.row)


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


def decode_records(records: list[StepRecord], *, own_rows: bool = True) -> None:
    """Reads back every record not decoded yet: one copy per device (none for
    the CPU, whose buffers are read where they are) into a RowTable per record,
    the histogram fields with the rows. own_rows=False decodes the activations
    only (the rows come from elsewhere)."""
    pending: list[tuple[StepRecord, str, int, torch.Tensor]] = []
    for r in records:
        if r.rows is None:
            for k, (_, buf) in enumerate(r.groups if own_rows else []):
                pending.append((r, "group", k, buf))
                block = _block(r, k)
                if block is not None:
                    pending.append((r, "fields", k, block.fields))
            for k, (_, _, buf) in enumerate(r.activations):
                pending.append((r, "act", k, buf))
            if r.witness is not None and own_rows:
                pending.append((r, "witness", 0, r.witness.rows))
    by_device: dict[torch.device, list[tuple[StepRecord, str, int, torch.Tensor]]] = {}
    for item in pending:
        by_device.setdefault(item[3].device, []).append(item)
    host: dict[tuple[int, str, int], np.ndarray] = {}
    for device, items in by_device.items():
        # Rows are [K, 16] and fields [K, B]: copied flat, in one piece per device.
        buffers = [buf.detach() if what == "fields" else buf.detach().reshape(-1, NUM_FIELDS)
                   for _, what, _, buf in items]
        if device.type != "cpu":
            copied = torch.cat([b.reshape(-1) for b in buffers]).to("cpu")
            pieces = copied.split([b.numel() for b in buffers])
            buffers = [piece.reshape(b.shape) for piece, b in zip(pieces, buffers)]
        for (r, what, k, _), buf in zip(items, buffers):
            host[(id(r), what, k)] = buf.numpy()
    for r in records:
        if r.rows is not None:
            continue
        groups = []
        blocks: list[FieldBlock | None] = []
        for k, (slots, _) in enumerate(r.groups if own_rows else []):
            rows = np.array(slots, dtype=np.int64)
            words = host[(id(r), "group", k)]
            kept = rows >= 0  # a Slot row of a parameter gone from the model is -1 or -2
            groups.append((rows, words) if kept.all() else (rows[kept], words[kept]))
            blocks.append(_host_block(_block(r, k), host.get((id(r), "fields", k)), kept))
        acts = []
        for k, (name, tag, _) in enumerate(r.activations):
            output, unit = decode(torch.from_numpy(host[(id(r), "act", k)]))
            acts.append(Activation(name, tag, output, unit))
        r.rows = RowTable(groups, blocks)
        r.fields = [None] * len(r.groups)  # the table holds them now: the device copies go
        if r.witness is not None and own_rows:
            rows = np.array(r.witness.slots, dtype=np.int64)
            r.rows.witnessed(rows, host[(id(r), "witness", 0)])
            r.witness = None
        r.acts = acts
        for i in r.cleared:  # gone before the step: not the step's gradients
            r.rows.clear(grad_row(i))


def _block(r: StepRecord, k: int) -> FieldBlock | None:
    return r.fields[k] if k < len(r.fields) else None


def _host_block(block: FieldBlock | None, fields: np.ndarray | None, kept: np.ndarray) -> FieldBlock | None:
    """A group's FieldBlock with its fields read back, for the rows `kept`."""
    if block is None or fields is None:
        return None
    if kept.all():
        return FieldBlock(fields, block.dtypes)
    return FieldBlock(fields[kept], tuple(d for d, keep in zip(block.dtypes, kept.tolist()) if keep))


def renumber(r: StepRecord, new_index: dict[int, int], requires_grad: tuple[bool, ...]) -> None:
    """Renumbers a record's parameters after the model changed: `new_index`
    maps old parameter numbers to new ones (a parameter gone maps nowhere,
    and its rows are dropped); `requires_grad` fills in the new parameters."""

    def slot(s: Slot) -> Slot:
        return Slot(new_index.get(s.param, -1), s.kind)  # -1: no parameter reads it

    def keyed(d: dict[Slot, Any]) -> dict[Slot, Any]:
        return {slot(s): v for s, v in d.items() if s.param in new_index}

    def row(old: int) -> int:
        return slot(Slot.at_row(old)).row

    r.groups = [([row(s) for s in slots], buffer) for slots, buffer in r.groups]
    if r.witness is not None:
        r.witness = r.witness._replace(slots=[row(s) for s in r.witness.slots])
    if r.rows is not None:
        new_row = np.full(2 * (max(new_index, default=-1) + 1), -1, dtype=np.int64)
        for i, j in new_index.items():
            new_row[2 * i : 2 * i + 2] = (2 * j, 2 * j + 1)
        r.rows = r.rows.renumbered(new_row, 2 * len(requires_grad))
    r.rank_findings = keyed(r.rank_findings)
    r.shard_ranks = keyed(r.shard_ranks)
    r.sharded = [slot(s) for s in r.sharded]
    r.uncounted = [slot(s) for s in r.uncounted]
    r.none_causes = {new_index[i]: v for i, v in r.none_causes.items() if i in new_index}
    r.cleared = [new_index[i] for i in r.cleared if i in new_index]
    old = {new_index[i]: v for i, v in enumerate(r.requires_grad) if i in new_index}
    r.requires_grad = tuple(old.get(j, v) for j, v in enumerate(requires_grad))
