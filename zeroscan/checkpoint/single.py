"""One checkpoint file (torch.save or .safetensors) as a TensorTable: its
entries in file order, each tensor on demand, and where a scan reads each
(zeroscan.checkpoint.files). The formats' own modules make it, opening the
file alike: `open_tensor_file`, their reading of it inside
`closed_on_failure`, then `check_unchanged_since_opened`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from zeroscan.checkpoint.files import (
    FileChangedError,
    FileSource,
    FileTensor,
    MappedSource,
    ScanSource,
    TensorFile,
    locate_in_zip,
    same_file,
)
from zeroscan.checkpoint.table import CheckpointError, TensorEntry, TensorTable, dtype_skip_reason
from zeroscan.ops import unreadable


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
            self._file = open_tensor_file(self.path)
        return self._file

    def located(self) -> dict[str, FileTensor]:
        """Where each tensor that a scan reads from the file lies in it, by
        name (zeroscan.checkpoint.files). The others are scanned as tensor()
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


def open_tensor_file(p: Path) -> TensorFile:
    """Checkpoint file p, opened to read its tensors from; CheckpointError,
    the one error every caller of open_checkpoint handles, if it cannot be."""
    try:
        return TensorFile(p)
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read ({e.strerror or e})") from None


@contextlib.contextmanager
def closed_on_failure(file: TensorFile, format_error: type[Exception]) -> Iterator[None]:
    """Around a format's reading of `file` as it is opened: closes the file
    if the block raises, so that a file that does not open holds no
    descriptor, and turns the format's own error into CheckpointError."""
    try:
        yield
    except format_error as e:
        file.close()
        raise CheckpointError(str(e)) from None
    except BaseException:
        file.close()
        raise


def check_unchanged_since_opened(file: TensorFile, now: os.stat_result) -> None:
    """CheckpointError unless `now` is still the file as it was opened: what
    was read of it on opening describes the file its tensors are read from."""
    if not same_file(file.opened, now):
        raise CheckpointError(f"{file.path}: changed while it was being opened; open it again once it is written")


def shape_of(t: torch.Tensor) -> tuple[int, ...]:
    """t's shape; () for a nested tensor, whose components each have their own."""
    return () if t.is_nested else tuple(t.shape)


def stored_bytes(t: torch.Tensor) -> int:
    """The bytes of t that the file holds: an expanded view of one value is
    2**62 elements in a file of a few bytes, and progress counts what is read."""
    if t.is_nested or t.layout != torch.strided:
        return 0  # skipped by the scan: nothing of it is read
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


