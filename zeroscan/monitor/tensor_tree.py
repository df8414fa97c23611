"""The tensors in whatever a module call takes or returns, for the NaN trace.

A module takes and returns tensors in lists, tuples (NamedTuples too), dicts
(a Hugging Face ModelOutput is both a dict and a dataclass), dataclasses,
and any type registered with torch's pytree utilities. The walk looks into
each of those, MAX_DEPTH levels deep. What it meets and cannot look into (an
object of another type, a container deeper than that, a floating-point
tensor that is not plain and strided, such as a DTensor) is named in
`unseen`, so that a message claims only what the trace saw. Values that
cannot hold a tensor (numbers, strings, dtypes, devices, modules, functions)
are passed over without a word.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from zeroscan.ops import FLOAT_DTYPES

MAX_DEPTH = 6  # how deep into nested containers a call's tensors are looked for
MAX_UNSEEN = 4  # type names kept per call, for the messages
_FLAGGED = frozenset(FLOAT_DTYPES)
_NOTHING_INSIDE = (
    type(None), bool, int, float, complex, str, bytes, slice, range, enum.Enum, type,
    torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Generator, torch.finfo, torch.iinfo,
    nn.Module, types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial,
)


def flaggable(x: object) -> bool:
    """A tensor the trace flags: plain (not a subclass such as DTensor), strided, floating."""
    return (
        type(x) in (torch.Tensor, nn.Parameter)
        and x.dtype in _FLAGGED  # type: ignore[union-attr]
        and x.layout == torch.strided  # type: ignore[union-attr]
        and not x.is_meta  # type: ignore[union-attr]
        and not x.is_nested  # type: ignore[union-attr]
    )


def tensors_in(
    value: Any, label: str, out: list[tuple[torch.Tensor, str]], unseen: list[str], depth: int = 0
) -> None:
    """Appends (tensor, label) for every flaggable tensor in `value`, and to
    `unseen` the type name of what holds values the walk cannot look into."""
    if isinstance(value, torch.Tensor):
        if flaggable(value):
            out.append((value, label))
        elif (value.is_floating_point() or value.is_complex()) and not value.is_meta:
            _note(unseen, _tensor_kind(value))
        return
    if isinstance(value, _NOTHING_INSIDE):
        return
    children = _children(value, label)
    if children is None:
        _note(unseen, type(value).__name__)
    elif depth >= MAX_DEPTH:
        if children:
            _note(unseen, f"{type(value).__name__} nested over {MAX_DEPTH} deep")
    else:
        for child, child_label in children:
            tensors_in(child, child_label, out, unseen, depth + 1)


def _children(value: Any, label: str) -> list[tuple[Any, str]] | None:
    """What `value` holds, labelled, or None for a type the walk cannot look into."""
    if isinstance(value, (list, tuple)):
        return [(v, f"{label}[{k}]") for k, v in enumerate(value)]
    if isinstance(value, dict):  # before dataclasses: a ModelOutput's fields that are set are its items
        return [(v, f"{label}[{key!r}]") for key, v in value.items()]
    if dataclasses.is_dataclass(value):
        return [(getattr(value, f.name, None), f"{label}.{f.name}") for f in dataclasses.fields(value)]
    node = pytree.SUPPORTED_NODES.get(type(value))
    if node is not None:
        try:
            leaves, _ = node.flatten_fn(value)
        except Exception:  # noqa: BLE001  a user's flatten function: what it cannot do is not seen
            return None
        return [(v, f"{label}[{k}]") for k, v in enumerate(leaves)]
    if isinstance(value, (set, frozenset)):
        return [(v, f"{label}{{}}") for v in value]
    return None


def _tensor_kind(t: torch.Tensor) -> str:
    """What a floating-point tensor the trace does not flag is: "DTensor", "complex tensor", "nested tensor"."""
    if type(t) not in (torch.Tensor, nn.Parameter):
        return type(t).__name__
    if t.is_nested:
        return "nested tensor"
    if t.is_complex():
        return "complex tensor"
    return f"{str(t.layout).removeprefix('torch.')} tensor"


def _note(unseen: list[str], name: str) -> None:
    if name not in unseen and len(unseen) < MAX_UNSEEN:
        unseen.append(name)
