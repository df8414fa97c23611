"""How the Monitor's messages name a module of the model: its name and class."""

from __future__ import annotations

from torch import nn


def module_label(model: nn.Module, name: str) -> str:
    """A module of `model` as messages name it: its name and class."""
    module = model.get_submodule(name) if name else model
    return f"{name} ({type(module).__name__})" if name else f"the model ({type(module).__name__})"
