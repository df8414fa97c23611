"""Reading a torch.distributed.checkpoint folder's tensors through DCP's own
reader (zeroscan.checkpoint.dcp_metadata reads and checks its `.metadata`).

Chunks are read through DCP's FileSystemReader, which loads each with
torch.load(weights_only=True), and a LoadPlanner that asks for any box of a
tensor, a whole tensor or a block of its rows (create_read_items_for_chunk_list).
Items DCP stored as bytes are never asked for.

A scan holds a batch of tensors at a time, and a tensor larger than a batch
one block of rows at a time. But DCP's reader loads a whole stored chunk for
every request that touches it, then copies the requested box out of it: a
block costs, while it is read, the memory and the read of the chunks it
touches, so a tensor saved as one chunk far larger than a batch is read once
per block.

Every problem with a `.distcp` file raises CheckpointError, one line naming
the file, when a tensor is read.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import stat
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from zeroscan.checkpoint.dcp_metadata import METADATA_FILE, is_file_name, read_metadata, tensor_files
from zeroscan.checkpoint.files import ScanSource, TensorPiece, changed_while_scanned, same_file
from zeroscan.checkpoint.table import CheckpointError, TensorEntry, TensorTable, dtype_name, dtype_skip_reason
from zeroscan.checkpoint.torch_file import one_line, refused_pickle
from zeroscan.words import brief



class Region(NamedTuple):
    """A box of one tensor: the whole tensor, or a block of its rows."""

    fqn: str
    dtype: torch.dtype
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class RegionPlanner(LoadPlanner):
    """A LoadPlanner that reads boxes of tensors (Region) into fresh tensors
    of the boxes' shapes; it never asks for an item stored as bytes. DCP
    gives each read item's place relative to the box it was planned for."""

    def __init__(self, regions: list[Region]) -> None:
        self.regions = regions
        self.out = {r.fqn: torch.empty(r.sizes, dtype=r.dtype) for r in regions}
        self.filled = dict.fromkeys(self.out, 0)  # elements copied in, to find boxes the chunks do not cover

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        assert metadata is not None
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for r in self.regions:
            md = self.metadata.state_dict_metadata[r.fqn]
            assert isinstance(md, TensorStorageMetadata)
            box = ChunkStorageMetadata(offsets=torch.Size(r.offsets), sizes=torch.Size(r.sizes))
            items += create_read_items_for_chunk_list(r.fqn, md, [box])
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise AssertionError(f"zeroscan never asks for bytes items, but got {read_item.dest_index.fqn!r}")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        t = self.out[read_item.dest_index.fqn]
        for dim, (at, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, at, n)
        return t

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.filled[read_item.dest_index.fqn] += tensor.numel()


class FileSlice(io.RawIOBase):
    """Bytes [start, start + length) of an open file as a file of their own:
    a chunk's torch.save archive, for zipfile to list."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = (0, self.pos, self.length)[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        data = os.pread(self.fd, n, self.start + self.pos)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


def check_archive(p: Path, fd: int, info: _StorageInfo) -> None:
    """The chunk's torch.save archive must store its entries uncompressed,
    each inside the chunk: torch.load inflates a compressed entry whole into
    memory, and a few bytes could inflate to any size. torch.save never
    compresses."""
    where = f"{p}: the chunk at byte {info.offset:,}"
    try:
        with zipfile.ZipFile(FileSlice(fd, info.offset, info.length)) as z:
            infos = z.infolist()
    except Exception as e:  # zipfile raises several types for a damaged archive
        raise CheckpointError(f"{where} is not a torch.save archive ({one_line(e)})") from None
    for entry in infos:
        if entry.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(
                f"{where} holds a compressed entry {brief(entry.filename)} ({entry.compress_size:,} bytes that "
                f"inflate to {entry.file_size:,}); torch.save never compresses, and zeroscan refuses what could "
                "inflate to any size"
            )
        if entry.file_size != entry.compress_size or entry.header_offset + entry.compress_size > info.length:
            raise CheckpointError(f"{where} declares an entry of {entry.file_size:,} bytes that does not fit it")


class MetadataReader(FileSystemReader):
    """DCP's FileSystemReader, given the metadata zeroscan unpickled, so its
    own pickle.load never runs. Before DCP reads a file, the file is checked
    (a regular file, holding every chunk asked of it, each chunk an
    uncompressed archive), and DCP reads one file at a time so that an error
    names the file. A file that changes after the checkpoint was opened (its
    size or time) is an error naming it, as a changed checkpoint file is."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self.folder = path
        self.metadata = metadata
        self.opened: dict[str, os.stat_result | None] = {}  # file name: its stat on opening; None: absent
        names = {getattr(info, "relative_path", None) for info in metadata.storage_data.values()}
        for name in filter(is_file_name, names):  # only those checked to name a file in the folder
            try:
                st = os.stat(path / name)
            except OSError:  # absent or unreadable: said when a tensor is read from it
                self.opened[name] = None
            else:
                self.opened[name] = st

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            p = self.folder / name
            self.check_file(p, [self.storage_data[i.storage_index] for i in items])
            try:
                with warnings.catch_warnings():  # torch's, about the chunk: never to stderr (zeroscan.checkpoint.torch_file)
                    warnings.simplefilter("ignore")
                    super().read_data(LoadPlan(items), planner).wait()
            except Exception as e:  # torch.load and DCP raise many types for a damaged chunk
                self.check_unchanged(p)
                tensors = brief(sorted({i.dest_index.fqn for i in items}))
                refused = isinstance(e, pickle.UnpicklingError) and "GLOBAL" in str(e)
                why = refused_pickle(str(e)) if refused else one_line(e)
                raise CheckpointError(f"{p}: cannot read the chunks of {tensors} ({why})") from None
            self.check_unchanged(p)  # rewritten in place while it was read: the chunks may mix two saves
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def check_file(self, p: Path, infos: list[_StorageInfo]) -> None:
        if any(info.transform_descriptors for info in infos):
            kinds = sorted({d for info in infos for d in info.transform_descriptors or ()})
            raise CheckpointError(
                f"{p}: chunks stored through {brief(kinds)}; zeroscan reads untransformed DCP files only "
                "(a compressed stream could inflate to any size)"
            )
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: a FIFO does not wait for a writer
        except FileNotFoundError:
            raise CheckpointError(f"{p}: no such file (the metadata places chunks there)") from None
        except OSError as e:
            raise CheckpointError(f"{p}: cannot read ({e.strerror or e})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{p}: not a regular file; zeroscan reads checkpoint files only")
            self.check_unchanged(p, st)
            end = max(info.offset + info.length for info in infos)
            if st.st_size < end:
                raise CheckpointError(
                    f"{p}: truncated ({st.st_size:,} bytes, but the metadata places chunks up to byte {end:,})"
                )
            for info in {(i.offset, i.length): i for i in infos}.values():
                check_archive(p, fd, info)
        finally:
            os.close(fd)

    def check_unchanged(self, p: Path, st: os.stat_result | None = None) -> None:
        """Raises the error of a checkpoint file that changed while it was
        scanned if p's size or time differ from those it had on opening."""
        was = self.opened.get(p.name)
        if was is None:  # absent on opening: checked as it is now
            return
        if st is None:
            try:
                st = os.stat(p)
            except OSError:
                return  # gone: the read that follows says so
        if not same_file(was, st):
            raise CheckpointError(changed_while_scanned(p, st, was))


# --- the checkpoint --------------------------------------------------------------


class DcpCheckpoint(TensorTable):
    """An opened DCP folder: its tensor entries in the metadata's order, each
    tensor read on demand through DCP. Only `.metadata` is read on opening."""

    def __init__(self, path: Path, metadata: Metadata, entries: list[TensorEntry]) -> None:
        self.path = path
        self.format = "dcp"
        self.entries = entries
        self.metadata: dict[str, str] = {}
        self.skipped: list[dict[str, object]] = []  # problems found on opening: none that leave a tensor out
        self.shards = len({f for e in entries for f in e.shard.split(",") if f})  # .distcp files
        self.index_entries()
        self._dcp = metadata
        self._reader: MetadataReader | None = MetadataReader(path, metadata)

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor `name`, in memory."""
        self.entry(name)
        return self.load([self.region(name)])[0]

    def tensor(self, name: str) -> torch.Tensor:
        """read(name): DCP maps nothing, so there is no lighter way to give it."""
        return self.read(name)

    def scan_items(self, batch_bytes: int) -> Iterator[tuple[TensorEntry, ScanSource]]:
        """Each entry in the metadata's order with what scan_checkpoint scans:
        the tensor read into memory, a TensorPiece of one too large for a
        batch, or the reason it is not scanned. Tensors are read a batch of
        up to `batch_bytes` at a time, one DCP read per batch, and a batch is
        given out before the next is read; a tensor larger than a batch is
        read a block of rows at a time (blocks)."""
        pending: list[tuple[TensorEntry, str | None]] = []  # a skip reason, or None for a tensor to read
        pending_bytes = 0
        for e in self.entries:
            reason = dtype_skip_reason(e.dtype)
            if reason is None and e.nbytes > batch_bytes:
                yield from self.read_batch(pending)
                pending, pending_bytes = [], 0
                yield from self.read_pieces(e, batch_bytes)
                continue
            if reason is None and pending_bytes + e.nbytes > batch_bytes:
                yield from self.read_batch(pending)
                pending, pending_bytes = [], 0
            pending.append((e, reason))
            pending_bytes += e.nbytes if reason is None else 0
        yield from self.read_batch(pending)

    def read_batch(self, items: list[tuple[TensorEntry, str | None]]) -> Iterator[tuple[TensorEntry, ScanSource]]:
        regions = [self.region(e.name) for e, reason in items if reason is None]
        tensors = iter(self.load(regions) if regions else [])
        for e, reason in items:
            yield e, reason if reason is not None else next(tensors)

    def read_pieces(self, e: TensorEntry, batch_bytes: int) -> Iterator[tuple[TensorEntry, TensorPiece]]:
        whole = self.region(e.name)
        itemsize = whole.dtype.itemsize
        count = block_count(e.shape, itemsize, batch_bytes)
        for index, (offsets, sizes) in enumerate(blocks(e.shape, itemsize, batch_bytes)):
            block = self.load([whole._replace(offsets=offsets, sizes=sizes)])[0]
            yield e, TensorPiece(block, index, count, e.shape)

    def region(self, name: str) -> Region:
        md = self._dcp.state_dict_metadata[name]
        assert isinstance(md, TensorStorageMetadata)
        return Region(name, md.properties.dtype, (0,) * len(md.size), tuple(md.size))

    def load(self, regions: list[Region]) -> list[torch.Tensor]:
        """The boxes `regions` (of distinct tensors), read with one DCP read,
        the steps of torch's load_state_dict in one process."""
        reader = self._reader
        if reader is None:
            raise CheckpointError(f"{self.path}: the checkpoint is closed")
        try:
            planner = RegionPlanner(regions)
        except RuntimeError as e:  # a dtype torch cannot hold, or a box too large for memory
            names = brief([r.fqn for r in regions])
            raise CheckpointError(f"{self.path}: cannot hold {names} in memory ({one_line(e)})") from None
        metadata = reader.read_metadata()
        planner.set_up_planner({}, metadata, is_coordinator=True)
        reader.set_up_storage_reader(metadata, True)
        local = reader.prepare_local_plan(planner.create_local_plan())
        plans = reader.prepare_global_plan(planner.create_global_plan([local]))
        reader.read_data(planner.finish_plan(plans[0]), planner).wait()
        for r in regions:
            want = math.prod(r.sizes)
            if planner.filled[r.fqn] != want:
                raise CheckpointError(
                    f"{self.path / METADATA_FILE}: the chunks of tensor {brief(r.fqn)} give "
                    f"{planner.filled[r.fqn]:,} elements of the {want:,} asked for (chunks missing; overlaps are refused at open)"
                )
        return [planner.out[r.fqn] for r in regions]

    def close(self) -> None:
        self._reader = None

    def __repr__(self) -> str:
        return f"DcpCheckpoint({str(self.path)!r}, {len(self)} tensors in {self.shards} files)"


def block_count(shape: tuple[int, ...], itemsize: int, budget: int) -> int:
    """How many boxes blocks() cuts a tensor of `shape` into."""
    if not shape:
        return 1
    row = math.prod(shape[1:]) * itemsize
    if row <= budget or len(shape) == 1:
        return -(-shape[0] // max(1, budget // row))
    return shape[0] * block_count(shape[1:], itemsize, budget)


def blocks(shape: tuple[int, ...], itemsize: int, budget: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of boxes of at most `budget` bytes (or one element)
    that cover a tensor of `shape` in C order: blocks of whole rows, or,
    where one row is larger than the budget, each row cut the same way."""
    if not shape:
        yield (), ()
        return
    row = math.prod(shape[1:]) * itemsize
    if row <= budget or len(shape) == 1:
        step = max(1, budget // row)
        for begin in range(0, shape[0], step):
            yield (begin, *(0,) * (len(shape) - 1)), (min(step, shape[0] - begin), *shape[1:])
        return
    for i in range(shape[0]):
        for offsets, sizes in blocks(shape[1:], itemsize, budget):
            yield (i, *offsets), (1, *sizes)


def looks_like_dcp(path: Path) -> bool:
    """A folder holding a regular file `.metadata` (decided by stat alone)."""
    try:
        return stat.S_ISDIR(path.stat().st_mode) and stat.S_ISREG((path / METADATA_FILE).stat().st_mode)
    except OSError:
        return False


def open_dcp(path: Path) -> DcpCheckpoint:
    """Opens the DCP folder `path`, reading its `.metadata` once. Raises
    CheckpointError with a one-line reason naming the path."""
    if not looks_like_dcp(path):
        raise CheckpointError(f"{path}: not a torch.distributed.checkpoint folder (no regular file {METADATA_FILE})")
    p = path / METADATA_FILE
    md = read_metadata(p)
    storage = md.storage_data
    entries = []
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise CheckpointError(f"{p}: not DCP metadata (a key {brief(fqn)} that is not a name)")
        if isinstance(item, BytesStorageMetadata):
            continue  # a pickled object: never read, as a torch file's non-tensor leaves are left out
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointError(f"{p}: not DCP metadata ({brief(fqn)} is a {type(item).__name__})")
        files = tensor_files(p, fqn, item, storage)
        dtype = item.properties.dtype
        shape = tuple(item.size)
        entries.append(TensorEntry(fqn, dtype_name(dtype), shape, math.prod(shape) * dtype.itemsize, ",".join(files)))
    return DcpCheckpoint(path, md, entries)
