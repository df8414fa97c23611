"""The cause analysis under DDP, FSDP2 (fully_shard) and tensor-parallel
DTensor parameters, on a 2-rank gloo world: the same causes, in the same
words, as on the plain model (test_monitor_causes.py).

FSDP2 swaps each module's sharded parameters for unsharded ones during its
forward and runs hooks of its own; the probe must see through both. DDP
runs the model inside its own forward and all-reduces in its own hooks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from test_monitor_causes import BEFORE_CUT, Chain, Heads, both, zeroing_hook
from world import Check, World, spawn_world
from zeroscan import Monitor, Report

WORLD = 2
WORLD_TIMEOUT_S = 120.0
COLLECTIVE_TIMEOUT_S = 30.0


def run(model: nn.Module, target: nn.Module, loss_of: Callable[[object], torch.Tensor], rank: int, seed: int,
        group: bool = True) -> Report:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed + rank)
    monitor = Monitor(target, opt, process_group=dist.group.WORLD if group else None)
    for _ in range(3):
        opt.zero_grad()
        loss_of(model(torch.randn(5, 6, generator=g))).backward()
        opt.step()
    report = monitor.report()
    monitor.close()
    return report


def grads(report: Report) -> str:
    """The gradient findings as cause and names, one per line: the same on every rank."""
    return "\n".join(
        f"{f.cause.value} {sorted(n.removeprefix('module.') for n in (f.names or (f.name,)))}"
        for f in report.findings if f.kind == "grad"
    )


def square(out: object) -> torch.Tensor:
    assert isinstance(out, torch.Tensor)
    return out.square().mean()


def check_fsdp2_cut(how: str, rank: int, world_size: int, seed: int) -> str:
    """FSDP2 with a cut after block1: inp and block1 are detached, one finding, never "unused"."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(seed)
    model = Chain(how)
    for block in (model.inp, model.block1, model.block2):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    report = run(model, model, square, rank, seed)
    found = [f for f in report.findings if f.kind == "grad"]
    if how == "function":
        # FSDP2's gradient reduction turns the None the Function gives into zeros on the
        # inputs' side: the Function is named, for every parameter before it, never "unused".
        assert {m.name for f in found for m in (f.members or (f,))} == BEFORE_CUT, str(report)
        assert all("DropsGrad" in f.message for f in found), str(report)
        return grads(report)
    assert len(found) == 1 and found[0].cause == "detached", str(report)
    assert set(found[0].names) == BEFORE_CUT, str(report)
    other = "torch.no_grad()" if how == "detach" else ".detach()"
    assert other not in found[0].message, str(report)  # FSDP's own ops under no_grad cut nothing of the model's
    return grads(report)


def check_ddp_cut(rank: int, world_size: int, seed: int) -> str:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(seed)
    ddp = DistributedDataParallel(Chain("detach"), find_unused_parameters=True)
    report = run(ddp, ddp, square, rank, seed)
    found = [f for f in report.findings if f.kind == "grad"]
    assert len(found) == 1 and found[0].cause == "detached" and ".detach()" in found[0].message, str(report)
    assert {n.removeprefix("module.") for n in found[0].names} == BEFORE_CUT, str(report)
    return grads(report)


def check_ddp_zeroing_hook(rank: int, world_size: int, seed: int) -> str:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(seed)
    model = Heads()
    model.head_a.weight.register_hook(zeroing_hook)
    ddp = DistributedDataParallel(model)
    report = run(ddp, ddp, lambda out: both(*out), rank, seed)
    (f,) = [f for f in report.findings if f.kind == "grad"]
    assert f.cause == "exact_zero" and "zeroing_hook" in f.message and f.name == "module.head_a.weight", str(report)
    return grads(report)


def check_ddp_output_left_out(rank: int, world_size: int, seed: int) -> str:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(seed)
    ddp = DistributedDataParallel(Heads(), find_unused_parameters=True)
    report = run(ddp, ddp, lambda out: out[0].square().mean(), rank, seed)
    (f,) = [f for f in report.findings if f.kind == "grad"]
    assert f.cause == "unused" and "never enters the loss" in f.message, str(report)
    assert "autograd.grad" not in f.message
    return grads(report)


class Parallel(nn.Module):
    """A column- then row-parallel pair of Linears (DTensor parameters) with a cut in between."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 8)
        self.down = nn.Linear(8, 6)
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.tanh(self.up(x))).detach()
        return self.out(torch.tanh(h))


def check_tensor_parallel_cut(rank: int, world_size: int, seed: int) -> str:
    from torch.distributed.tensor import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(seed)
    model = parallelize_module(Parallel(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    g = torch.Generator().manual_seed(seed)  # the same batch on every rank, as tensor parallelism wants
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = Monitor(model, opt, process_group=dist.group.WORLD)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 6, generator=g)).square().mean().backward()
        opt.step()
    report = monitor.report()
    monitor.close()
    (f,) = [f for f in report.findings if f.kind == "grad"]
    assert f.cause == "detached" and set(f.names) == {"up.weight", "up.bias", "down.weight", "down.bias"}, str(report)
    return grads(report)


CHECKS: dict[str, Check] = {
    "fsdp2_detach": functools.partial(check_fsdp2_cut, "detach"),
    "fsdp2_no_grad": functools.partial(check_fsdp2_cut, "no_grad"),
    "fsdp2_function": functools.partial(check_fsdp2_cut, "function"),
    "ddp_detach": check_ddp_cut,
    "ddp_zeroing_hook": check_ddp_zeroing_hook,
    "ddp_output_left_out": check_ddp_output_left_out,
    "tensor_parallel_detach": check_tensor_parallel_cut,
}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return spawn_world(
        WORLD, CHECKS, tmp_path_factory, timeout_s=WORLD_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S
    )


@pytest.mark.parametrize("check", list(CHECKS))
def test_the_cause_is_the_same_under_distributed_wrappers(world: World, check: str) -> None:
    world.assert_passed(check)
