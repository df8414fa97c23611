"""Reading checkpoints tensor by tensor, without loading them whole.

A checkpoint file is one of two formats, told apart by content whatever its
name (open_file):

* torch.save files, loaded with ``weights_only=True`` (no pickled code is
  ever run) and memory-mapped (``torch.load(mmap=True)``) when the file uses
  the zip format; nested dicts, lists and tuples of tensors are flattened to
  dotted names (``model.layer.0.weight``, ``optimizer.state.3.exp_avg``);
  leaves that are not tensors (an epoch number, a config string) are left out.
* .safetensors files, checked and read through the safetensors package
  (zeroscan.safetensors_io); tensor() gives the package's memory-mapped
  tensors, so a file larger than memory is never read whole.

A checkpoint of several files is one too: a sharded model's folder or its
index file (zeroscan.checkpoint_sharded) and a torch.distributed.checkpoint
folder (zeroscan.checkpoint_dcp); zeroscan.checkpoint_paths says which
folders are checkpoints.

scan_checkpoint reads tensors where the file's mapping holds them, inside a
native scan that turns a SIGBUS (the file truncated under it) into an error
naming the file (zeroscan.checkpoint_reads).

Every problem with the file itself raises CheckpointError with a one-line
message naming the file. scan_checkpoint diagnoses every tensor of a
checkpoint; zeroscan.checkpoint_diff compares two.
"""

from __future__ import annotations

import functools
import math
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from zeroscan.checkpoint_reads import (
    BatchScanner,
    FileChangedError,
    FileSource,
    FileTensor,
    MappedSource,
    ScanSource,
    TensorFile,
    TensorPiece,
    contiguous_file_tensor,
    locate_in_zip,
    same_file,
)
from zeroscan.ops import FLOAT_DTYPES, INT_DTYPES, SCANNABLE_DTYPES, unreadable
from zeroscan.stats import Stats
from zeroscan.torch_io import TorchFileError, load_torch_file
from zeroscan.safetensors_io import (
    SafetensorsError,
    SafetensorsTensors,
    looks_like_safetensors,
    read_safetensors_header,
)

# Complex tensors are scanned as their real and imaginary parts (torch.view_as_real).
COMPLEX_DTYPES = frozenset({torch.complex64, torch.complex128})


class CheckpointError(Exception):
    """A file that cannot be read as a checkpoint; str() is one line."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint, described without reading its data."""

    name: str
    dtype: str  # torch's name ("float32"), or the file's own for a dtype torch lacks
    shape: tuple[int, ...]
    nbytes: int
    shard: str = ""  # the file holding it, relative to a many-file checkpoint's folder; "" for one file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def scannable(dtype: torch.dtype) -> bool:
    """True when zeroscan can scan a tensor of this dtype (complex via its parts)."""
    return dtype in SCANNABLE_DTYPES or dtype in COMPLEX_DTYPES


class TensorTable:
    """What every opened checkpoint gives, whatever its files: its tensor
    entries in order, each looked up by name, each tensor on demand (read(),
    tensor()), what a scan reads (scan_items()), and close(). A subclass
    sets path, format, entries, metadata, skipped and shards, and calls
    index_entries() once its entries are known."""

    path: Path
    format: str
    entries: list[TensorEntry]
    metadata: dict[str, str]
    skipped: list[dict[str, object]]  # problems found on opening, listed with a scan's skipped tensors
    shards: int  # files holding its tensors

    def index_entries(self) -> None:
        self._by_name = {e.name: e for e in self.entries}

    def read(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def tensor(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def scan_items(self, batch_bytes: int) -> Iterator[tuple[TensorEntry, ScanSource]]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def entry(self, name: str) -> TensorEntry:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def shard_of(self, name: str) -> str:
        return self.entry(name).shard

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in order, each made only when reached."""
        for e in self.entries:
            yield e.name, self.tensor(e.name)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def __enter__(self) -> TensorTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Checkpoint(TensorTable):
    """An opened checkpoint: its tensor entries in file order, and each
    tensor on demand. Use as a context manager, or call close(), which
    releases the file: one descriptor and at most one mapping, however many
    tensors it holds."""

    def __init__(
        self,
        path: Path,
        format: str,
        entries: list[TensorEntry],
        get: Callable[[str], torch.Tensor],
        close: Callable[[], None] | None = None,
        metadata: dict[str, str] | None = None,
        *,
        file: TensorFile | None = None,
        located: dict[str, FileTensor] | None = None,
    ) -> None:
        self.path = path
        self.format = format  # "torch", "torch-legacy" or "safetensors"
        self.entries = entries
        self.index_entries()
        self._get = get
        self._close = close
        self.metadata = metadata or {}  # a safetensors file's __metadata__
        self._file = file
        self._located = located
        self.skipped: list[dict[str, object]] = []  # problems found on opening, listed with a scan's skipped tensors
        self.shards = 1  # files

    def file(self) -> TensorFile:
        """The open file that scans read tensor bytes from (opened on first use)."""
        if self._file is None:
            try:
                self._file = TensorFile(self.path)
            except OSError as e:
                raise CheckpointError(f"{self.path}: cannot read ({e.strerror or e})") from None
        return self._file

    def located(self) -> dict[str, FileTensor]:
        """Where each tensor that a scan reads from the file lies in it, by
        name (zeroscan.checkpoint_reads). The others are scanned as tensor()
        gives them: a legacy torch file's, which torch.load read whole, and
        those with no data in the file (meta, sparse)."""
        if self._located is None:
            located = {}
            if self.format == "torch":
                located = locate_in_zip(self.file(), {e.name: self._get(e.name) for e in self.entries})
                # A zip directory that no longer reads (the file truncated since
                # torch.load mapped it) is a changed file, not one to read otherwise.
                self.file().check_unchanged()
            self._located = located
        return self._located

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name` as tensor() gives it, but read into memory with
        read calls where the file gives its place (located()), so that a file
        truncated meanwhile is a CheckpointError naming it, never a SIGBUS. It
        holds the bytes the tensor views: an expanded view's few, a whole
        tensor's all. The others are tensor() itself."""
        try:
            where = self.located().get(name)
            if where is None:
                return self.tensor(name)
            return self.file().read_tensor(name, where)
        except FileChangedError as e:
            raise CheckpointError(str(e)) from None

    def scan_items(self, batch_bytes: int) -> Iterator[tuple[TensorEntry, ScanSource]]:
        """Each entry, in file order, with what scan_checkpoint scans: where
        the file holds it, the tensor itself (one torch.load read whole, or
        one with no place in the file: in torch's mapping of a zip file, a
        MappedSource), or why it is not scanned."""
        located = self.located()
        for entry in self.entries:
            reason = dtype_skip_reason(entry.dtype)
            if reason is not None:
                yield entry, reason
                continue
            where = located.get(entry.name)
            if where is not None:
                yield entry, FileSource(self.file(), where)
                continue
            t = self.tensor(entry.name)
            why = unreadable(t)
            if why is not None:
                yield entry, f"the tensor {why}"
            elif self.format == "torch":  # in torch's mapping of the file: read where SIGBUS is caught
                yield entry, MappedSource(self.file(), t)
            else:
                yield entry, t

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor `name`, memory-mapped where the format allows (reading a
        mapped tensor dies with SIGBUS if the file is truncated meanwhile;
        scan_checkpoint reads its mapping only inside the guarded native scan,
        and read() uses read calls)."""
        self.entry(name)
        return self._get(name)

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, format={self.format!r}, {len(self)} tensors)"


def open_checkpoint(path: str | os.PathLike[str]) -> TensorTable:
    """Opens a checkpoint: a torch.save file or a .safetensors file
    (recognised by content, not by name); a sharded model's folder or its
    index file (zeroscan.checkpoint_sharded); a torch.distributed.checkpoint
    folder or its `.metadata` file (zeroscan.checkpoint_dcp). Each has the
    same interface: entries, entry(), read(), scan_items(), close(). Raises
    CheckpointError with a one-line reason."""
    from zeroscan.checkpoint_paths import DCP_METADATA, INDEX_SUFFIX

    p = Path(path)
    if p.is_dir():
        return open_folder(p)
    if p.name.endswith(INDEX_SUFFIX) and p.is_file():
        from zeroscan.checkpoint_sharded import open_index

        return open_index(p)
    if p.name == DCP_METADATA and p.is_file():  # the DCP checkpoint alone, in a folder holding others too
        from zeroscan.checkpoint_dcp import open_dcp

        return open_dcp(p.parent)
    return open_file(p)


def open_folder(p: Path) -> TensorTable:
    """A folder that is one checkpoint (zeroscan.checkpoint_paths.checkpoint_kind)."""
    from zeroscan.checkpoint_paths import checkpoint_files, checkpoint_kind, folder_contents, index_files, model_kind

    kind = checkpoint_kind(p)
    if kind is None and model_kind(p) == "index":
        # Its index's own errors (a shard missing) first: they say more than its other checkpoints.
        from zeroscan.checkpoint_sharded import open_index

        open_index(index_files(p)[0]).close()
    if kind == "dcp":
        from zeroscan.checkpoint_dcp import open_dcp

        return open_dcp(p)
    if kind == "index":
        from zeroscan.checkpoint_sharded import open_index

        return open_index(index_files(p)[0])
    if kind == "shards":
        from zeroscan.checkpoint_sharded import open_shards

        return open_shards(p, checkpoint_files(p))
    if kind == "single":
        return open_file(checkpoint_files(p)[0])
    inside = folder_contents(p)
    if not inside:
        raise CheckpointError(f"{p}: is a folder holding no checkpoint (no shard index, .metadata or checkpoint file)")
    names = ", ".join(os.path.relpath(c, p) for c in inside[:4])
    names += f" and {len(inside) - 4} more" if len(inside) > 4 else ""
    raise CheckpointError(
        f"{p}: is a folder of {len(inside)} separate checkpoints ({names}), not one; name one of them "
        "(`zeroscan scan` scans each of a folder's checkpoints)"
    )


# How torch.save files begin: a zip's first local header, or (the legacy
# format) a pickle's PROTO opcode and protocol, then torch's magic number as
# a 10-byte LONG1. Neither can begin a safetensors file whose header length
# is within the 100 MB the package reads.
ZIP_MAGIC = b"PK\x03\x04"
LEGACY_MAGIC_AT_2 = b"\x8a\x0a\x6c\xfc\x9c\x46\xf9"


def looks_like_torch(head: bytes) -> bool:
    return head.startswith(ZIP_MAGIC) or (head[:1] == b"\x80" and head[2:9] == LEGACY_MAGIC_AT_2)


def open_file(p: Path) -> Checkpoint:
    """A torch.save or .safetensors file, told apart by content: a file is
    read as what it holds, whatever its name says (a torch.save file named
    model.safetensors, a safetensors file named model.bin). Only a file that
    is neither by its first bytes is read as its name says, so that a damaged
    .safetensors file is named as one."""
    size = regular_file_size(p)
    try:
        with open(p, "rb") as f:
            head = f.read(9)
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read ({e.strerror or e})") from None
    if size == 0:
        raise CheckpointError(f"{p}: empty file, not a checkpoint")
    if looks_like_safetensors(head, size):
        return open_safetensors(p)
    if looks_like_torch(head) or p.suffix != ".safetensors":
        return open_torch(p)
    return open_safetensors(p)


SPECIAL_FILE_KINDS = (
    (stat.S_ISFIFO, "FIFO (named pipe)"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
)


def regular_file_size(p: Path) -> int:
    """p's size, after refusing anything but a regular file. It is decided by
    stat() alone, before anything opens p: open() on a FIFO waits for a writer
    forever, a device such as /dev/zero never ends, and opening some devices
    acts on them (a tape rewinds)."""
    try:
        st = p.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(f"{p}: no such file") from None
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read ({e.strerror or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{p}: is a directory, not a checkpoint file")
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in SPECIAL_FILE_KINDS if test(st.st_mode)), "special file")
        raise CheckpointError(f"{p}: is a {kind}, not a regular file; zeroscan reads checkpoint files only")
    return st.st_size


# --- torch.save files (zeroscan.torch_io) ----------------------------------


def open_torch(p: Path) -> Checkpoint:
    """A torch.save file. It is opened before torch.load maps it, and torch
    loads it through that descriptor (TensorFile.descriptor_path): the file
    that scans read from and check for changes is the one torch mapped, so a
    file truncated after torch.load is a changed file to the scan, not a
    SIGBUS when torch's mapping is read. The same size and time after
    torch.load show that it did not change while torch read it."""
    try:
        file = TensorFile(p)
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read ({e.strerror or e})") from None
    try:
        tensors, zipped = load_torch_file(p, file.descriptor_path)
        if not same_file(file.opened, os.fstat(file.raw.fileno())):
            raise CheckpointError(f"{p}: changed while it was being opened; open it again once it is written")
    except TorchFileError as e:
        file.close()
        raise CheckpointError(str(e)) from None
    except BaseException:
        file.close()
        raise
    if not zipped:  # the legacy format: torch.load read it whole, so nothing more is read from the file
        file.close()
    entries = [TensorEntry(name, dtype_name(t.dtype), shape_of(t), stored_bytes(t)) for name, t in tensors.items()]
    return Checkpoint(p, "torch" if zipped else "torch-legacy", entries, tensors.__getitem__, tensors.clear,
                      file=file if zipped else None)


def shape_of(t: torch.Tensor) -> tuple[int, ...]:
    """t's shape; () for a nested tensor, whose components each have their own."""
    return () if t.is_nested else tuple(t.shape)


def stored_bytes(t: torch.Tensor) -> int:
    """The bytes of t that the file holds: an expanded view of one value is
    2**62 elements in a file of a few bytes, and progress counts what is read."""
    if t.is_nested or t.layout != torch.strided:
        return 0  # skipped by the scan: nothing of it is read
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


# --- safetensors files -------------------------------------------------------


def open_safetensors(p: Path) -> Checkpoint:
    """A .safetensors file as a Checkpoint. The format's own errors become
    CheckpointError, the one error every caller of open_checkpoint handles.

    The file is opened first and the header then parsed by path: the same
    size, time and inode afterwards show that the header describes the file
    the tensors will be read from."""
    try:
        file = TensorFile(p)
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read ({e.strerror or e})") from None
    try:
        slots, metadata = read_safetensors_header(p)
        if not same_file(file.opened, p.stat()):
            raise CheckpointError(f"{p}: changed while it was being opened; open it again once it is written")
    except SafetensorsError as e:
        file.close()
        raise CheckpointError(str(e)) from None
    except BaseException:
        file.close()
        raise
    entries = []
    located = {}
    for name, slot in slots.items():
        label = dtype_name(slot.dtype) if slot.dtype is not None else slot.file_dtype
        entries.append(TensorEntry(name, label, slot.shape, slot.nbytes))
        if slot.dtype is not None:
            located[name] = contiguous_file_tensor(slot.start, slot.dtype, slot.shape)
    mapped = SafetensorsTensors(p, slots, file.opened)  # the package's mapping, opened when a tensor is first asked for

    def get(name: str) -> torch.Tensor:
        try:
            return mapped.get(name)
        except SafetensorsError as e:
            raise CheckpointError(str(e)) from None

    return Checkpoint(p, "safetensors", entries, get, mapped.close, metadata, file=file, located=located)


# --- scanning ---------------------------------------------------------------

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes in all)


@dataclass
class CheckpointScan:
    """The scan of one checkpoint: a row per tensor in file order, and the
    tensors left out (a dtype zeroscan cannot scan, a tensor an index names
    that its shard lacks) with the reason and, for problems, a severity."""

    path: str
    format: str
    nbytes: int  # all tensor bytes in the checkpoint, skipped ones included
    rows: list[dict[str, object]]
    skipped: list[dict[str, object]]
    shards: int = 1  # the files holding its tensors

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "format": self.format, "shards": self.shards, "tensors": self.rows,
                "skipped": self.skipped}


def scan_checkpoint(
    path: str | os.PathLike[str],
    *,
    tol: float | None = None,
    mostly_zero: float = 0.9,
    progress: ProgressFn | None = None,
    batch_bytes: int = 64 << 20,
    histogram: bool = False,
) -> CheckpointScan:
    """Scans every tensor of a checkpoint (anything open_checkpoint opens: a
    file, a sharded model, a torch.distributed.checkpoint folder) and
    diagnoses each (zeroscan.diagnose_stats) in its role (zeroscan.roles): a
    zero bias or BatchNorm running mean is OK, an all-zero weight matrix a
    warning, a NaN an error in any role; other findings on integer and bool
    tensors are at most "info". Tensors with no data to scan (a dtype
    zeroscan does not read, meta, sparse) are listed in `skipped` with the
    reason.

    Tensors are scanned a batch at a time (up to `batch_bytes`, one native
    call per batch, spread over torch's threads) where the file's mapping
    holds them, with the next batch's pages read ahead meanwhile, from one
    shard to the next (zeroscan.checkpoint_reads). A file truncated during
    the scan (a training job re-saving it) raises CheckpointError rather
    than killing the process with SIGBUS. A tensor larger than a batch is
    scanned in pieces whose results are merged exactly (counts, min/max)
    and as the native scan merges its own chunks (moments). Memory beyond
    the page cache stays within a few batches, whatever the checkpoint's
    size. `progress(done, total)` is called in bytes, over the whole
    checkpoint, after each batch.

    `histogram=True` also counts each tensor's log2-magnitude histogram in
    the same pass (zeroscan.histogram; a tensor in pieces: the sum of its
    pieces'), and each row gets it as "histogram": Histogram.to_dict().
    """
    from zeroscan.diagnosis import Severity, diagnose_stats
    from zeroscan.roles import judge_in_role, tensor_role
    from zeroscan.stats import check_flag

    check_flag("zeroscan.scan_checkpoint", "histogram", histogram)
    with open_checkpoint(path) as ckpt:
        total = ckpt.nbytes
        rows: list[dict[str, object]] = []
        skipped: list[dict[str, object]] = list(ckpt.skipped)
        done = 0

        def on_result(name: str, s: Stats) -> None:
            entry = ckpt.entry(name)
            d = diagnose_stats(s, mostly_zero=mostly_zero)
            role = tensor_role(entry.name, entry.shape)
            severity, reason = judge_in_role(role, d.verdict.cause, d.severity, d.reason)
            if not s.dtype.is_floating_point and severity > Severity.INFO:
                # indices and masks (token_type_ids, attention_mask): all zero is normal
                reason = f"{reason} (an integer tensor: a counter, index or mask, so only info)"
                severity = Severity.INFO
            rows.append(scan_row(entry, s.to_dict(), d.verdict.value, role.value, severity.name.lower(), reason))

        def on_step(nbytes: int) -> None:
            nonlocal done
            done += nbytes
            if progress is not None:
                progress(done, total)

        scanner = BatchScanner(batch_bytes, tol, on_result, on_step, histogram=histogram)
        try:
            for entry, source in ckpt.scan_items(batch_bytes):
                if isinstance(source, str):
                    skipped.append({"name": entry.name, "dtype": entry.dtype, "shape": list(entry.shape),
                                    "shard": entry.shard, "reason": source, "severity": "info"})
                    done += entry.nbytes
                    continue
                weight = source.tensor.numel() * source.tensor.element_size() if isinstance(
                    source, TensorPiece) else entry.nbytes
                scanner.add(entry.name, source, weight)
            scanner.flush()
        except FileChangedError as e:
            raise CheckpointError(str(e)) from None
        finally:
            scanner.close()  # before the files close: no batch may read them after
        if progress is not None:
            progress(total, total)
        return CheckpointScan(str(path), ckpt.format, total, rows, skipped, ckpt.shards)


def unscannable_reason(entry: TensorEntry) -> str | None:
    return dtype_skip_reason(entry.dtype)


def scanned_dtypes_words() -> str:
    """The dtypes a scan reads, by name, from the tables that decide it
    (zeroscan.ops): "floating and integer" would be untrue of uint16, the
    float8 fnuz types and every sub-byte dtype, none of which is read."""
    read = ", ".join(dtype_name(d) for d in (*FLOAT_DTYPES, *INT_DTYPES))
    parts = " and ".join(dtype_name(d) for d in sorted(COMPLEX_DTYPES, key=lambda d: d.itemsize))
    return f"zeroscan reads {read}, and {parts} as their real and imaginary parts"


@functools.lru_cache(maxsize=256)
def dtype_skip_reason(dtype_label: str) -> str | None:
    """Why tensors of this dtype (a TensorEntry's label) are not scanned;
    decided once per dtype, as a file of many tensors has few dtypes."""
    dtype = getattr(torch, dtype_label, None)
    if not isinstance(dtype, torch.dtype):
        return f"dtype {dtype_label} has no torch equivalent here"
    if not scannable(dtype):
        return f"dtype {dtype_label} is not scanned ({scanned_dtypes_words()})"
    return None


def scan_row(
    entry: TensorEntry, s: dict[str, object], verdict: str, role: str, severity: str, reason: str
) -> dict[str, object]:
    numel = int(s["numel"])  # type: ignore[call-overload]
    zeros = int(s["zeros"])  # type: ignore[call-overload]
    row: dict[str, object] = {
        "name": entry.name,
        "shard": entry.shard,
        "dtype": entry.dtype,
        "shape": list(entry.shape),
        "numel": numel,
        "zeros": zeros,
        "zero_fraction": zeros / numel if numel else 0.0,
        "subnormal": s["subnormal"],
        "near_zero": s["near_zero"],
        "nan": s["nan"],
        "posinf": s["posinf"],
        "neginf": s["neginf"],
        "negative": s["negative"],
        "min_abs": s["min_abs"],
        "min_abs_nonzero": s["min_abs_nonzero"],
        "max_abs": s["max_abs"],
        "mean": s["mean"],
        "std": s["std"],
        "norm": s["norm"],
        "verdict": verdict,
        "role": role,
        "severity": severity,
        "reason": reason,
    }
    if "histogram" in s:  # scanned with histogram=True
        row["histogram"] = s["histogram"]
    return row
