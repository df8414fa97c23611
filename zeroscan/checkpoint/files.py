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
from pathlib import Path
from typing import NamedTuple

import torch


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
