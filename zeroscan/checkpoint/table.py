"""What every opened checkpoint is, whatever its format: the tensor table
(TensorTable, TensorEntry), its one error (CheckpointError), and the dtype
and file checks every reader makes. It imports no reader: the formats import it.
"""

from __future__ import annotations

import functools
import math
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zeroscan.ops import FLOAT_DTYPES, INT_DTYPES, SCANNABLE_DTYPES

if TYPE_CHECKING:
    from zeroscan.checkpoint.files import ScanSource

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes in all)

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
    """torch's name of the dtype, without "torch." ("float32")."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"zeroscan.checkpoint.dtype_name: dtype must be a torch.dtype, got {type(dtype).__name__}")
    return str(dtype).removeprefix("torch.")


def scannable(dtype: torch.dtype) -> bool:
    """True when zeroscan can scan a tensor of this dtype (complex via its parts)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"zeroscan.checkpoint.scannable: dtype must be a torch.dtype, got {type(dtype).__name__}")
    return dtype in SCANNABLE_DTYPES or dtype in COMPLEX_DTYPES


def checked_path(op: str, name: str, path: object) -> Path:
    """`path` (a str or os.PathLike) as a Path, or the error naming the public call `op`."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{op}: {name} must be a path (a str or os.PathLike), got {type(path).__name__}")
    try:
        return Path(path)
    except TypeError:  # a PathLike whose __fspath__ gives bytes or something else
        raise TypeError(f"{op}: {name} must be a path (a str or os.PathLike of a str), got {type(path).__name__}") from None


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




def scanned_dtypes_words() -> str:
    """The dtypes a scan reads, by name, from the tables that decide it
    (zeroscan.ops): "floating and integer" would be untrue of uint16, the
    float8 fnuz types and every sub-byte dtype, none of which is read."""
    read = ", ".join(dtype_name(d) for d in (*FLOAT_DTYPES, *INT_DTYPES))
    parts = " and ".join(dtype_name(d) for d in sorted(COMPLEX_DTYPES, key=lambda d: d.itemsize))
    return f"zeroscan reads {read}, and {parts} as their real and imaginary parts"


def dtype_skip_reason(dtype_label: str) -> str | None:
    """Why tensors of this dtype (a TensorEntry's label) are not scanned;
    decided once per dtype, as a file of many tensors has few dtypes."""
    if not isinstance(dtype_label, str):
        raise TypeError(
            f"zeroscan.checkpoint.dtype_skip_reason: dtype_label must be a str (a TensorEntry's dtype), "
            f"got {type(dtype_label).__name__}"
        )
    return _skip_reason(dtype_label)


@functools.lru_cache(maxsize=256)
def _skip_reason(dtype_label: str) -> str | None:
    dtype = getattr(torch, dtype_label, None)
    if not isinstance(dtype, torch.dtype):
        return f"dtype {dtype_label} has no torch equivalent here"
    if not scannable(dtype):
        return f"dtype {dtype_label} is not scanned ({scanned_dtypes_words()})"
    return None

