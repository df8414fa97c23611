"""The small training step that the guard's and the Monitor's step tests
share: a model, its batches, copies of everything a step may change, the
checks on them, host reads made to fail, and the aten ops after which a
CUDA host waits for its device, recorded (DeviceWaits)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import zeroscan

ZEROSCAN_DIR = str(Path(zeroscan.__file__).resolve().parent)
# aten ops after which a CUDA host waits for its device: a value read on the host (item, bool(),
# int(), float() all end in _local_scalar_dense), an output sized by the values, or a tensor made
# from host data (a copy from pageable memory). None of them can be captured in a CUDA graph.
DEVICE_WAITS = frozenset(f"aten::{name}" for name in (
    "_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "argwhere", "masked_select",
    "_unique2", "unique_dim", "unique_consecutive", "lift_fresh",
))

Batch = tuple[torch.Tensor, torch.Tensor]


def make_model(g: torch.Generator) -> nn.Sequential:
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return model


def batches(g: torch.Generator, n: int) -> list[Batch]:
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def loss_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).square().mean()


def backward(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> None:
    """Gradients of one batch, from zero."""
    opt.zero_grad()
    loss_of(model, batch).backward()


def everything(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Copies of every weight and every tensor of the optimizer's state."""
    out = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key, t in opt.state.get(p, {}).items():
            if isinstance(t, torch.Tensor):
                out[f"state {n} {key}"] = t.detach().clone()
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, exact: bool = True) -> None:
    """Same names, and every tensor bit-identical (exact) or equal in value."""
    assert sorted(got) == sorted(want)
    for name in want:
        a, b = got[name], want[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        same = torch.equal(bits(a), bits(b)) if exact else torch.equal(a, b)
        assert same, f"{name}: {a} != {b}"


def assert_moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    """The step did change the weights: the no-op checks are not vacuous."""
    assert any(not torch.equal(bits(before[n]), bits(after[n])) for n in before if n.startswith("param"))


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def called_from(filename: str) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == filename:
            return True
        frame = frame.f_back
    return False


@contextmanager
def host_reads_refused(monkeypatch: pytest.MonkeyPatch, *, only_from: str | None = None) -> Iterator[list[str]]:
    """Every host read of a tensor fails: anywhere, or only while the code of
    the file `only_from` is on the stack (torch's non-capturable Adam reads
    its CPU step count with .item() itself). Yields the reads refused."""
    calls: list[str] = []
    with monkeypatch.context() as patch:
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)

            def refusing(self: torch.Tensor, *args: object, _name: str = name, _original=original, **kwargs: object):
                if only_from is None or called_from(only_from):
                    calls.append(_name)
                    raise AssertionError(f"host read Tensor.{_name} during optimizer.step()")
                return _original(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, refusing)
        yield calls


def is_freed(t: torch.Tensor | None) -> bool:
    """Whether t's memory was freed with its shape kept (FSDP's resize_(0))."""
    return t is not None and t.numel() > 0 and t.untyped_storage().nbytes() == 0


def step_past_freed_memory(opt: torch.optim.Optimizer) -> None:
    """Makes opt's steps leave out a parameter whose memory (or its
    gradient's) is freed, as FSDP's optimizer only ever sees what is there.
    Hooks registered after zeroscan's: zeroscan sees the freed tensors."""
    hidden: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def hide(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if is_freed(p) or is_freed(p.grad):
                    hidden.append((p, p.grad))
                    p.grad = None

    def give_back(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        for p, grad in hidden:
            p.grad = grad
        hidden.clear()

    opt.register_step_pre_hook(hide)
    opt.register_step_post_hook(give_back)


def zeroscan_frame() -> str | None:
    """file:line of the innermost zeroscan frame on the Python stack, if any."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(ZEROSCAN_DIR):
            return f"zeroscan{filename[len(ZEROSCAN_DIR):]}:{frame.f_lineno}"
        frame = frame.f_back
    return None


class DeviceWaits(TorchDispatchMode):
    """Records every op of DEVICE_WAITS that runs while it is active (in
    backward too), with the zeroscan line that called it (None: not
    zeroscan's code). On the CPU it stands in for CUDA's sync debug mode."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str | None]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func._schema.name in DEVICE_WAITS:
            self.seen.append((str(func), zeroscan_frame()))
        return func(*args, **(kwargs or {}))

    def by_zeroscan(self) -> list[tuple[str, str | None]]:
        return [(op, where) for op, where in self.seen if where is not None]
