"""Reading a checkpoint's tensors for a scan: from a memory mapping of the
file, guarded against the file being truncated meanwhile.

Scanning a tensor where the file's mapping holds it reads each byte once, at
memory speed, with no copy. But a mapped page past the end of a file that
another process truncated (a training job re-saving the checkpoint being
scanned does exactly that) raises SIGBUS, which kills a process. So a scan
reads mapped tensors only inside the native stats_many_mapped, which turns a
SIGBUS there into a per-tensor flag, and the flag into an error naming the
file and the tensor (`BatchScanner`). The file's size and modification time
are checked after every batch too: a file rewritten in place without
shrinking raises no SIGBUS, but is just as changed.

Tensors are scanned a batch at a time, one native call per batch, which
spreads the batch over torch's threads. The kernel is asked to read the next
batch's pages ahead (MADV_WILLNEED) while one is scanned, and to drop a
scanned batch's pages from this process (MADV_DONTNEED: they stay in the
page cache), so memory beyond the page cache stays within a few batches
whatever the checkpoint's size. A tensor larger than a batch is scanned in
pieces whose rows are merged with combine_rows: counts and min/max exactly,
the moments as the native scan merges its own chunks. Scanned with
histograms, the pieces' histograms are summed (exact counts).

Where each tensor lies comes from the format: a safetensors header gives its
byte range; torch.load(mmap=True) maps a torch.save zip file without reading
it, and a tensor's place in the file is its address in that mapping less the
mapping's start, found by matching the storages to the zip's data records
(`locate_in_zip`). Reading a tensor whole for --diff (`TensorFile.read_tensor`)
uses read calls, which report a truncated file as a short read.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
import sys
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from zeroscan.histogram import Histogram
from zeroscan.ops import scannable_form
from zeroscan.stats import Readout, Stats, TensorMeta, stats_many, stats_many_mapped

MAX_BATCH_TENSORS = 1024  # tensors per native call


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


# A dim of 2 or more doubles a tensor's size, so a real tensor has at most 63
# of them; the rest are 0 or 1. A rank far beyond that is a hostile header,
# whose dims cost memory and time in every shape and stride computed from it.
MAX_RANK = 1024
INT64_MAX = 2**63 - 1


def shape_problem(shape: tuple[int, ...], itemsize: int) -> str | None:
    """Why no tensor of elements of `itemsize` bytes can have this shape (a
    phrase that follows "tensor NAME"), or None. torch computes strides
    counting a zero-sized dim as 1, so a shape holding no element can still
    overflow: [0, 2**62, 4] has a stride of 2**64 elements, which torch refuses
    with an internal error."""
    if len(shape) > MAX_RANK:
        return f"has {len(shape):,} dimensions, more than the {MAX_RANK:,} a tensor may have here"
    if any(n < 0 for n in shape):
        return f"has a negative dimension in its shape {list(shape)}"
    stride = itemsize  # in bytes: zeroscan indexes bytes with int64
    for n in reversed(shape[1:]):
        stride *= max(n, 1)
        if stride > INT64_MAX:
            break
    if stride > INT64_MAX or math.prod(shape) * itemsize > INT64_MAX:
        text = str(list(shape))
        text = text if len(text) <= 200 else f"{text[:150]}...{text[-40:]}"
        return f"has the shape {text}, whose strides or byte size overflow 64 bits"
    return None


def span_bytes(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """The bytes from element 0 to the end of the last element (non-negative strides)."""
    if 0 in shape:
        return 0
    return (sum((n - 1) * s for n, s in zip(shape, stride)) + 1) * itemsize


class FileSource(NamedTuple):
    """A tensor a scan reads from `file` at `where` (read calls, never a mapping)."""

    file: TensorFile
    where: FileTensor


class MappedSource(NamedTuple):
    """A tensor that views a mapping of `file` made by someone else (torch.load's
    of a zip file whose records could not be matched to its storages), so that
    its place in the file is unknown. It is read only inside the native
    stats_many_mapped, as a view of the file's own mapping is: a file
    truncated meanwhile is an error naming it, not a SIGBUS."""

    file: TensorFile
    tensor: torch.Tensor


class TensorPiece(NamedTuple):
    """Piece `index` of `count` of a tensor too large to hold whole, already in
    memory: the pieces of one tensor come one after another, in order, and
    together hold each of its elements once. Their Stats are merged into the
    tensor's (combine_rows), which describe `shape`."""

    tensor: torch.Tensor  # [any]: the piece's elements, in the tensor's dtype
    index: int
    count: int
    shape: tuple[int, ...]  # the whole tensor's


# What a checkpoint's scan_items() gives for each tensor: where to read it, the
# tensor itself (in memory, or in a mapping of a file), one piece of it, or the
# reason it is not scanned.
ScanSource = FileSource | MappedSource | torch.Tensor | TensorPiece | str


# --- the file ------------------------------------------------------------------


def same_file(then: os.stat_result, now: os.stat_result) -> bool:
    """Whether `now` is still the file `then` was: the same inode, size and
    modification time (a checkpoint rewritten, truncated or replaced is not)."""
    return (now.st_ino, now.st_dev, now.st_size, now.st_mtime_ns) == (
        then.st_ino, then.st_dev, then.st_size, then.st_mtime_ns
    )


def changed_while_scanned(p: Path, now: os.stat_result, then: os.stat_result) -> str:
    """The error of checkpoint file p, which was `then` on opening and is `now`."""
    was = f"was {then.st_size:,}" if now.st_size != then.st_size else "rewritten in place"
    return (
        f"{p}: changed while it was being scanned (now {now.st_size:,} bytes, {was}); "
        "scan it again once it is written"
    )


class TensorFile:
    """One open checkpoint file that tensors are read from: one descriptor
    whatever the number of tensors, and the check that the file stays as it
    was when opened (its size and modification time)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.raw = open(path, "rb", buffering=0)
        self.opened = os.fstat(self.raw.fileno())
        self._mapping: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None  # [file size] uint8, the mapping

    @property
    def descriptor_path(self) -> str | None:
        """A path whose opening opens the very file this descriptor holds
        (Linux's /proc/self/fd, /dev/fd elsewhere), whatever replaced its
        path since; None where the system has none."""
        for folder in ("/proc/self/fd", "/dev/fd"):
            if os.path.isdir(folder):
                return f"{folder}/{self.raw.fileno()}"
        return None

    def close(self) -> None:
        self._bytes = None
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:  # a view still in use: the mapping goes when it does
                pass
            self._mapping = None
        self.raw.close()

    def check_unchanged(self) -> None:
        now = os.fstat(self.raw.fileno())
        if not same_file(self.opened, now):
            raise FileChangedError(changed_while_scanned(self.path, now, self.opened))

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

    def view(self, where: FileTensor) -> torch.Tensor:
        """The tensor at `where` (offset a multiple of its element size) as a
        view of the file's mapping, made on first use: one read-only shared
        mapping of the whole file, which reserves no memory. Only the native
        stats_many_mapped may read it (a SIGBUS anywhere else kills the
        process if the file shrinks)."""
        if self._bytes is None:
            # The mapping is made when the first tensor is asked for, which may
            # be long after the file was opened: a file that shrank meanwhile
            # would map shorter than the offsets taken from it.
            self.check_unchanged()
            try:
                self._mapping = mmap.mmap(self.raw.fileno(), self.opened.st_size, access=mmap.ACCESS_READ)
            except (ValueError, OSError):  # shorter than that now: truncated since the check
                self.check_unchanged()
                raise
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only memory: zeroscan never writes it
                self._bytes = torch.frombuffer(self._mapping, dtype=torch.uint8)
        typed = self._bytes[where.offset : where.offset + where.nbytes].view(where.dtype)
        return typed.as_strided(where.shape, where.stride)

    def advise(self, low: int, high: int, *, will_need: bool) -> None:
        """Asks the kernel to read bytes [low, high) of the mapping ahead, or
        to drop them from this process once scanned (they stay in the page
        cache): what keeps the memory a scan holds bounded."""
        if self._mapping is None or low < 0 or high <= low:
            return
        start = low - low % mmap.PAGESIZE
        end = min(high, len(self._mapping))
        if end > start:
            self._mapping.madvise(mmap.MADV_WILLNEED if will_need else mmap.MADV_DONTNEED, start, end - start)

    def read_tensor(self, name: str, where: FileTensor) -> torch.Tensor:
        """The tensor at `where`, read into memory of its own (the bytes it
        views: an expanded view's few), with its shape and strides."""
        buffer = torch.empty(where.nbytes, dtype=torch.uint8)
        if self.read_into(memoryview(buffer.numpy()), where.offset) < where.nbytes:
            raise self.short_read(name, where)
        self.check_unchanged()
        return buffer.view(where.dtype).as_strided(where.shape, where.stride)

    def short_read(self, name: str, where: FileTensor | None) -> FileChangedError:
        """The error for tensor `name`, which the file no longer holds whole;
        `where` None: a tensor of a mapping whose place in the file is unknown."""
        size = os.fstat(self.raw.fileno()).st_size
        needs = f"needs bytes {where.offset:,}..{where.end:,}" if where is not None else "lies past its end"
        return FileChangedError(
            f"{self.path}: changed while it was being scanned (now {size:,} bytes; tensor {name!r} {needs})"
        )


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
        merged = torch.ops.zeroscan.combine_rows.default(rows)[0]
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
