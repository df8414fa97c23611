"""scan_checkpoint: every tensor of a checkpoint scanned and judged in its role."""

from __future__ import annotations

import os
from dataclasses import dataclass

from zeroscan.checkpoint.batches import BatchScanner
from zeroscan.checkpoint.files import FileChangedError, TensorPiece
from zeroscan.checkpoint.opening import open_checkpoint
from zeroscan.checkpoint.roles import judge_in_role, tensor_role
from zeroscan.checkpoint.table import CheckpointError, ProgressFn, TensorEntry, checked_path
from zeroscan.diagnosis import Severity, diagnose_stats
from zeroscan.result_row import FIELDS
from zeroscan.stats import Stats, check_flag

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
    diagnoses each (zeroscan.diagnose_stats) in its role (zeroscan.checkpoint.roles): a
    zero bias or BatchNorm running mean is OK, an all-zero weight matrix a
    warning, a NaN an error in any role; other findings on integer and bool
    tensors are at most "info". Tensors with no data to scan (a dtype
    zeroscan does not read, meta, sparse) are listed in `skipped` with the
    reason.

    Tensors are scanned a batch at a time (up to `batch_bytes`, one native
    call per batch, spread over torch's threads) where the file's mapping
    holds them, with the next batch's pages read ahead meanwhile, from one
    shard to the next (zeroscan.checkpoint.batches). A file truncated during
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
    checked_path("zeroscan.scan_checkpoint", "path", path)
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
            only_negative_infinities = s.neginf > 0 and s.nan == 0 and s.posinf == 0
            severity, reason = judge_in_role(
                role, d.verdict.cause, d.severity, d.reason, only_negative_infinities=only_negative_infinities
            )
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




# The statistics of a checkpoint row: every field of a Stats (zeroscan.FIELDS)
# but finite (numel less the non-finite counts) and sum (mean times finite).
ROW_FIELDS = tuple(f for f in FIELDS if f not in ("finite", "sum"))


def scan_row(
    entry: TensorEntry, s: dict[str, object], verdict: str, role: str, severity: str, reason: str
) -> dict[str, object]:
    """One tensor's row of a CheckpointScan: where it is, its statistics
    (ROW_FIELDS, with zero_fraction after zeros) and its judgement."""
    row: dict[str, object] = {
        "name": entry.name, "shard": entry.shard, "dtype": entry.dtype, "shape": list(entry.shape),
    }
    for field in ROW_FIELDS:
        row[field] = s[field]
        if field == "zeros":
            numel, zeros = int(s["numel"]), int(s["zeros"])  # type: ignore[call-overload]
            row["zero_fraction"] = zeros / numel if numel else 0.0
    row.update(verdict=verdict, role=role, severity=severity, reason=reason)
    if "histogram" in s:  # scanned with histogram=True
        row["histogram"] = s["histogram"]
    return row
