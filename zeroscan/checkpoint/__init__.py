"""Reading checkpoints tensor by tensor, without loading them whole.

A checkpoint file is one of two formats, told apart by content whatever its
name (opening.open_file):

* torch.save files (torch_file), loaded with ``weights_only=True`` (no
  pickled code is ever run) and memory-mapped (``torch.load(mmap=True)``)
  when the file uses the zip format; nested dicts, lists and tuples of
  tensors are flattened to dotted names (``model.layer.0.weight``,
  ``optimizer.state.3.exp_avg``); leaves that are not tensors (an epoch
  number, a config string) are left out.
* .safetensors files (safetensors_file), checked and read through the
  safetensors package; tensor() gives the package's memory-mapped tensors,
  so a file larger than memory is never read whole.

A checkpoint of several files is one too: a sharded model's folder or its
index file (sharded) and a torch.distributed.checkpoint folder (dcp,
dcp_metadata); paths says which folders are checkpoints, and opening picks
the format, in one place.

The modules, each importing only those above it:

    table          TensorTable, TensorEntry, CheckpointError, dtype checks
    files          a file's bytes read safely, where each tensor lies
    single         one file as a TensorTable
    torch_file, safetensors_file, sharded, dcp_metadata, dcp    the formats
    paths          what a path names: files, model folders, globs
    opening        open_checkpoint: the format picked
    batches        the batched, read-ahead native scan
    roles          what a tensor is for, from its name and shape
    scan           scan_checkpoint
    diff           diff_checkpoints
    groups         rows summed by layer, module or shard

scan_checkpoint reads tensors where the file's mapping holds them, inside a
native scan that turns a SIGBUS (the file truncated under it) into an error
naming the file (files, batches).

Every problem with the file itself raises CheckpointError with a one-line
message naming the file. scan_checkpoint diagnoses every tensor of a
checkpoint; diff_checkpoints compares two.
"""

from zeroscan.checkpoint.diff import diff_checkpoints
from zeroscan.checkpoint.opening import open_checkpoint
from zeroscan.checkpoint.scan import CheckpointScan, scan_checkpoint
from zeroscan.checkpoint.table import (
    COMPLEX_DTYPES,
    CheckpointError,
    ProgressFn,
    TensorEntry,
    TensorTable,
    dtype_name,
    dtype_skip_reason,
    scannable,
)

__all__ = [
    "COMPLEX_DTYPES",
    "CheckpointError",
    "CheckpointScan",
    "ProgressFn",
    "TensorEntry",
    "TensorTable",
    "diff_checkpoints",
    "dtype_name",
    "dtype_skip_reason",
    "open_checkpoint",
    "scan_checkpoint",
    "scannable",
]
