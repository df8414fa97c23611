"""Reading a checkpoint's tensors with read calls, into small reusable buffers.

A memory-mapped file kills the process with SIGBUS when another process
truncates it while its pages are being read, and a training job re-saving the
checkpoint being scanned does exactly that. A read call reports the same event
as a short read, which becomes an error naming the file and the tensor. So a
scan never reads mapped tensor data: it reads a batch of tensors at a time
with os.preadv into a buffer of its thread, views each tensor there, and
scans the batch with one stats_many call (`BatchScanner`). A tensor larger
than a batch is scanned in pieces whose rows are merged with combine_rows:
counts and min/max exactly, the moments as the native scan merges its own
chunks, which for a tensor of up to 2^26 elements gives bit for bit the
result of one call (see PIECE_ELEMENTS).

The price of not mapping is one copy of every byte, from the page cache into
the buffer; copying from a mapping under a SIGBUS guard would cost the same.

Where each tensor lies comes from the format: a safetensors header gives its
byte range; torch.load(mmap=True) maps a torch.save zip file without reading
it, and a tensor's place in the file is its address in that mapping less the
mapping's start, found by matching the storages to the zip's data records
(`locate_in_zip`).
"""

from __future__ import annotations

import collections
import functools
import math
import os
import struct
import sys
import threading
import zipfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch

from zeroscan.ops import scannable_form
from zeroscan.stats import Readout, Stats, StatsBatch, stats_many

ALIGN = 64  # a tensor keeps its file offset's alignment in the buffer, up to this
MAX_GAP = 4096  # bytes between two tensors that one read spans rather than making two
MAX_BATCH_TENSORS = 1024  # tensors per stats_many call


class FileChangedError(Exception):
    """The file changed while it was being read; str() is one line naming it."""


class FileTensor(NamedTuple):  # a tuple: a file of 200,000 tensors makes 200,000 of them
    """Where one tensor's elements lie in its file, and how to view them."""

    offset: int  # file offset of element 0, the lowest byte the tensor uses
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    nbytes: int  # the bytes from offset that hold every element; 0 without elements

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def is_contiguous(self) -> bool:
        return self.stride == contiguous_stride(self.shape)


@functools.lru_cache(maxsize=4096)
def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def contiguous_file_tensor(offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> FileTensor:
    return FileTensor(offset, dtype, shape, contiguous_stride(shape), math.prod(shape) * dtype.itemsize)


def span_bytes(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """The bytes from element 0 to the end of the last element (non-negative strides)."""
    if 0 in shape:
        return 0
    return (sum((n - 1) * s for n, s in zip(shape, stride)) + 1) * itemsize


# --- the file ------------------------------------------------------------------


class TensorFile:
    """One open checkpoint file that tensors are read from: one descriptor
    whatever the number of tensors, and the check that the file stays as it
    was when opened (its size and modification time)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.raw = open(path, "rb", buffering=0)
        self.opened = os.fstat(self.raw.fileno())

    def close(self) -> None:
        self.raw.close()

    def check_unchanged(self) -> None:
        now = os.fstat(self.raw.fileno())
        if (now.st_size, now.st_mtime_ns) != (self.opened.st_size, self.opened.st_mtime_ns):
            was = f"was {self.opened.st_size:,}" if now.st_size != self.opened.st_size else "rewritten in place"
            raise FileChangedError(
                f"{self.path}: changed while it was being scanned (now {now.st_size:,} bytes, {was}); "
                "scan it again once it is written"
            )

    def read_into(self, view: memoryview, offset: int) -> int:
        """Reads len(view) bytes at `offset`; returns how many there were (fewer at the end of the file)."""
        done = 0
        fd = self.raw.fileno()
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done

    def read_plan(self, plan: ReadPlan, buffer: memoryview) -> None:
        """Fills the buffer as `plan` places its tensors; a short read raises
        FileChangedError naming the tensor whose bytes are missing."""
        for start, end, at in plan.segments:
            got = self.read_into(buffer[at : at + end - start], start)
            if got < end - start:
                raise self.short_read(*plan.tensor_at(start + got))
        self.check_unchanged()

    def read_tensor(self, name: str, where: FileTensor) -> torch.Tensor:
        """The tensor at `where`, read into memory of its own (the bytes it
        views: an expanded view's few), with its shape and strides."""
        buffer = torch.empty(where.nbytes, dtype=torch.uint8)
        if self.read_into(memoryview(buffer.numpy()), where.offset) < where.nbytes:
            raise self.short_read(name, where)
        self.check_unchanged()
        return buffer.view(where.dtype).as_strided(where.shape, where.stride)

    def short_read(self, name: str, where: FileTensor) -> FileChangedError:
        size = os.fstat(self.raw.fileno()).st_size
        return FileChangedError(
            f"{self.path}: changed while it was being scanned (now {size:,} bytes; "
            f"tensor {name!r} needs bytes {where.offset:,}..{where.end:,})"
        )


class ReadPlan:
    """A batch of file tensors placed in a buffer of `capacity` bytes, and
    the reads that fill it: neighbours in the file share one read."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.segments: list[list[int]] = []  # [file start, file end, buffer position]
        self.tensors: list[tuple[str, FileTensor, int]] = []  # name, place in the file, buffer position

    def add(self, name: str, where: FileTensor) -> bool:
        """Places `where` in the buffer; False when it does not fit."""
        itemsize = where.dtype.itemsize
        if self.segments:
            start, end, pos = self.segments[-1]
            at = pos + where.offset - start
            if 0 <= where.offset - end <= MAX_GAP and at % itemsize == 0:
                used = max(self.used, at + where.nbytes)
                if used > self.capacity:
                    return False
                self.segments[-1][1] = max(end, where.end)
                self.used = used
                self.tensors.append((name, where, at))
                return True
        at = -(-self.used // ALIGN) * ALIGN
        if where.offset % itemsize == 0:
            at += where.offset % ALIGN  # aligned in the file: aligned alike in the buffer
        if at + where.nbytes > self.capacity:
            return False
        self.segments.append([where.offset, where.end, at])
        self.used = at + where.nbytes
        self.tensors.append((name, where, at))
        return True

    def tensor_at(self, offset: int) -> tuple[str, FileTensor]:
        """The first tensor whose bytes include file offset `offset` (or lie past it)."""
        for name, where, _ in self.tensors:
            if where.end > offset:
                return name, where
        name, where, _ = self.tensors[-1]
        return name, where

    def clear(self) -> None:
        self.used = 0
        self.segments.clear()
        self.tensors.clear()


# --- torch.save zip files --------------------------------------------------------


def zip_data_records(file: TensorFile) -> dict[int, int] | None:
    """{file offset of the bytes: size} of every stored (uncompressed) record
    under a `data/` folder of a torch.save zip file: the tensor storages.
    None for a file saved with the other byte order: torch.load swaps its
    bytes in memory, so the file's own bytes are not the tensors' values."""
    records: dict[int, int] = {}
    with zipfile.ZipFile(file.raw) as z:
        infos = z.infolist()
        order = [i for i in infos if i.filename.endswith("/byteorder")]
        if order and z.read(order[0]).decode("ascii", "replace") != sys.byteorder:
            return None
    infos = [i for i in infos if "/data/" in i.filename and i.compress_type == zipfile.ZIP_STORED]
    header = bytearray(30)
    view = memoryview(header)
    for info in infos:
        # The local header repeats the name and has its own extra field (torch
        # pads it to align the data), so its lengths give where the bytes start.
        if file.read_into(view, info.header_offset) < 30 or header[:4] != b"PK\x03\x04":
            continue
        name_len, extra_len = struct.unpack_from("<HH", header, 26)
        records[info.header_offset + 30 + name_len + extra_len] = info.file_size
    return records


def locate_in_zip(file: TensorFile, tensors: dict[str, torch.Tensor]) -> dict[str, FileTensor]:
    """Where each dense tensor loaded by torch.load(mmap=True) from `file`
    lies in it, by name; {} when the storages cannot be matched to the zip's
    data records (the tensors are then read through the mapping).

    torch maps the whole file once and makes each storage the slice of that
    mapping at its record's offset, so every storage's address less one base
    address (the mapping's start) is the offset of a record at least as long:
    the base is the one that makes that hold for all of them."""
    storages: dict[int, int] = {}  # address: bytes
    dense: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if t.layout != torch.strided or t.is_meta or t.is_nested or t.is_quantized or t.numel() == 0:
            continue
        s = t.untyped_storage()
        storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        dense[name] = t
    if not storages:
        return {}
    try:
        records = zip_data_records(file)
    except (OSError, zipfile.BadZipFile):
        return {}
    if records is None:
        return {}
    lowest = min(storages)
    base = None
    for offset in sorted(records)[:64]:  # the lowest storage is almost always the first record
        candidate = lowest - offset
        if all(records.get(address - candidate, -1) >= size for address, size in storages.items()):
            base = candidate
            break
    if base is None:
        return {}
    located = {}
    for name, t in dense.items():
        shape, stride = tuple(t.shape), tuple(t.stride())
        nbytes = span_bytes(shape, stride, t.element_size())
        located[name] = FileTensor(t.data_ptr() - base, t.dtype, shape, stride, nbytes)
    return located


# --- scanning --------------------------------------------------------------------

# Elements per batch: fewer than the native scan's kParallelMin (2^19, in
# csrc/cpu/stats_cpu.cpp), so that each stats_many call runs on the thread
# that makes it and the batches themselves run on as many threads as torch
# uses (the call releases the GIL), each in a buffer small enough to stay in
# that core's cache between the read and the scan. And a power-of-two
# multiple of the native chunk (kMinChunk, 2^16 elements): a tensor of up to
# 2^26 elements, whose native chunks are that size, scanned in pieces of
# PIECE_ELEMENTS merges (combine_rows, the same pairwise tree) to bit for bit
# the result of one call on the whole tensor.
PIECE_ELEMENTS = 1 << 18
NATIVE_CHUNK = 1 << 16
MAX_SCANNED_ITEMSIZE = 8  # complex tensors are scanned as their real parts

ResultFn = Callable[[str, Stats], None]  # (the name a tensor was added with, its Stats)
StepFn = Callable[[int], None]  # the weight of the tensors a batch finished, called after each


class Piece(NamedTuple):
    """Piece `index` of `count` of a tensor scanned in pieces, and what its merged Stats describe."""

    index: int
    count: int
    dtype: torch.dtype
    shape: torch.Size


class Batch:
    """Tensors scanned by one stats_many call: tensors of the file, placed in
    a buffer by `plan`, and tensors already in memory."""

    def __init__(self, buffer_bytes: int) -> None:
        self.plan = ReadPlan(buffer_bytes)
        # name, and the tensor: its index in the plan or the tensor itself; its Piece if one
        self.items: list[tuple[str, int | torch.Tensor, Piece | None]] = []
        self.nbytes = 0
        self.elements = 0
        self.weight = 0  # for on_step
        self.own_buffer = False  # a tensor larger than the shared buffers, read alone


class BatchScanner:
    """Scans tensors a batch at a time with one stats_many call per batch
    (at most `batch_bytes` and PIECE_ELEMENTS elements): tensors of `file`
    are read into a buffer, tensors already in memory scanned as they are.
    Batches run on up to `threads` threads. Each tensor's Stats goes to
    `on_result` in the order the tensors were added, and after each batch
    `on_step` gets the weight of the tensors (or pieces) it finished."""

    def __init__(
        self,
        file: TensorFile | None,
        batch_bytes: int,
        tol: float | None,
        on_result: ResultFn,
        on_step: StepFn,
        threads: int = 1,
    ) -> None:
        self.file = file
        self.capacity = max(ALIGN, batch_bytes)
        # ALIGN bytes more than a batch's tensors, so that any tensor that fits
        # a batch fits an empty plan wherever its alignment places it.
        self.buffer_bytes = min(self.capacity, PIECE_ELEMENTS * MAX_SCANNED_ITEMSIZE) + ALIGN
        self.tol = tol
        self.on_result = on_result
        self.on_step = on_step
        self.batch = Batch(self.buffer_bytes)
        self._buffers = threading.local()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="zeroscan-scan") if threads > 1 else None
        self._in_flight: collections.deque[tuple[Batch, Future[StatsBatch]]] = collections.deque()
        self._max_in_flight = 2 * threads
        self._piece_rows: list[torch.Tensor] = []

    def add_tensor(self, name: str, t: torch.Tensor, weight: int) -> None:
        """A tensor in memory, in the form the native scan reads (scan_form)."""
        if self.batch.items and not self._fits(t.numel(), t.numel() * t.element_size()):
            self._submit()
        self._append(name, t, None, t.numel(), t.numel() * t.element_size(), weight)

    def add_file_tensor(self, name: str, where: FileTensor, weight: int) -> None:
        """A tensor of the file, read when its batch is scanned."""
        scanned = scanned_dtype(where.dtype)
        elements = math.prod(where.shape) * (where.dtype.itemsize // scanned.itemsize)
        if where.nbytes + ALIGN > self.buffer_bytes or elements > PIECE_ELEMENTS:
            self._submit()
            if where.is_contiguous:
                self._add_pieces(name, where, scanned, weight)
            else:
                self._add_alone(name, where, weight)
            return
        if not self._fits(elements, where.nbytes) or not self.batch.plan.add(name, where):
            self._submit()
            self.batch.plan.add(name, where)
        self._append(name, len(self.batch.plan.tensors) - 1, None, elements, where.nbytes, weight)

    def _fits(self, elements: int, nbytes: int) -> bool:
        b = self.batch
        return (
            b.elements + elements <= PIECE_ELEMENTS
            and b.nbytes + nbytes <= self.capacity
            and len(b.items) < MAX_BATCH_TENSORS
        )

    def _append(
        self, name: str, item: int | torch.Tensor, piece: Piece | None, elements: int, nbytes: int, weight: int
    ) -> None:
        b = self.batch
        b.items.append((name, item, piece))
        b.elements += elements
        b.nbytes += nbytes
        b.weight += weight

    def _add_pieces(self, name: str, where: FileTensor, scanned: torch.dtype, weight: int) -> None:
        """A contiguous tensor too large for one batch, in flat pieces of the
        dtype that is scanned, each a batch of its own."""
        itemsize = scanned.itemsize
        per_piece = min(PIECE_ELEMENTS, self.capacity // itemsize)
        if per_piece >= NATIVE_CHUNK:  # whole native chunks, a power of two of them
            per_piece = NATIVE_CHUNK << (per_piece // NATIVE_CHUNK).bit_length() - 1
        step = max(1, per_piece) * itemsize
        count = -(-where.nbytes // step)
        shape = torch.Size(where.shape if scanned == where.dtype else (*where.shape, 2))
        for index, begin in enumerate(range(0, where.nbytes, step)):
            end = min(begin + step, where.nbytes)
            piece = contiguous_file_tensor(where.offset + begin, scanned, ((end - begin) // itemsize,))
            self.batch.plan.add(name, piece)
            share = weight * end // where.nbytes - weight * begin // where.nbytes
            self._append(name, len(self.batch.plan.tensors) - 1, Piece(index, count, scanned, shape), 0, 0, share)
            self._submit()

    def _add_alone(self, name: str, where: FileTensor, weight: int) -> None:
        """A strided view too large for the shared buffers (torch.save keeps a
        view's whole storage), read alone into a buffer of its own."""
        batch = Batch(where.nbytes + ALIGN)
        batch.own_buffer = True
        batch.plan.add(name, where)
        batch.items.append((name, 0, None))
        batch.weight = weight
        self.batch = batch
        self._submit()

    def flush(self) -> None:
        """Scans what is pending and waits for every batch."""
        self._submit()
        while self._in_flight:
            self._finish_oldest()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def _submit(self) -> None:
        batch = self.batch
        if not batch.items:
            return
        self.batch = Batch(self.buffer_bytes)
        if self._pool is None:
            self._finish(batch, self._scan(batch))
            return
        self._in_flight.append((batch, self._pool.submit(self._scan, batch)))
        if len(self._in_flight) >= self._max_in_flight:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        batch, future = self._in_flight.popleft()
        self._finish(batch, future.result())

    def _scan(self, batch: Batch) -> StatsBatch:
        """Reads and scans one batch (on a worker thread when there are several)."""
        views: list[torch.Tensor] = []
        if batch.plan.tensors:
            assert self.file is not None
            if batch.own_buffer:
                buffer = torch.empty(batch.plan.capacity, dtype=torch.uint8)
            else:
                buffer = getattr(self._buffers, "buffer", None)
                if buffer is None:
                    buffer = self._buffers.buffer = torch.empty(self.buffer_bytes, dtype=torch.uint8)
            self.file.read_plan(batch.plan, memoryview(buffer.numpy()))
            views = view_plan(buffer, batch.plan)
        xs = [views[item] if isinstance(item, int) else item for _, item, _ in batch.items]
        return stats_many(xs, tol=self.tol)

    def _finish(self, batch: Batch, results: StatsBatch) -> None:
        for (name, _, piece), s in zip(batch.items, results):
            if piece is None:
                self.on_result(name, s)
                continue
            self._piece_rows.append(s.buffer)
            if piece.index == piece.count - 1:
                rows = torch.stack(self._piece_rows).unsqueeze(1)  # [pieces, 1 tensor, 16]
                self._piece_rows = []
                merged = torch.ops.zeroscan.combine_rows.default(rows)[0]
                meta = (piece.dtype, piece.shape, torch.device("cpu"))
                self.on_result(name, Stats(Readout(merged), 0, meta, self.tol))
        self.on_step(batch.weight)


def view_plan(buffer: torch.Tensor, plan: ReadPlan) -> list[torch.Tensor]:
    """The tensors of `plan`, viewed in the buffer it was read into, each in
    the form the native scan reads."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    views = []
    for _, where, at in plan.tensors:
        whole = typed.get(where.dtype)
        if whole is None:
            usable = buffer.numel() // where.dtype.itemsize * where.dtype.itemsize
            whole = typed[where.dtype] = buffer[:usable].view(where.dtype)
        views.append(scan_form(whole.as_strided(where.shape, where.stride, at // where.dtype.itemsize)))
    return views


@functools.lru_cache(maxsize=64)
def scanned_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the native scan reads for a tensor of `dtype` (scan_form)."""
    return scan_form(torch.empty((1,), dtype=dtype)).dtype


def scan_form(x: torch.Tensor) -> torch.Tensor:
    """x as the native scan reads it (ops.scannable_form: a complex tensor's
    real view, a flat view past the native rank limit)."""
    form, why = scannable_form(x)
    if form is None:
        raise ValueError(why)
    return form
