"""The main_grad convention on its own (Apex, Transformer Engine's
fuse_wgrad_accumulation, Megatron-core's DDP): each gradient is added into
param.main_grad, a float32 view of one zeroed buffer, by a hook that then
sets .grad to None. The Monitor reads main_grad (grad_source.MainGrad),
names a parameter that backward never reached with its cause (not as the
zeros its buffer holds), takes in a parameter unfrozen after it was built,
and stays out of a saved model."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from torch import nn

from helpers import fresh_seed
from test_monitor_causes_more import compiled_if
from zeroscan import Monitor, Severity, reference_stats


class Net(nn.Module):
    def __init__(self, unused: bool) -> None:
        super().__init__()
        self.unused = unused
        self.a = nn.Linear(6, 9)
        self.b = nn.Linear(9, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(torch.tanh(self.a(x)))
        return y if self.unused else self.c(y)


def with_main_grad(model: nn.Module) -> torch.Tensor:
    """Gives every parameter a main_grad view of one float32 buffer and the
    hook that accumulates into it (what those frameworks do); the buffer."""
    params = list(model.parameters())
    buffer = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        p.main_grad = buffer[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        p.register_post_accumulate_grad_hook(move_to_main_grad)
    return buffer


def move_to_main_grad(p: torch.Tensor) -> None:
    p.main_grad.add_(p.grad.float())
    p.grad = None


def train(
    model: nn.Module, monitor: Monitor, buffer: torch.Tensor, seed: int, steps: int = 3, forward: nn.Module | None = None
) -> list[torch.Tensor]:
    """Plain SGD on main_grad, the Monitor stepped by hand; the last step's
    gradients. `forward`: what is called (the model under torch.compile)."""
    g = torch.Generator().manual_seed(seed)
    last: list[torch.Tensor] = []
    for _ in range(steps):
        buffer.zero_()
        (model if forward is None else forward)(torch.randn(5, 6, generator=g)).square().mean().backward()
        assert all(p.grad is None for p in model.parameters())
        last = [p.main_grad.clone() for p in model.parameters()]
        monitor.step()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.main_grad
    return last


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("unused", [False, True], ids=["healthy", "unused"])
def test_main_grad_is_read_and_an_unreached_parameter_is_named(unused: bool, compiled: bool) -> None:
    seed = fresh_seed()
    torch.manual_seed(seed)
    model = Net(unused)
    buffer = with_main_grad(model)
    monitor = Monitor(model)
    last = train(model, monitor, buffer, seed, forward=compiled_if(model, compiled))
    report = monitor.report()
    rows = {t["name"]: t for t in report.tensors if t["kind"] == "grad"}
    names = [n for n, _ in model.named_parameters()]
    reached = [n for n in names if not (unused and n.startswith("c."))]
    assert sorted(rows) == sorted(reached), str(report)
    for name, grad in zip(names, last):
        if name in rows:
            ref = reference_stats(grad)
            assert rows[name]["max_abs"] == ref["max_abs"] and rows[name]["numel"] == ref["numel"], name
            assert rows[name]["norm"] == pytest.approx(ref["norm"], rel=1e-6), name
    warnings = [f for f in report.findings if f.severity >= Severity.WARNING]
    if unused:
        (f,) = warnings
        assert f.cause == "unused" and set(f.names) == {"c.weight", "c.bias"}, str(report)
        assert "(gradient read from main_grad)" in f.message
    else:
        assert warnings == [], str(report)


def test_a_parameter_unfrozen_after_the_monitor_was_built_is_read() -> None:
    seed = fresh_seed()
    torch.manual_seed(seed)
    model = Net(unused=False)
    buffer = with_main_grad(model)
    model.c.requires_grad_(False)
    monitor = Monitor(model)
    train(model, monitor, buffer, seed, steps=2)
    model.c.requires_grad_(True)
    train(model, monitor, buffer, seed + 1, steps=2)
    report = monitor.report()
    assert [f for f in report.findings if f.severity >= Severity.WARNING] == [], str(report)
    assert {"c.weight", "c.bias"} <= {t["name"] for t in report.tensors if t["kind"] == "grad"}, str(report)


def test_the_monitor_stays_out_of_a_saved_model() -> None:
    model = Net(unused=False)
    with_main_grad(model)
    monitor = Monitor(model)
    saved = io.BytesIO()
    torch.save(model, saved)
    assert b"zeroscan" not in saved.getvalue() and b"zeroscan" not in pickle.dumps(model)
    monitor.close()
    assert all(len(p._backward_hooks or {}) == 0 for p in model.parameters())
