"""What a scan reads: zeroscan's one input policy for tensors.

`require_readable` returns a tensor whose memory the native scan can read,
or raises an error naming the call and the argument (`zeroscan.stats: x is
a torch.sparse_coo tensor; ...`); `unreadable` says why a tensor cannot be
read. `received` says in a few words what a call was given, for the
errors that refuse it. It imports nothing of zeroscan but zeroscan.words
(which imports nothing of zeroscan), so that every module can check its
inputs alike, those below zeroscan.ops (zeroscan.histogram) included;
zeroscan.ops builds the native ops' own checks on it.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from zeroscan.words import brief

NONE_HINT = (
    "a gradient that was never computed is None: the parameter is frozen "
    "(requires_grad=False), did not take part in the forward pass, or backward "
    "has not run yet; zeroscan.diagnose explains which"
)
DTENSOR_HINT = (
    "its statistics need a collective over its device mesh: call zeroscan.distributed.stats(x) "
    "(or zeroscan.distributed.stats_many) on every rank of the mesh, or scan x.to_local() for "
    "this rank's shard alone"
)


def is_dtensor(x: object) -> bool:
    """Whether x is a torch.distributed DTensor (checked without importing
    torch.distributed.tensor: no DTensor exists before it is imported, and
    importing it only to find none costs seconds)."""
    if type(x) is torch.Tensor:
        return False
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(x, dtensor)


def unreadable(x: torch.Tensor, *, collective: bool = False) -> str | None:
    """Why the native scan cannot read the memory of tensor x as it is (a
    phrase that follows the tensor's name), or None when it can. A DTensor is
    readable only to a collective call (zeroscan.distributed), which scans
    its local shard."""
    if x.is_meta:
        return "is on the meta device and holds no data to scan"
    if isinstance(x, nn.parameter.UninitializedTensorMixin):
        return "is an uninitialized (lazy) parameter and holds no data yet"
    if is_dtensor(x) and not collective:
        return f"is a DTensor; {DTENSOR_HINT}"
    if x.is_quantized:
        return (
            f"is a quantized tensor ({str(x.dtype).removeprefix('torch.')}); scan x.int_repr() "
            "for its stored integers or x.dequantize() for its values"
        )
    if x.is_nested:
        return "is a nested tensor; scan each of x.unbind() (or x.values(), the entries of a jagged one)"
    if x.layout != torch.strided:
        return (
            f"is a {x.layout} tensor; zeroscan scans dense tensors "
            "(pass x.to_dense(), or x.values() for the stored entries only)"
        )
    held, needed = storage_bytes(x)
    if held < needed:
        return (
            f"has no data to scan: its storage holds {held} bytes but its shape {list(x.shape)} needs {needed} "
            "(its memory was freed, as FSDP frees an unsharded parameter with untyped_storage().resize_(0))"
        )
    return None


def storage_bytes(x: torch.Tensor) -> tuple[int, int]:
    """The bytes x's storage holds and the bytes its shape, strides and offset
    reach (0 for an empty tensor); (0, 0) for a tensor with no storage of its
    own to ask (a torch.func wrapper), which the native op checks unwrapped,
    and while torch.compile traces: dynamo cannot trace a storage's nbytes(),
    and the native op checks the real tensor when the graph runs."""
    if x.numel() == 0 or torch.compiler.is_compiling():
        return 0, 0
    try:
        held = x.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return 0, 0
    last = x.storage_offset() + sum((n - 1) * s for n, s in zip(x.shape, x.stride()))
    return held, (last + 1) * x.element_size()


def require_readable(op: str, name: str, x: object, *, collective: bool = False) -> torch.Tensor:
    """check_tensor without its shortcut: x, or the error naming `name`."""
    if x is None:
        raise TypeError(f"{op}: {name} is None, not a tensor; {NONE_HINT}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    why = unreadable(x, collective=collective)
    if why is not None:
        raise ValueError(f"{op}: {name} {why}")
    return x


def received(value: object) -> str:
    """What a call was given, in a few words on one line, for the error that
    refuses it: a number, a str, a bool or None by its (short) repr, a tensor
    by its kind, dtype and shape (its repr prints its values, over many
    lines), anything else by its type."""
    if isinstance(value, torch.Tensor):
        return _tensor_in_words(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return brief(value)
    return type(value).__name__


def _tensor_in_words(x: torch.Tensor) -> str:
    """A tensor in words: "a float32 tensor of shape [3]", "a sparse_coo
    float32 tensor of shape [3, 3]", "a nested float32 tensor" (a strided
    nested tensor and a lazy parameter have no shape to give); a subclass
    by its class name ("a float32 Parameter of shape [2]")."""
    kinds = []
    if x.is_meta:
        kinds.append("meta")
    if x.layout != torch.strided:
        kinds.append(str(x.layout).removeprefix("torch."))
    elif x.is_nested:
        kinds.append("nested")
    kinds.append(str(x.dtype).removeprefix("torch."))
    noun = "tensor" if type(x) is torch.Tensor else type(x).__name__
    try:
        shape = f" of shape {list(x.shape)}"
    except (RuntimeError, ValueError):  # a strided nested tensor, a lazy parameter
        shape = ""
    words = " ".join([*kinds, noun])
    return f"{'an' if words[0] in 'aeiou' else 'a'} {words}{shape}"
