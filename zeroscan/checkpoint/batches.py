"""Scanning a checkpoint's tensors a batch at a time, one native call per
batch, with the next batch's pages read ahead (zeroscan.checkpoint.files says
how a mapped tensor is read safely).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from zeroscan import ops
from zeroscan.checkpoint.files import (
    FileSource,
    FileTensor,
    MappedSource,
    TensorFile,
    TensorPiece,
    contiguous_file_tensor,
)
from zeroscan.histogram import Histogram
from zeroscan.ops import scannable_form
from zeroscan.stats import Readout, Stats, TensorMeta, stats_many, stats_many_mapped

MAX_BATCH_TENSORS = 1024  # tensors per native call

# --- scanning --------------------------------------------------------------------

# Elements per batch at most (with at most `batch_bytes` and
# MAX_BATCH_TENSORS tensors): enough for the native call to spread over
# every thread and to make its fixed cost small, few enough that two
# batches' pages are a small part of memory.
MAX_BATCH_ELEMENTS = 1 << 24
NATIVE_CHUNK = 1 << 16  # the native scan's smallest chunk (kMinChunk in csrc/cpu/stats_cpu.cpp)

ResultFn = Callable[[str, Stats], None]  # (the name a tensor was added with, its Stats)
StepFn = Callable[[int], None]  # the weight of the tensors a batch finished, called after each


class Piece(NamedTuple):
    """Piece `index` of `count` of a tensor scanned in pieces, and what its merged Stats describe."""

    index: int
    count: int
    dtype: torch.dtype
    shape: torch.Size


class Batch:
    """Tensors scanned by one native call: views of one file's mapping (with
    where each lies in the file, to name it if the file shrinks) and tensors
    already in memory."""

    def __init__(self) -> None:
        self.file: TensorFile | None = None
        # name, the tensor as scanned, its place in the file (None: in memory), its Piece if one
        self.items: list[tuple[str, torch.Tensor, FileTensor | None, Piece | None]] = []
        self.elements = 0
        self.nbytes = 0
        self.weight = 0  # for on_step
        self.low = -1  # the file bytes its mapped views span
        self.high = -1


class BatchScanner:
    """Scans tensors a batch at a time with one native call per batch (at
    most `batch_bytes`, MAX_BATCH_ELEMENTS and MAX_BATCH_TENSORS): tensors of
    files are views of the file's mapping, tensors in memory are scanned as
    they are. Each tensor's Stats goes to `on_result` in the order the
    tensors were added, and after each batch `on_step` gets the weight of
    the tensors (or pieces) it finished.

    A batch is scanned when the next one is complete, after asking the kernel
    to read that next batch's pages ahead: on a cold page cache the disk
    reads one batch while the threads scan the other.

    With `histogram` each Stats also has its tensor's histogram, counted in
    the same native call (a tensor in pieces: the sum of its pieces')."""

    def __init__(self, batch_bytes: int, tol: float | None, on_result: ResultFn, on_step: StepFn, *,
                 histogram: bool = False) -> None:
        self.capacity = max(64, batch_bytes)
        self.tol = tol
        self.histogram = histogram
        self.on_result = on_result
        self.on_step = on_step
        self.batch = Batch()
        self._pending: Batch | None = None
        self._piece_rows: list[torch.Tensor] = []
        self._piece_histograms: list[Histogram] = []

    def add(self, name: str, source: FileSource | MappedSource | torch.Tensor | TensorPiece, weight: int) -> None:
        """A tensor to scan, as a checkpoint's scan_items() gives it (ScanSource, less the skip reasons)."""
        if isinstance(source, FileSource):
            self.add_file_tensor(name, source.file, source.where, weight)
        elif isinstance(source, MappedSource):
            self._append(name, scan_form(source.tensor), None, None, weight, source.file)
        elif isinstance(source, TensorPiece):
            self.add_piece(name, source, weight)
        else:
            self._append(name, scan_form(source), None, None, weight)

    def add_piece(self, name: str, piece: TensorPiece, weight: int) -> None:
        """One piece of a tensor in memory; its Stats are merged with the
        other pieces' once the last is scanned."""
        t = scan_form(piece.tensor.reshape(-1))
        shape = piece.shape if t.dtype == piece.tensor.dtype else (*piece.shape, 2)  # complex: (re, im) pairs
        self._append(name, t, None, Piece(piece.index, piece.count, t.dtype, torch.Size(shape)), weight)

    def add_file_tensor(self, name: str, file: TensorFile, where: FileTensor, weight: int) -> None:
        """A tensor of `file`, scanned where the file's mapping holds it."""
        if where.nbytes == 0:
            self._append(name, scan_form(torch.empty(where.shape, dtype=where.dtype)), None, None, weight)
            return
        if where.offset % where.dtype.itemsize:
            self._add_misaligned(name, file, where, weight)
            return
        if where.nbytes > self.capacity and where.is_contiguous:
            self._add_pieces(name, file, where, weight)
            return
        self._append(name, scan_form(file.view(where)), where, None, weight, file)

    def _add_pieces(self, name: str, file: TensorFile, where: FileTensor, weight: int) -> None:
        """A contiguous tensor larger than a batch, in flat pieces of the
        dtype that is scanned, each a batch of its own. Pieces of whole
        native chunks, a power of two of them, merge as the chunks of one
        call on the whole tensor would (bit for bit up to 2^26 elements)."""
        flat = scan_form(file.view(where)).reshape(-1)
        itemsize = flat.element_size()
        per_piece = max(1, min(self.capacity, MAX_BATCH_ELEMENTS * itemsize) // itemsize)
        if per_piece >= NATIVE_CHUNK:
            per_piece = NATIVE_CHUNK << (per_piece // NATIVE_CHUNK).bit_length() - 1
        count = -(-flat.numel() // per_piece)
        shape = torch.Size(where.shape if flat.dtype == where.dtype else (*where.shape, 2))
        total = flat.numel()
        for index, begin in enumerate(range(0, total, per_piece)):
            end = min(begin + per_piece, total)
            part = FileTensor(where.offset + begin * itemsize, flat.dtype, (end - begin,), (1,), (end - begin) * itemsize)
            share = weight * end // total - weight * begin // total
            self._append(name, flat[begin:end], part, Piece(index, count, flat.dtype, shape), share, file)

    def _add_misaligned(self, name: str, file: TensorFile, where: FileTensor, weight: int) -> None:
        """A tensor whose offset is not a multiple of its element size (a
        hand-made file) cannot be viewed in the mapping: it is read with read
        calls, a piece at a time when it is larger than a batch."""
        if where.nbytes <= self.capacity or not where.is_contiguous:
            self._append(name, scan_form(file.read_tensor(name, where)), None, None, weight)
            return
        itemsize = where.dtype.itemsize
        per_piece = max(1, self.capacity // itemsize)
        total = math.prod(where.shape)
        count = -(-total // per_piece)
        for index, begin in enumerate(range(0, total, per_piece)):
            end = min(begin + per_piece, total)
            part = contiguous_file_tensor(where.offset + begin * itemsize, where.dtype, (end - begin,))
            piece = TensorPiece(file.read_tensor(name, part), index, count, where.shape)
            self.add_piece(name, piece, weight * end // total - weight * begin // total)

    def _append(
        self,
        name: str,
        t: torch.Tensor,
        where: FileTensor | None,
        piece: Piece | None,
        weight: int,
        file: TensorFile | None = None,
    ) -> None:
        b = self.batch
        nbytes = t.numel() * t.element_size()
        if b.items and (
            (file is not None and b.file is not None and file is not b.file)
            or b.elements + t.numel() > MAX_BATCH_ELEMENTS
            or b.nbytes + nbytes > self.capacity
            or len(b.items) >= MAX_BATCH_TENSORS
        ):
            self._submit()
            b = self.batch
        b.items.append((name, t, where, piece))
        b.elements += t.numel()
        b.nbytes += nbytes
        b.weight += weight
        if file is not None:
            b.file = file  # read in its mapping: the batch is scanned by stats_many_mapped
        if where is not None and file is not None:
            b.low = where.offset if b.low < 0 else min(b.low, where.offset)
            b.high = max(b.high, where.end)
        if piece is not None and piece.count > 1:
            self._submit()  # a piece is a batch of its own

    def flush(self) -> None:
        """Scans what is pending."""
        self._submit()
        self._submit()

    def close(self) -> None:
        self._pending = None
        self.batch = Batch()

    def _submit(self) -> None:
        """Asks for the current batch's pages ahead, scans the pending batch,
        and makes the current one pending."""
        batch, self.batch = self.batch, Batch()
        if batch.file is not None:
            batch.file.advise(batch.low, batch.high, will_need=True)
        pending, self._pending = self._pending, batch if batch.items else None
        if pending is not None:
            self._scan(pending)

    def _scan(self, batch: Batch) -> None:
        xs = [t for _, t, _, _ in batch.items]
        if batch.file is None:
            results = stats_many(xs, tol=self.tol, histogram=self.histogram)
        else:
            results, faulted = stats_many_mapped(xs, tol=self.tol, histogram=self.histogram)
            if faulted:
                name, _, where, _ = batch.items[faulted[0]]
                raise batch.file.short_read(name, where)
            batch.file.check_unchanged()
            batch.file.advise(batch.low, batch.high, will_need=False)
        for (name, _, _, piece), s in zip(batch.items, results):
            if piece is None or piece.count == 1:
                self.on_result(name, s)
                continue
            self._piece_rows.append(s.buffer)
            if self.histogram:
                self._piece_histograms.append(s.histogram)  # type: ignore[arg-type]  # scanned with one
            if piece.index == piece.count - 1:
                self.on_result(name, self._merge_pieces(piece))
        self.on_step(batch.weight)

    def _merge_pieces(self, last: Piece) -> Stats:
        """The Stats of a tensor from its pieces' rows (and histograms), which are then forgotten."""
        rows = torch.stack(self._piece_rows).unsqueeze(1)  # [pieces, 1 tensor, 16]
        self._piece_rows = []
        merged = ops.combine_rows(rows)[0]
        meta = (last.dtype, last.shape, torch.device("cpu"))
        if not self.histogram:
            return Stats(Readout(merged), 0, meta, self.tol)
        first, *others = self._piece_histograms
        self._piece_histograms = []
        histogram = sum(others, first)
        return MergedStats(Readout(merged), meta, self.tol, histogram)


class MergedStats(Stats):
    """The Stats of a tensor scanned in pieces: their rows merged into one
    (combine_rows), and the sum of their histograms, which no native field
    row of the whole tensor holds."""

    __slots__ = ("_histogram",)

    def __init__(self, readout: Readout, meta: TensorMeta, tol: float | None, histogram: Histogram) -> None:
        super().__init__(readout, 0, meta, tol)
        self._histogram = histogram

    @property
    def histogram(self) -> Histogram:
        return self._histogram


def scan_form(x: torch.Tensor) -> torch.Tensor:
    """x as the native scan reads it (ops.scannable_form: a complex tensor's
    real view, a flat view past the native rank limit)."""
    form, why = scannable_form(x)
    if form is None:
        raise ValueError(why)
    return form
