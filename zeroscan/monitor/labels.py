"""How the Monitor's messages name a module of the model (its name and
class) and what one container level holds (`name[key]`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn


def module_label(model: nn.Module, name: str) -> str:
    """A module of `model` as messages name it: its name and class."""
    module = model.get_submodule(name) if name else model
    return f"{name} ({type(module).__name__})" if name else f"the model ({type(module).__name__})"


def one_level(value: Any) -> Iterable[tuple[object | None, Any]]:
    """(key, item) for a dict's items or a list's or tuple's elements, as
    messages label them (`name[key]`); (None, value) for anything else."""
    if isinstance(value, dict):
        return value.items()
    if isinstance(value, (list, tuple)):
        return enumerate(value)
    return [(None, value)]
