"""The Monitor across ranks (`process_group=`): one all_gather per step.

Each monitored step scans as on one rank, a DTensor parameter or gradient
(FSDP2, tensor parallel) through its local shard (a Partial placement is
reduced first, a collective of its own) and a plain tensor as one
data-parallel replica (DDP), then packs the rows into one int64 [2P + 1, 16]
buffer (a row per Slot, and a header row: step, P, a checksum of the names)
and issues ONE asynchronous all_gather of it on the group. The pending
gather stays in the step's record; nothing is waited for until report(),
which then judges global rows:
  sharded tensors    the ranks' rows merged exactly (zeroscan.distributed):
                     the statistics of the full tensor; a non-finite value is
                     reported with the ranks whose shards hold it.
  replicated tensors (plain tensors, all-Replicate DTensors) compared across
                     ranks: their common value when the ranks agree (rank 0's
                     bits), else a "replica_mismatch" finding naming the
                     ranks that differ and the majority's value.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from zeroscan import distributed as zdist
from zeroscan.monitor.records import (
    Param, Slot, StepRecord, decode_records, nonfinite_words, slot_rows,
)
from zeroscan.monitor.table import RowTable
from zeroscan.monitor.report import Finding
from zeroscan.ops import is_dtensor
from zeroscan.record import NONFINITE, NUM_FIELDS, Column, decode, empty_rows
from zeroscan.verdicts import Cause, Severity

# Two spare columns of a result row (zero from the scan) mark the packed rows;
# the merge and the comparison read only the record's own columns.
SHARDED_COL = Column.SPARE_1  # 1: a sharded DTensor's row (merged across ranks, not compared)
PRESENT_COL = Column.SPARE_2  # 1: this rank scanned the tensor (0: no gradient, or not scannable)
# Fields a replica_mismatch message shows, at most three that differ.
SHOWN_FIELDS = ("numel", "nan", "posinf", "neginf", "zeros", "max_abs", "min_abs", "mean", "std")
# The per-slot flags of a step's host summary (see _summarize).
IS_SHARDED, ALL_PRESENT, ANY_PRESENT, AGREE, NONFINITE_FLAG, SAME_KIND = range(6)
NUM_FLAGS = 6


class RankExchange:
    """A Monitor's rows across the ranks of its process group: each monitored
    step packs this rank's rows and starts one all_gather; report() turns the
    gathered rows into global rows and findings about ranks."""

    def __init__(self, group: dist.ProcessGroup, params: list[Param], replica_rtol: float) -> None:
        self.group = group
        self._params = params
        self._rtol = replica_rtol
        self._names_crc = zlib.crc32("\n".join(p.name for p in params).encode())
        self._layouts: dict[tuple[Any, ...], tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor | None]]]] = {}

    def set_params(self, params: list[Param]) -> None:
        """The model changed: later steps pack these parameters."""
        self._params = params
        self._names_crc = zlib.crc32("\n".join(p.name for p in params).encode())
        self._layouts.clear()

    def local_parts(
        self, tensors: list[torch.Tensor], slots: list[int]
    ) -> tuple[list[torch.Tensor], list[Slot], list[Slot]]:
        """What this rank scans of each tensor (at Slot rows `slots`; a
        DTensor's local shard), the sharded slots, and those of them whose
        shard another rank contributes."""
        local = list(tensors)
        sharded: list[Slot] = []
        uncounted: list[Slot] = []
        for k, (t, row) in enumerate(zip(tensors, slots)):
            if is_dtensor(t):
                slot = Slot.at_row(row)
                part = zdist.local_part(t)
                local[k] = part.tensor
                if part.mode == zdist.MODE_SHARDED:
                    sharded.append(slot)
                    if not part.counted:
                        uncounted.append(slot)
        return local, sharded, uncounted

    def start(
        self,
        step: int,
        groups: list[tuple[list[int], torch.Tensor]],
        sharded: list[Slot],
        uncounted: list[Slot],
        cleared: list[int],
    ) -> zdist.PendingMerge[zdist.GatheredRows]:
        """Packs this step's rows into one int64 [2P + 1, 16] buffer (a row per
        slot, and a header row: step, P, a checksum of the names) and starts
        the step's one all_gather of it. A slot in several groups takes the
        last group's row; the gradients of `cleared` (parameters) are absent."""
        device = zdist.comm_device(self.group, groups[0][1].device if groups else torch.device("cpu"))
        absent = [Slot.grad(i) for i in cleared]
        key = (device, tuple(tuple(s) for s, _ in groups), tuple(sharded), tuple(uncounted), tuple(absent))
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= 8:
                self._layouts.clear()
            layout = self._layouts[key] = self._layout(device, groups, sharded, uncounted, absent)
        template, copies = layout
        packed = template.clone()
        for (dest, src), (_, buffer) in zip(copies, groups):
            rows = buffer.to(device)
            packed.index_copy_(0, dest, rows if src is None else rows.index_select(0, src))
        packed[:, SHARDED_COL:].copy_(template[:, SHARDED_COL:])  # the marks the copies overwrote
        packed[slot_rows(len(self._params)), 0] = step
        return zdist.gather_rows(packed, self.group, async_op=True)  # type: ignore[return-value]

    def _layout(
        self,
        device: torch.device,
        groups: list[tuple[list[int], torch.Tensor]],
        sharded: list[Slot],
        uncounted: list[Slot],
        absent: list[Slot],
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor | None]]]:
        """The packed buffer of a step before its rows are copied in (empty rows,
        the presence and sharded marks, the header) and, per device group, where
        its rows go. Built once per layout, so a step copies nothing from the host."""
        n = slot_rows(len(self._params))
        template = empty_rows(n + 1)
        gone = {s.row for s in absent}
        present = [row for slots, _ in groups for row in slots if row not in gone]
        template[present, PRESENT_COL] = 1
        template[[s.row for s in sharded], SHARDED_COL] = 1
        template[n, 1] = len(self._params)
        template[n, 2] = self._names_crc
        skip = {s.row for s in uncounted} | gone  # a replica of a shard that another rank contributes
        copies = []
        for slots, _ in groups:
            keep = [k for k, row in enumerate(slots) if row not in skip]
            dest = torch.tensor([slots[k] for k in keep], dtype=torch.int64, device=device)
            src = None if len(keep) == len(slots) else torch.tensor(keep, dtype=torch.int64, device=device)
            copies.append((dest, src))
        return template.to(device), copies

    def decode(self, records: list[StepRecord]) -> None:
        """Waits for the gathers of the records not decoded yet and gives them
        global rows (see the module doc); activations stay this rank's own."""
        todo = [r for r in records if r.rows is None]
        if not todo:
            return
        n = slot_rows(len(self._params))
        gathered = []
        for r in todo:
            if r.gather is None:
                raise RuntimeError(f"zeroscan.Monitor.report: monitored step {r.step} has no gather to read")
            gathered.append(r.gather.wait())
        hosts = _to_host([_summarize(g.rows, n, self._rtol) for g in gathered])
        results = [self._global_rows(r, g, host) for r, g, host in zip(todo, gathered, hosts)]
        decode_records(todo, own_rows=False)  # this rank's activations
        for r, (rows, rank_findings, shard_ranks) in zip(todo, results):
            r.rows = rows
            r.rank_findings = rank_findings
            r.shard_ranks = shard_ranks
            r.gather = None  # the global rows are all that later reports need

    def _global_rows(
        self, rec: StepRecord, gathered: zdist.GatheredRows, host: torch.Tensor
    ) -> tuple[RowTable, dict[Slot, Finding], dict[Slot, tuple[int, ...]]]:
        """The global rows of one step from its host summary (see _summarize),
        the findings about ranks that disagree, and the ranks whose shards hold
        non-finite values."""
        n = slot_rows(len(self._params))
        ranks = gathered.ranks
        glob = host[: NUM_FIELDS * n].view(n, NUM_FIELDS)
        flags = host[NUM_FIELDS * n : (NUM_FIELDS + NUM_FLAGS) * n].view(n, NUM_FLAGS).tolist()
        header = host[(NUM_FIELDS + NUM_FLAGS) * n :].view(len(ranks), 3).tolist()
        want = [rec.step, len(self._params), self._names_crc]
        for rank, head in zip(ranks, header):
            if head != want:
                raise RuntimeError(
                    f"zeroscan.Monitor.report: rank {rank} recorded monitored step {head[0]} over {head[1]} "
                    f"parameters where this rank recorded step {rec.step} over {len(self._params)}"
                    f"{' with other parameter names' if head[:2] == want[:2] else ''}: every rank of the "
                    "process group must monitor the same model with the same `every` and step it as often"
                )
        if not all(f[SAME_KIND] for f in flags):
            bad = [self._slot_name(Slot.at_row(c)) for c, f in enumerate(flags) if not f[SAME_KIND]]
            raise RuntimeError(
                f"zeroscan.Monitor.report: {', '.join(bad[:4])} is a sharded DTensor on some ranks and a "
                "plain tensor on others; every rank must wrap the model the same way"
            )
        words = glob.numpy()
        present = np.array([
            bool(f[ANY_PRESENT] if f[IS_SHARDED] else words[c, PRESENT_COL]) for c, f in enumerate(flags)
        ], dtype=bool)
        differ = [c for c, f in enumerate(flags) if not f[IS_SHARDED] and not f[AGREE]]
        missing = [c for c, f in enumerate(flags) if f[IS_SHARDED] and f[ALL_PRESENT] != f[ANY_PRESENT]]
        poisoned = [c for c, f in enumerate(flags) if f[IS_SHARDED] and f[NONFINITE_FLAG]]
        rank_findings: dict[Slot, Finding] = {}
        shard_ranks: dict[Slot, tuple[int, ...]] = {}
        picked = sorted(set(differ + missing + poisoned))
        if not picked:
            return RowTable.dense(words, present), rank_findings, shard_ranks
        per_rank = gathered.rows[:, picked].cpu()  # [W, k, 16]: only the tensors in question
        column = {c: k for k, c in enumerate(picked)}
        if differ:
            replicas = gathered.replica_report(rtol=self._rtol, indices=differ)
            for m in replicas.mismatches:
                block = per_rank[:, column[m.index]]
                reference = block[ranks.index(m.reference_ranks[0])]
                slot = Slot.at_row(m.index)
                words[m.index] = reference.numpy()  # a row of the host copy: written in place
                present[m.index] = bool(int(reference[PRESENT_COL]))
                rank_findings[slot] = self._mismatch_finding(m, block, ranks)
        for c in missing:
            lacking = tuple(r for k, r in enumerate(ranks) if not int(per_rank[k, column[c], PRESENT_COL]))
            slot = Slot.at_row(c)
            p = self._params[slot.param]
            what = "a gradient" if slot.kind == "grad" else "a scan of its shard"
            rank_findings[slot] = Finding(p.name, slot.kind, Severity.ERROR, Cause.MISSING_ON_RANKS, (
                f"{p.name} is sharded across the process group, but rank(s) {list(lacking)} hold no {what} "
                "(None there, or not scannable): its statistics merge the other ranks' shards only"
            ), lacking)
        for c in poisoned:
            block = decode(per_rank[:, column[c]])
            shard_ranks[Slot.at_row(c)] = tuple(r for r, f in zip(ranks, block) if f["nan"] + f["posinf"] + f["neginf"])
        return RowTable.dense(words, present), rank_findings, shard_ranks

    def _mismatch_finding(self, m: zdist.ReplicaMismatch, block: torch.Tensor, ranks: tuple[int, ...]) -> Finding:
        """A "replica_mismatch" finding; block: int64 [W, 16], every rank's row."""
        slot = Slot.at_row(m.index)
        p = self._params[slot.param]
        grad = slot.kind == "grad"
        per_rank = decode(block)
        details = []
        for k, rank in enumerate(ranks):
            if rank not in m.ranks:
                continue
            if not int(block[k, PRESENT_COL]):
                details.append(f"rank {rank} has no {'gradient' if grad else 'scan of it'}")
            elif per_rank[k]["nan"] + per_rank[k]["posinf"] + per_rank[k]["neginf"]:
                details.append(f"rank {rank} holds {nonfinite_words(per_rank[k])}")
        absent = any(not int(block[k, PRESENT_COL]) for k, rank in enumerate(ranks) if rank in m.ranks)
        shown = [] if absent else [(f, m.fields[f]) for f in SHOWN_FIELDS if f in m.fields][:3]
        details.append("; ".join(
            f"{field} " + ", ".join(f"{short(v)} on rank {r}" for r, v in zip(ranks, values))
            for field, values in shown
        ))
        tie = " (no majority: as many ranks on each side, so either side may be the wrong one)" if m.ambiguous else ""
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
        return Finding(p.name, "grad" if grad else "weight", Severity.ERROR, Cause.REPLICA_MISMATCH, (
            f"{what} differs across data-parallel ranks: rank(s) {list(m.ranks)} disagree with rank(s) "
            f"{list(m.reference_ranks)}{tie}: {'; '.join(d for d in details if d)}; {hint}. "
            f"Its statistics in this report are those of rank(s) {list(m.reference_ranks)}"
        ), tuple(m.ranks))

    def _slot_name(self, slot: Slot) -> str:
        return f"{self._params[slot.param].name}:{slot.kind}"


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
    for p in params:
        if is_dtensor(p.tensor):
            mesh_ranks = sorted(p.tensor.device_mesh.mesh.flatten().tolist())  # type: ignore[attr-defined]
            if mesh_ranks != ranks:
                raise ValueError(
                    f"{op}: parameter {p.name} is a DTensor on a device mesh of ranks {mesh_ranks}, but "
                    f"process_group holds ranks {ranks}; pass a group over exactly the mesh's ranks"
                )
    return group


def _summarize(gathered: torch.Tensor, n: int, rtol: float) -> torch.Tensor:
    """What the host needs of one step's gathered rows int64 [W, n + 1, 16],
    computed where they are, as one int64 vector: the global rows [n, 16]
    (sharded slots merged, the others rank 0's), the per-slot flags [n, 6]
    (indexed by IS_SHARDED ...) and every rank's header [W, 3]."""
    body = gathered[:, :n]
    kinds = body[..., SHARDED_COL]
    sharded = kinds[0] == 1
    present = body[..., PRESENT_COL] > 0
    merged = zdist.combine_rows(body) if n else body[0]
    rows = torch.where(sharded.unsqueeze(1), merged, body[0])
    flags = torch.stack(
        [
            sharded,
            present.all(0),
            present.any(0),
            zdist.rows_agree(body, body[:1], rtol).all(0),
            (body[..., NONFINITE].sum(-1) > 0).any(0),
            (kinds == kinds[:1]).all(0),
        ],
        dim=1,
    ).to(torch.int64)
    return torch.cat([rows.reshape(-1), flags.reshape(-1), gathered[:, n, :3].reshape(-1)])


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
