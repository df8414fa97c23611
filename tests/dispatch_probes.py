"""What sees an operator call: a dispatch mode, a function mode and a tensor
subclass with __torch_function__, for tests of which route a call takes
(zeroscan._C's direct calls, or torch.ops)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class OpsSeen(TorchDispatchMode):
    """The operators dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class LoggedTensor(torch.Tensor):
    """A tensor subclass whose __torch_function__ records what it is called with."""

    calls: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        cls.calls.append(str(func))
        return super().__torch_function__(func, types, args, kwargs or {})


class FunctionsSeen(TorchFunctionMode):
    """The functions called while active, at the __torch_function__ level."""

    def __init__(self) -> None:
        super().__init__()
        self.funcs: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.funcs.append(str(func))
        return func(*args, **(kwargs or {}))
