"""A Monitor given no process_group on a model of DTensor parameters
(FSDP2, tensor parallelism: what torchtitan builds), on a 2-rank gloo
world: where every parameter is a DTensor on one mesh, the mesh's group is
used, so every tensor is scanned and merged as with process_group=; where
there is no one such group (plain parameters beside DTensors), one WARNING
says which argument to pass, instead of scanning nothing quietly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroscan
from world import Check, World, spawn_world
from zeroscan import Monitor, Severity

WORLD = 2


def fit(model: nn.Module, rank: int, seed: int, steps: int = 3) -> tuple[zeroscan.Report, dict]:
    """`steps` SGD steps under Monitor(model, opt) with no process_group;
    the full gradients and weights of the last step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = Monitor(model, opt)
    g = torch.Generator().manual_seed(seed + 100 + rank)
    full: dict[str, tuple] = {}
    for step in range(steps):
        opt.zero_grad()
        model(torch.randn(7, 6, generator=g, dtype=torch.float64)).square().mean().backward()
        if step == steps - 1:
            full = {
                name: tuple(t.full_tensor() if hasattr(t, "full_tensor") else t.detach() for t in (p.grad, p))
                for name, p in model.named_parameters()
            }
        opt.step()
    report = monitor.report()
    monitor.close()
    return report, full


def model_of(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1)).double()


def check_fsdp2_uses_the_mesh_group(rank: int, world_size: int, seed: int) -> str:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    model = model_of(seed)
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    report, full = fit(model, rank, seed)
    assert [f for f in report.findings if f.severity >= Severity.WARNING or f.cause == "not_scanned"] == [], str(report)
    rows = {(t["name"], t["kind"]): t for t in report.tensors}
    for name, (grad, weight) in full.items():
        for kind, tensor in (("grad", grad), ("weight", weight)):
            ref = zeroscan.reference_stats(tensor)
            row = rows[(name, kind)]
            assert row["numel"] == ref["numel"] and row["max_abs"] == ref["max_abs"], (name, kind, row, ref)
            assert row["norm"] == pytest.approx(ref["norm"], rel=1e-9), (name, kind, row, ref)
    return f"{len(rows)} rows"


def check_mixed_parameters_warn(rank: int, world_size: int, seed: int) -> str:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    model = model_of(seed)
    fully_shard(model[0], mesh=init_device_mesh("cpu", (WORLD,)))  # the rest stays plain tensors
    report, _ = fit(model, rank, seed)
    (f,) = [f for f in report.findings if f.cause == "not_scanned" and f.severity == Severity.WARNING]
    assert "2 of 6 parameters are DTensors" in f.message and "process_group=" in f.message, f.message
    return f.cause


CHECKS: dict[str, Check] = {
    "fsdp2_uses_the_mesh_group": check_fsdp2_uses_the_mesh_group,
    "mixed_parameters_warn": check_mixed_parameters_warn,
}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return spawn_world(WORLD, CHECKS, tmp_path_factory, timeout_s=180.0, collective_timeout_s=60.0)


@pytest.mark.parametrize("check", list(CHECKS))
def test_dtensor_parameters_without_a_process_group(world: World, check: str) -> None:
    world.assert_passed(check)
