"""The Monitor under Megatron-core's DistributedDataParallel, whose
gradients live in param.main_grad (.grad stays None), with its optimizers:
FP32Optimizer, Float16OptimizerWithFloat16Params (bf16 and fp16, the latter
with its loss scaler, which skips a step that finds inf/NaN) and the
DistributedOptimizer (each rank owns a range of each gradient and of the
fp32 master weights), all in a ChainedOptimizer as get_megatron_optimizer
builds them, on 1 and 2 gloo ranks on the CPU (megatron_on_cpu.py holds
the stand-ins for the few CUDA-only calls).

A healthy run reports no warning and its rows are the full tensors'
(compared with zeroscan.reference_stats of the data-parallel mean of each
rank's own backward, and of the assembled fp32 masters); each planted fault
is named with its cause: a detach, an unused module, a parameter unfrozen
after the optimizer was built (so outside it and outside the grad buffers),
a NaN batch (a step the fp16 loss scaler skips, or NaN weights after a step
that applied it). The main_grad convention alone, without Megatron's
optimizers, is tested too (Monitor(model, None) and Monitor.step())."""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import frameworks

frameworks.require("megatron.core")

from megatron_on_cpu import cuda_on_cpu, init_parallel_state  # noqa: E402
from planted_faults import FAULTS, NAN_STEP, STEPS, Net, named, one_and_two_rank_world  # noqa: E402
from world import Check, World  # noqa: E402
from zeroscan import Monitor, Report, Severity, reference_stats  # noqa: E402

SETUPS = ("ddp-fp32", "ddp-bf16", "ddp-fp16", "distopt-fp32", "distopt-bf16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def full_master(p: nn.Parameter, starts: dict[int, int]) -> torch.Tensor:
    """The fp32 weight the optimizer updates, whole: a DistributedOptimizer's
    shards of it put together (every rank contributes its own range, which
    starts at starts[id(p)])."""
    main = getattr(p, "main_param", None)
    if not getattr(p, "main_param_sharded", False):
        return (main if main is not None else p).detach().float().clone()
    whole = torch.zeros(p.numel(), dtype=torch.float32)
    if main is not None:
        whole[starts[id(p)]:starts[id(p)] + main.numel()] = main.detach().reshape(-1)
    dist.all_reduce(whole)
    return whole.reshape(p.shape)


def train(setup: str, fault: str, rank: int, seed: int) -> tuple[Report, dict[str, tuple], list]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    kind, precision = setup.split("-")
    dtype = DTYPES[precision]
    sharded = kind == "distopt"
    init_parallel_state()
    with cuda_on_cpu():
        torch.manual_seed(seed)  # the same initial weights on every rank
        model = Net(fault).to(dtype)
        if fault == "not_in_optimizer":
            model.c.requires_grad_(False)  # unfrozen below, after DDP and the optimizer were built
        reference = copy.deepcopy(model)
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
        ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=sharded), model
        )
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=1e-3, clip_grad=0.0, bf16=precision == "bf16", fp16=precision == "fp16",
            params_dtype=dtype, use_distributed_optimizer=sharded,
        ), [ddp])
        if fault == "not_in_optimizer":
            model.c.requires_grad_(True)
        starts = {  # where this rank's range of each parameter starts, under the distributed optimizer
            id(p): member._get_model_param_range_map(p)["param"].start
            for member in getattr(optimizer, "chained_optimizers", [optimizer])
            for p in getattr(member, "model_param_group_index_map", {})
        }
        group = dist.group.WORLD if dist.get_world_size() > 1 else None
        monitor = Monitor(model, optimizer, process_group=group, trace_nonfinite=True)
        g = torch.Generator().manual_seed(seed + 1000 * (rank + 1))
        full: dict[str, tuple] = {}
        returned = []
        for step in range(STEPS):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            x = torch.randn(8, 16, generator=g).to(dtype)
            if fault == "nan" and step == NAN_STEP:
                x[0, 0] = float("nan")
            ddp(x).float().pow(2).mean().backward()
            ddp.finish_grad_sync()
            if step == STEPS - 1 and fault == "healthy":
                reference.load_state_dict(model.state_dict())
                reference.zero_grad()
                reference(x).float().pow(2).mean().backward()
                for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                    mean = q.grad.float()
                    dist.all_reduce(mean)
                    full[name] = (mean / dist.get_world_size(), full_master(p, starts))
            returned.append(optimizer.step())
        report = monitor.report()
        monitor.close()
    return report, full, returned


def check_case(setup: str, fault: str, rank: int, world_size: int, seed: int) -> str:
    report, full, returned = train(setup, fault, rank, seed)
    text = str(report)
    warnings = [f for f in report.findings if f.severity >= Severity.WARNING]
    if fault == "healthy":
        assert warnings == [], text
        assert all(r[0] for r in returned), returned
        rows = {(t["name"], t["kind"]): t for t in report.tensors}
        for name, (grad, weight) in full.items():
            for kind, tensor in (("grad", grad), ("weight", weight)):
                row, ref = rows[(name, kind)], reference_stats(tensor)
                assert row["numel"] == ref["numel"] and row["nan"] == ref["nan"], (name, kind, row, ref)
                for key in ("max_abs", "min_abs", "norm"):
                    assert row[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-30), (name, kind, key, row, ref)
        assert "gradient read from main_grad" not in text  # no finding, so no message says where
    elif fault == "detach":
        assert named(report, "detached") == {"a.weight", "a.bias"}, text
        assert "gradient read from main_grad" in text, text
    elif fault == "unused":
        assert named(report, "unused") == {"c.weight", "c.bias"}, text
        assert all(f.cause == "unused" for f in warnings), text
    elif fault == "not_in_optimizer":
        assert named(report, "not_in_optimizer") == {"c.weight", "c.bias"}, text
        assert not named(report, "detached") | named(report, "no_backward") | named(report, "unused"), text
    else:
        origin = report.nonfinite_origin
        assert origin is not None and origin["step"] == NAN_STEP and origin["name"] == "(input batch)", text
        if setup.endswith("fp16"):  # the loss scaler found the inf/NaN and skipped the step
            assert returned[NAN_STEP][0] is False, returned
            (f,) = [f for f in report.findings if f.cause == "skipped_steps"]
            assert "Megatron" in f.message and not named(report, "nonfinite"), text
        else:  # no loss scaler: Megatron applies the step, and the weights turn NaN
            assert named(report, "nonfinite"), text
    return fault


def check_main_grad_alone(fault: str, rank: int, world_size: int, seed: int) -> str:
    """The main_grad convention without Megatron's optimizers: Megatron's own
    DDP, Monitor(model) stepped by hand after finish_grad_sync()."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    init_parallel_state()
    with cuda_on_cpu():
        torch.manual_seed(seed)
        model = Net(fault)
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        monitor = Monitor(model, None, process_group=dist.group.WORLD if dist.get_world_size() > 1 else None)
        g = torch.Generator().manual_seed(seed + rank)
        for _ in range(STEPS):
            ddp.zero_grad_buffer()
            ddp(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
            ddp.finish_grad_sync()
            assert all(p.grad is None for p in model.parameters())  # the convention under test
            monitor.step()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 1e-3 * p.main_grad
        report = monitor.report()
        monitor.close()
    text = str(report)
    assert "0 gradients" not in text.splitlines()[0], text
    warnings = [f for f in report.findings if f.severity >= Severity.WARNING]
    if fault == "healthy":
        assert warnings == [], text
    else:
        assert named(report, "unused") == {"c.weight", "c.bias"} and len(warnings) == 1, text
    return fault


CHECKS: dict[str, Check] = {
    f"{setup}-{fault}": functools.partial(check_case, setup, fault)
    for setup, fault in itertools.product(SETUPS, FAULTS)
}
CHECKS["main_grad-healthy"] = functools.partial(check_main_grad_alone, "healthy")
CHECKS["main_grad-unused"] = functools.partial(check_main_grad_alone, "unused")


world = one_and_two_rank_world(CHECKS)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("case", list(CHECKS))
def test_megatron_runs_are_diagnosed(world: World, case: str) -> None:
    world.assert_passed(case)
