"""The Monitor's activation scans (activations=True): dead units and saturated rows.

Every nn.ReLU, nn.ReLU6 and nn.GELU module of the model (dead units: each
unit's peak |output|, unit_peak) and every nn.Softmax module
(saturated rows: 1 - each row's greatest probability, softmax_gap)
gets a forward hook. On a monitored step the output of each of a module's
first MAX_CALLS_PER_STEP calls is scanned together with that per-unit or
per-row tensor, in one native call, and nothing is read back; a call that
cannot be scanned leaves a note, and the forward pass goes on.
"""

from __future__ import annotations

import torch
from torch import nn

from zeroscan.monitor import scanner

MAX_CALLS_PER_STEP = 8  # activation calls of one module scanned per step
RELU_FAMILY = (nn.ReLU, nn.ReLU6, nn.GELU)


def activation_modules(model: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """(name, tag, module) of every module whose outputs are scanned, in the
    order of model.named_modules(): tag "relu" or "softmax"; the model
    itself is named "(model)"."""
    found = []
    for name, module in model.named_modules():
        tag = "softmax" if isinstance(module, nn.Softmax) else "relu" if isinstance(module, RELU_FAMILY) else None
        if tag is not None:
            found.append((name or "(model)", tag, module))
    return found


def scannable(output: object) -> bool:
    """An output the activation scan reads: a strided floating-point tensor."""
    return isinstance(output, torch.Tensor) and output.is_floating_point() and output.layout == torch.strided


class ActivationScans:
    """One step's activation scans: `scans`, (name, tag, int64 [2, 16]
    buffer) per call scanned, which the step's StepRecord takes as its
    activations, and `notes`, (name, why) per call that could not be."""

    def __init__(self) -> None:
        self.scans: list[tuple[str, str, torch.Tensor]] = []
        self.notes: list[tuple[str, str]] = []
        self._calls: dict[str, int] = {}

    def scan(self, name: str, tag: str, module: nn.Module, output: torch.Tensor) -> None:
        """Scans the output of one call of the module `name` (its k-th call
        of the step is named name#k), up to MAX_CALLS_PER_STEP per step."""
        calls = self._calls.get(name, 0)
        if calls >= MAX_CALLS_PER_STEP:
            return
        self._calls[name] = calls + 1
        key = name if calls == 0 else f"{name}#{calls}"
        try:
            with torch.no_grad():
                if tag == "softmax":
                    unit = softmax_gap(output, module)
                else:
                    unit = unit_peak(output, nonneg=isinstance(module, (nn.ReLU, nn.ReLU6)))
                buffer = scanner.native_many([output, unit])
            self.scans.append((key, tag, buffer))
        except Exception as err:  # report, never break the forward pass
            self.notes.append((key, f"not scanned: {err}"))


def unit_peak(out: torch.Tensor, *, nonneg: bool) -> torch.Tensor:
    """Per-unit max |output| over the batch: 0 means the unit is dead.
    Units are the last dim, or dim 1 (channels) for 4-D and 5-D outputs."""
    if out.dim() == 0 or out.numel() == 0:
        return out.reshape(-1)
    mags = out if nonneg else out.abs()
    unit_dim = 1 if out.dim() >= 4 else out.dim() - 1
    dims = tuple(d for d in range(out.dim()) if d != unit_dim)
    return mags.amax(dim=dims) if dims else mags


def softmax_gap(out: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """1 - max probability per row: <= eps means the row is saturated."""
    if out.dim() == 0 or out.numel() == 0:
        return out.reshape(-1)
    dim = getattr(module, "dim", None)
    dim = -1 if dim is None else dim
    return (1.0 - out.amax(dim=dim)).reshape(-1)
