"""The Monitor across ranks (`process_group=`): all-reduces of O(P) words per step.

Each monitored step scans as on one rank, a DTensor parameter or gradient
(FSDP2, tensor parallel) through its local shard (a Partial placement is
reduced first, a collective of its own) and a plain tensor as one
data-parallel replica (DDP), then packs the rows into one int64 [2P, 16]
buffer (a row per Slot) and merges it over the group with the two rounds of
all-reduces of zeroscan/distributed/allreduce.py: what each rank sends and keeps is a
few hundred bytes per tensor, whatever the world size. The step keeps only
the summary, int64 [2P, 24] on the device the group's backend uses
(Col), and nothing is read back until report(), which judges:
  sharded tensors    the ranks' rows merged (counts and min/max exact): the
                     statistics of the full tensor; a non-finite value is
                     reported with the ranks whose shards hold it.
  replicated tensors (plain tensors, all-Replicate DTensors) compared across
                     ranks: their statistics are group rank 0's, and when
                     the ranks disagree a "replica_mismatch" finding names
                     the ranks outside the largest class of agreeing ranks.
The group is checked once when the Monitor is built, and again at the first
exchange after the model changes, not at every step: every rank must
monitor as many tensors, under the same names, of the same dtypes and
shapes (a DTensor's global shape and placements), with the same
replica_rtol, or every rank raises one error naming the ranks that differ
(zeroscan/distributed/agreement.py, one all-reduce of two words). The
model must change on every rank alike: a rank whose model alone changed
checks while the others merge, and those collectives do not pair.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from zeroscan import distributed as zdist
from zeroscan.distributed import Col, Difference, Merged, check_agreement, tensor_words
from zeroscan.monitor.step_record import Param, Slot, StepRecord, decode_records, slot_rows
from zeroscan.monitor.report import Finding
from zeroscan.monitor.table import RowTable
from zeroscan.ops import is_dtensor
from zeroscan.result_row import Column, NUM_FIELDS, empty_rows
from zeroscan.verdicts import Cause, Severity
from zeroscan.words import RankSet, count_noun, span

# One step's packing, built once per layout: the rows before the scans are
# copied in, which slots this rank holds, counts and calls sharded, and per
# device group where its rows go.
Copies = list[tuple[torch.Tensor, torch.Tensor | None]]  # per group: Slot rows to fill, rows to take (None: all)
Layout = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Copies]


class RankExchange:
    """A Monitor's rows across the ranks of its process group: each monitored
    step packs this rank's rows and merges them with the other ranks' (two
    rounds of all-reduces); report() turns the merged summary into global
    rows and findings about ranks."""

    def __init__(self, group: dist.ProcessGroup, params: list[Param], replica_rtol: float) -> None:
        self._setup(group, dist.get_rank(group), tuple(dist.get_process_group_ranks(group)), params, replica_rtol)
        self._check_params()

    @classmethod
    def simulated(cls, params: list[Param], world: int, replica_rtol: float = 1e-9) -> RankExchange:
        """Rank 0 of a world of `world` ranks, with no process group: pack()
        and decode() work (the scale benchmark feeds decode() summaries from
        zeroscan.distributed.allreduce.simulate); start() is refused."""
        exchange = cls.__new__(cls)
        exchange._setup(None, 0, range(world), params, replica_rtol)
        exchange._checked = True
        return exchange

    def _setup(
        self, group: dist.ProcessGroup | None, rank: int, ranks: Sequence[int], params: list[Param], rtol: float
    ) -> None:
        self.group = group
        self._rank = rank
        self._world = len(ranks)
        self._ranks = ranks  # group rank -> global rank
        self._rtol = rtol
        self._layouts: dict[tuple[Any, ...], Layout] = {}
        # Monitor(trace_nonfinite=True): (rank, device) -> int64 [2], the header's
        # last two words (nonfinite_trace.NonfiniteTrace.born_words).
        self.born: Callable[[int, int, torch.device], torch.Tensor] | None = None
        self.set_params(params)

    def set_params(self, params: list[Param]) -> None:
        """The model changed: later steps pack these parameters (checked across ranks first)."""
        self._params = params
        self._names_crc = zlib.crc32("\n".join(p.name for p in params).encode())
        self._layouts.clear()
        self._checked = False

    def _check_params(self) -> None:
        """Every rank monitors the same tensors (names, dtypes, shapes):
        checked before any merge, whose all-reduces would otherwise pair
        buffers of different sizes (an abort, or a hang) or mix up tensors."""
        described = [(p.name, _must_agree(p.tensor)) for p in self._params]
        merged = Merged("parameters", len(self._params), described, f"replica_rtol={self._rtol!r}")
        self._checked = False  # a caller that catches the error meets it again at the next step
        explain = functools.partial(_explain, len(self._params))
        check_agreement("zeroscan.Monitor", self.group, merged, explain=explain)  # type: ignore[arg-type]
        self._checked = True

    def local_parts(
        self,
        tensors: list[torch.Tensor],
        slots: list[int],
        *,
        collective: bool = True,
        partitioned: frozenset[int] = frozenset(),
    ) -> tuple[list[torch.Tensor], list[int], list[Slot], list[Slot]]:
        """What this rank scans of each tensor (a DTensor's local shard) and
        at which Slot rows, the sharded slots, and those of them whose shard
        another rank contributes. collective=False leaves out a Partial
        DTensor (reducing it is a collective) instead of reducing it.
        `partitioned`: rows whose tensor already is this rank's disjoint
        piece (a ZeRO partition, grad_source.py), sharded too."""
        local: list[torch.Tensor] = []
        kept: list[int] = []
        sharded: list[Slot] = []
        uncounted: list[Slot] = []
        for t, row in zip(tensors, slots):
            if is_dtensor(t):
                if not collective and any(p.is_partial() for p in t.placements):
                    continue
                part = zdist.local_part(t)
                t = part.tensor
                if part.mode == zdist.MODE_SHARDED:
                    sharded.append(Slot.at_row(row))
                    if not part.counted:
                        uncounted.append(Slot.at_row(row))
            elif row in partitioned:
                sharded.append(Slot.at_row(row))
            local.append(t)
            kept.append(row)
        return local, kept, sharded, uncounted

    def start(self, record: StepRecord) -> torch.Tensor:
        """Packs the rows of a step that just ended and merges them across the
        group: the summary, not read."""
        if self.group is None:
            raise RuntimeError("zeroscan.Monitor: a simulated exchange has no process group to merge over")
        return zdist.start_merge(self.pack(record), self.group, rtol=self._rtol)

    def pack(self, record: StepRecord) -> zdist.MergeInput:
        """This rank's input to the merge of `record`'s rows: a row per slot (a
        slot in several scan groups takes the last group's row; the gradients
        cleared before the step are absent), on the device the group's
        backend uses."""
        groups, sharded, uncounted = record.groups, record.sharded, record.uncounted
        device = groups[0][1].device if groups else torch.device("cpu")
        if self.group is not None:
            device = zdist.comm_device(self.group, device)
        if not self._checked and self.group is not None:
            self._check_params()
        absent = [Slot.grad(i) for i in record.cleared]
        key = (device, tuple(tuple(s) for s, _ in groups), tuple(sharded), tuple(uncounted), tuple(absent))
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= 8:
                self._layouts.clear()
            layout = self._layouts[key] = self._layout(device, groups, sharded, uncounted, absent)
        template, present, counted, is_sharded, header, copies = layout
        packed = template.clone()
        for (dest, src), (_, buffer) in zip(copies, groups):
            rows = buffer.to(device)
            packed.index_copy_(0, dest, rows if src is None else rows.index_select(0, src))
        step = torch.full((1,), record.step, dtype=torch.int64, device=device)  # a fill: nothing copied from the host
        born = header[4:] if self.born is None else self.born(self._rank, self._world, device)
        head = torch.cat([step, header[1:4], born])
        rank = torch.full((1,), self._rank, dtype=torch.int64, device=device)
        return zdist.MergeInput(packed, present, counted, is_sharded, rank, head)

    def _layout(
        self,
        device: torch.device,
        groups: list[tuple[list[int], torch.Tensor]],
        sharded: list[Slot],
        uncounted: list[Slot],
        absent: list[Slot],
    ) -> Layout:
        """A step's packing before its rows are copied in: empty rows, which
        slots this rank holds, counts (sharded slots: unless another rank
        contributes the shard; replicated ones: on group rank 0 only) and
        calls sharded, the header (step, P, a checksum of the names, a
        checksum of the sharded slots, and the least and greatest rank whose
        traced passes made a non-finite value: none, W and -1, unless
        `born` says) and, per device group, where its rows go. Built once per layout, so a
        step copies nothing from the host."""
        n = slot_rows(len(self._params))
        gone = {s.row for s in absent}
        present = torch.zeros(n, dtype=torch.bool)
        present[[row for slots, _ in groups for row in slots if row not in gone]] = True
        is_sharded = torch.zeros(n, dtype=torch.bool)
        is_sharded[[s.row for s in sharded]] = True
        counted = is_sharded.clone() if self._rank != 0 else torch.ones(n, dtype=torch.bool)
        counted[[s.row for s in uncounted]] = False
        header = torch.tensor(
            [0, len(self._params), self._names_crc, _layout_crc(sharded), self._world, -1], dtype=torch.int64
        )
        copies = []
        for slots, _ in groups:
            keep = [k for k, row in enumerate(slots) if row not in gone]  # a gradient cleared before the step
            dest = torch.tensor([slots[k] for k in keep], dtype=torch.int64, device=device)
            src = None if len(keep) == len(slots) else torch.tensor(keep, dtype=torch.int64, device=device)
            copies.append((dest, src))
        return (empty_rows(n, device), present.to(device), counted.to(device), is_sharded.to(device),
                header.to(device), copies)

    def decode(self, records: list[StepRecord]) -> None:
        """Reads back the summaries of the records not decoded yet and gives
        them global rows (see the module doc); activations stay this rank's own."""
        todo = [r for r in records if r.rows is None]
        if not todo:
            return
        for r in todo:
            if r.exchange is None:
                raise RuntimeError(f"zeroscan.Monitor.report: monitored step {r.step} has no merge to read")
        hosts = _to_host([r.exchange for r in todo])  # type: ignore[misc]
        results = [self._global_rows(r, host.numpy()) for r, host in zip(todo, hosts)]
        decode_records(todo, own_rows=False)  # this rank's activations
        for r, (rows, rank_findings, shard_ranks) in zip(todo, results):
            r.rows = rows
            r.rank_findings = rank_findings
            r.shard_ranks = shard_ranks
            r.exchange = None  # the global rows are all that later reports need

    def _global_rows(
        self, rec: StepRecord, host: np.ndarray
    ) -> tuple[RowTable, dict[Slot, Finding], dict[Slot, RankSet]]:
        """The global rows of one step from its summary (Col), the
        findings about ranks that disagree, and the ranks whose shards hold
        non-finite values."""
        n = slot_rows(len(self._params))
        world = self._world
        body = host[: n * zdist.SUMMARY_WIDTH].reshape(n, zdist.SUMMARY_WIDTH)
        low, high = zdist.header_range(torch.from_numpy(host))
        want = [rec.step, len(self._params), self._names_crc, _layout_crc(rec.sharded)]
        if low[:3] != want[:3] or high[:3] != want[:3]:
            steps = f"step {low[0]}" if low[0] == high[0] else f"steps {low[0]} to {high[0]}"
            raise RuntimeError(
                f"zeroscan.Monitor.report: the ranks recorded monitored {steps} where this rank recorded step "
                f"{rec.step}: every rank of the process group must monitor the same model with the same "
                "`every` and step it as often"
            )
        if low[3] != want[3] or high[3] != want[3]:
            here = [self._slot_name(s) for s in rec.sharded[:3]] or ["none"]
            raise RuntimeError(
                "zeroscan.Monitor.report: the ranks disagree on which tensors are sharded DTensors (here: "
                f"{', '.join(here)}{', ...' if len(rec.sharded) > 3 else ''}); every rank must wrap the model "
                "the same way"
            )
        rec.born_ranks = (self._ranks[low[4]], self._ranks[high[5]]) if high[5] >= 0 else None
        is_sharded = np.zeros(n, dtype=bool)
        is_sharded[[s.row for s in rec.sharded if 0 <= s.row < n]] = True
        words = np.zeros((n, NUM_FIELDS), dtype=np.int64)
        words[:, : Column.M2 + 1] = body[:, : Column.M2 + 1]
        held = body[:, Col.PRESENT]
        # A replica's row is group rank 0's (rank 0 holds it unless it is the first absent).
        present = np.where(is_sharded, held > 0, body[:, Col.FIRST_ABSENT] != 0)
        rank_findings: dict[Slot, Finding] = {}
        shard_ranks: dict[Slot, RankSet] = {}
        for c in np.flatnonzero(~is_sharded & (body[:, Col.REFERENCE] != world)).tolist():
            rank_findings[Slot.at_row(c)] = self._mismatch_finding(Slot.at_row(c), body[c])
        for c in np.flatnonzero(is_sharded & (held > 0) & (held < world)).tolist():
            slot = Slot.at_row(c)
            p = self._params[slot.param]
            lacking = self._set(world - int(held[c]), body[c, Col.FIRST_ABSENT], body[c, Col.LAST_ABSENT])
            what = "a gradient" if slot.kind == "grad" else "a scan of its shard"
            rank_findings[slot] = Finding(p.name, slot.kind, Severity.ERROR, Cause.MISSING_ON_RANKS, (
                f"{p.name} is sharded across the process group, but {lacking.words()} hold no {what} "
                "(None there, or not scannable): its statistics merge the other ranks' shards only"
            ), lacking.named)
        for c in np.flatnonzero(is_sharded & (body[:, Col.NONFINITE_RANKS] > 0)).tolist():
            shard_ranks[Slot.at_row(c)] = self._set(
                body[c, Col.NONFINITE_RANKS], body[c, Col.FIRST_NONFINITE], body[c, Col.LAST_NONFINITE]
            )
        return RowTable.dense(words, present), rank_findings, shard_ranks

    def _set(self, count: Any, first: Any, last: Any) -> RankSet:
        """A RankSet of group ranks, named by their global ranks."""
        count, first, last = int(count), int(first), int(last)
        if count <= 0:
            return RankSet(0, -1, -1)
        return RankSet(count, self._ranks[first], self._ranks[last])

    def _mismatch_finding(self, slot: Slot, row: np.ndarray) -> Finding:
        """A "replica_mismatch" finding from a slot's summary row (Col)."""
        p = self._params[slot.param]
        grad = slot.kind == "grad"
        world = self._world
        reference = abs(int(row[Col.REFERENCE]))
        others = self._set(world - reference, row[Col.FIRST_OTHER], row[Col.LAST_OTHER])
        absent = self._set(world - int(row[Col.PRESENT]), row[Col.FIRST_ABSENT], row[Col.LAST_ABSENT])
        nonfinite = self._set(row[Col.NONFINITE_RANKS], row[Col.FIRST_NONFINITE], row[Col.LAST_NONFINITE])
        details = []
        if absent.count:
            has = "has" if absent.count == 1 else "have"
            details.append(f"{absent.words()} {has} no {'gradient' if grad else 'scan of it'}")
        if nonfinite.count:
            details.append(f"{nonfinite.words()} hold{'s' if nonfinite.count == 1 else ''} NaN or infinite values")
        low, high = row[[Col.MEAN_LO, Col.MEAN_HI]].view(np.float64).tolist()
        if low != high and np.isfinite([low, high]).all():
            details.append(f"the mean is {short(low)} on some ranks and {short(high)} on others")
        tie = (" (no majority: no value is held by more than half of the ranks for certain, so either side may "
               "be the wrong one)") if row[Col.REFERENCE] < 0 else ""
        if grad:
            what = f"the gradient of {p.name}"
            hint = (
                "data-parallel replicas hold the same gradient after DDP's all-reduce, so it changed on those "
                "ranks afterwards (a hook, per-rank clipping or unscaling, a write to .grad) or was never "
                "all-reduced there (no_sync, a parameter outside DDP)"
            )
        else:
            what = p.name
            hint = (
                "the replicas have diverged: different initial weights (no broadcast from rank 0), different "
                "updates (optimizer state, learning rate or a step skipped on some ranks) or a write to the "
                "weights outside the optimizer"
            )
        who = others.words() if others.count else "some ranks"
        verb = "disagrees" if others.count == 1 else "disagree"
        return Finding(p.name, "grad" if grad else "weight", Severity.ERROR, Cause.REPLICA_MISMATCH, (
            f"{what} differs across data-parallel ranks: {who} {verb} with the other "
            f"{count_noun(reference, 'rank')}{tie}"
            f"{': ' + '; '.join(details) if details else ''}; {hint}. Its statistics in this report are those of "
            f"rank {self._ranks[0]}"
        ), others.named)

    def _slot_name(self, slot: Slot) -> str:
        return f"{self._params[slot.param].name}:{slot.kind}"


def decode(records: list[StepRecord], ranks: RankExchange | None) -> None:
    """Reads the records back: this rank's rows (`ranks` None), or the global rows across ranks."""
    if ranks is None:
        decode_records(records)
    else:
        ranks.decode(records)


def check_group(op: str, group: Any, params: list[Param]) -> dist.ProcessGroup | None:
    """The Monitor's process group, checked (None stays None)."""
    if group is None:
        return None
    if not dist.is_available():
        raise RuntimeError(f"{op}: process_group was given but this torch has no torch.distributed")
    if group is getattr(dist.GroupMember, "NON_GROUP_MEMBER", object()):  # what new_group gives a non-member
        raise ValueError(f"{op}: this rank (global rank {dist.get_rank()}) is not a member of process_group")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{op}: process_group must be a torch.distributed.ProcessGroup (dist.group.WORLD for every rank) "
            f"or None, got {type(group).__name__}"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            f"{op}: process_group was given but torch.distributed is not initialized; "
            "call torch.distributed.init_process_group() first"
        )
    if dist.get_rank(group) < 0:
        raise ValueError(f"{op}: this rank (global rank {dist.get_rank()}) is not a member of process_group")
    ranks = sorted(dist.get_process_group_ranks(group))
    meshes: dict[tuple[int, ...], str] = {}  # a mesh's ranks -> its first parameter
    for p in params:
        if is_dtensor(p.tensor):
            mesh_ranks = tuple(sorted(p.tensor.device_mesh.mesh.flatten().tolist()))  # type: ignore[attr-defined]
            meshes.setdefault(mesh_ranks, p.name)
    if len(meshes) > 1:
        where = "; ".join(f"{name} on {span(mesh)}" for mesh, name in list(meshes.items())[:3])
        raise ValueError(
            f"{op}: the DTensor parameters live on {len(meshes)} device meshes ({where}); a Monitor merges "
            "over one group: monitor each mesh's parameters with a Monitor of their own, "
            "Monitor(submodule, process_group=<that mesh's group>), or pass process_group=None"
        )
    for mesh_ranks, name in meshes.items():
        if list(mesh_ranks) != ranks:
            raise ValueError(
                f"{op}: parameter {name} is a DTensor on a device mesh of {span(mesh_ranks)}, but "
                f"process_group holds {span(ranks)}; pass a group over exactly the mesh's ranks"
            )
    return group


def _must_agree(t: torch.Tensor) -> str:
    """What every rank must hold alike of a monitored tensor: its dtype and
    (global) shape, and a DTensor's placements."""
    return tensor_words(t.dtype, t.shape, t.placements if is_dtensor(t) else None)  # type: ignore[attr-defined]


def _explain(count: int, d: Difference) -> str | None:
    """The Monitor's words for ranks that monitor different models (`count`
    parameters each, where the items differ)."""
    op = "zeroscan.Monitor"
    advice = "every rank of process_group must monitor the same model"
    if d.kind == "count":
        (low, low_ranks), (high, high_ranks) = min(d.values), max(d.values)  # type: ignore[type-var]
        return (
            f"{op}: rank {low_ranks[0]} monitors {low} parameters and rank {high_ranks[0]} {high}: {advice} "
            "(pipeline stages: one Monitor per stage, over that stage's data-parallel group)"
        )
    if d.kind != "item" or len(d.values) < 2:
        return None
    (a, a_ranks), (b, b_ranks) = d.values[:2]
    (a_name, a_what), (b_name, b_what) = a, b  # type: ignore[misc]
    if a_name != b_name:
        return (
            f"{op}: ranks {a_ranks[0]} and {b_ranks[0]} monitor {count} parameters under different names "
            f"({a_name} and {b_name} at position {d.index}): {advice}, wrapped the same way"
        )
    return f"{op}: parameter {a_name} is {a_what} on {span(a_ranks)} and {b_what} on {span(b_ranks)}: {advice}"


def _layout_crc(sharded: list[Slot]) -> int:
    """A checksum of which slots a step scanned through a shard: the ranks must agree."""
    return zlib.crc32(",".join(str(s.row) for s in sorted(set(sharded))).encode())


def _to_host(vectors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies the vectors to the host, one copy per device."""
    out: list[torch.Tensor | None] = [None] * len(vectors)
    by_device: dict[torch.device, list[int]] = {}
    for k, v in enumerate(vectors):
        by_device.setdefault(v.device, []).append(k)
    for indices in by_device.values():
        host = torch.cat([vectors[k] for k in indices]).cpu()
        start = 0
        for k in indices:
            out[k] = host[start : start + vectors[k].numel()]
            start += vectors[k].numel()
    return out  # type: ignore[return-value]


def short(v: float | int) -> str:
    return str(v) if isinstance(v, int) else f"{v:.6g}"


def default_group(group: Any, params: list[Param]) -> tuple[Any, Finding | None]:
    """process_group as given, or, where none was given and the parameters
    are DTensors, the group their device mesh runs on: a 1-D mesh's own
    group, or WORLD for a mesh over every rank. Where there is no one such
    group (plain parameters beside DTensors, several meshes, a mesh over some
    ranks only), None and a WARNING that says which argument to pass: a
    DTensor is scanned only through a process group, never silently left out."""
    if group is not None or not (dist.is_available() and dist.is_initialized()):
        return group, None
    dtensors = [p for p in params if is_dtensor(p.tensor)]
    if not dtensors:
        return None, None
    meshes = {id(p.tensor.device_mesh): p.tensor.device_mesh for p in dtensors}  # type: ignore[attr-defined]
    if len(meshes) == 1 and len(dtensors) == len(params):
        mesh = next(iter(meshes.values()))
        ranks = sorted(mesh.mesh.flatten().tolist())
        if mesh.ndim == 1:
            return mesh.get_group(), None
        if ranks == list(range(dist.get_world_size())):
            return dist.group.WORLD, None
    why = (f"{len(dtensors)} of {count_noun(len(params), 'parameter')} are DTensors"
           f"{f' on {len(meshes)} device meshes' if len(meshes) > 1 else ''}, and no process_group was given")
    return None, Finding("(model)", "param", Severity.WARNING, Cause.NOT_SCANNED, (
        f"{why}: a DTensor is scanned only across the ranks of its mesh, so none of them is scanned; pass "
        "process_group=<the mesh's group> (mesh.get_group(), or dist.group.WORLD for a mesh over every rank), "
        "or monitor each mesh's submodule with a Monitor of its own"
    ))
