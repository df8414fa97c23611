"""The Monitor under DeepSpeed ZeRO 0-3, fp32 and bf16, on 1 and 2 gloo
ranks on the CPU (DS_ACCELERATOR=cpu), through
zeroscan.integrations.deepspeed.monitor(engine): where the gradients are
not in .grad when the step begins (grad_source.py), and the step may be
skipped inside DeepSpeed's optimizer (frameworks.py).

Each case is a healthy run with no warning, whose every gradient and weight
row is the full tensor's (compared with zeroscan.reference_stats of
DeepSpeed's own safe_get_full_grad / safe_get_full_fp32_param, on fresh
random inputs), or one planted fault, named with its cause: a detach, an
unused module, parameters left out of the optimizer, a NaN batch (a step
DeepSpeed skips, listed with where the NaN was born)."""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import logging
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import frameworks

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported, here and in the spawned ranks
frameworks.require("deepspeed")

from planted_faults import FAULTS, NAN_STEP, STEPS, Net, named, one_and_two_rank_world  # noqa: E402
from world import Check, World  # noqa: E402
from zeroscan import Report, Severity, reference_stats  # noqa: E402

STAGES = (0, 1, 2, 3)
DTYPES = ("fp32", "bf16")
# bf16 weights with fp32 gradient accumulation: at stage 1 DeepSpeed's BF16_Optimizer, not the ZeRO one.
BF16_OPTIMIZER = (1, "bf16-fp32acc")


def engine_of(stage: int, dtype: str, fault: str, rank: int, seed: int) -> Any:
    """A DeepSpeed engine of a Net, on the world's process group."""
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    # What a launcher sets (the process group itself is world.py's): DeepSpeed checks for it.
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(dist.get_world_size()))
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = Net(fault)
    params = [p for n, p in model.named_parameters() if not (fault == "not_in_optimizer" and n.startswith("c."))]
    config: dict = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        # DeepSpeed clips at 1.0 by default: at stage 0 in fp32 before its torch optimizer's step,
        # where the Monitor reads, elsewhere inside its own step, after. The healthy rows are
        # compared with the gradients as backward left them, so nothing is clipped here.
        "gradient_clipping": 0.0,
    }
    if dtype.startswith("bf16"):
        config["bf16"] = {"enabled": True}
    if dtype == "bf16-fp32acc":
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=params)
    return engine


def batch(dtype: str, g: torch.Generator) -> torch.Tensor:
    return torch.randn(8, 16, generator=g).to(torch.bfloat16 if dtype.startswith("bf16") else torch.float32)


def train(stage: int, dtype: str, fault: str, rank: int, seed: int) -> tuple[Report, dict[str, tuple], Any]:
    """STEPS steps of a DeepSpeed engine under zeroscan's integration; the
    full gradients and fp32 weights of the last step, as DeepSpeed assembles them."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    import zeroscan.integrations.deepspeed as zs_deepspeed

    engine = engine_of(stage, dtype, fault, rank, seed)
    monitor = zs_deepspeed.monitor(engine, trace_nonfinite=True)
    g = torch.Generator().manual_seed(seed + 1000 * (rank + 1))
    full: dict[str, tuple] = {}
    for step in range(STEPS):
        x = batch(dtype, g)
        if fault == "nan" and step == NAN_STEP:
            x[0, 0] = float("nan")
        engine.backward(engine(x).float().pow(2).mean())
        if step == STEPS - 1 and fault == "healthy":
            for name, p in engine.module.named_parameters():
                grad = safe_get_full_grad(p) if p.requires_grad else None
                weight = safe_get_full_fp32_param(p) if stage > 0 else stage0_master(engine, p)
                full[name] = (None if grad is None else grad.clone(), None if weight is None else weight.clone())
        engine.step()
    report = monitor.report()
    monitor.close()
    return report, full, engine


def stage0_master(engine: Any, p: torch.Tensor) -> torch.Tensor:
    """The weight the optimizer updates at stage 0: the parameter in fp32,
    or the fp32 copy DeepSpeed's unfused fp16/bf16 optimizer keeps of it."""
    for low, high in zip(getattr(engine.optimizer, "fp16_groups", []), getattr(engine.optimizer, "fp32_groups", [])):
        for q, master in zip(low, high):
            if q is p:
                return master.detach()
    assert p.dtype == torch.float32, f"no fp32 master found for a {p.dtype} parameter"
    return p.detach()


def assert_rows_are_full_tensors(report: Report, full: dict[str, tuple]) -> None:
    """Every row of the report is the full tensor's: numel, counts and
    min/max exact, norm and mean to float32 summation accuracy."""
    rows = {(t["name"], t["kind"]): t for t in report.tensors}
    for name, (grad, weight) in full.items():
        for kind, tensor in (("grad", grad), ("weight", weight)):
            if tensor is None:
                continue
            row = rows[(name, kind)]
            ref = reference_stats(tensor)
            assert row["numel"] == ref["numel"], (name, kind, row["numel"], ref["numel"])
            assert row["nan"] == ref["nan"] and row["max_abs"] == ref["max_abs"], (name, kind, row, ref)
            assert row["min_abs"] == ref["min_abs"], (name, kind, row["min_abs"], ref["min_abs"])
            assert row["zero_fraction"] * ref["numel"] == pytest.approx(ref["zeros"]), (name, kind)
            assert row["norm"] == pytest.approx(ref["norm"], rel=1e-5, abs=1e-30), (name, kind, row["norm"], ref)


def check_case(stage: int, dtype: str, fault: str, rank: int, world_size: int, seed: int) -> str:
    report, full, engine = train(stage, dtype, fault, rank, seed)
    if dtype == "bf16-fp32acc":
        assert type(engine.optimizer).__name__ == "BF16_Optimizer", type(engine.optimizer)
    text = str(report)
    warnings = [f for f in report.findings if f.severity >= Severity.WARNING]
    if fault == "healthy":
        assert warnings == [], text
        assert f"{len(full)} gradients, {len(full)} weights scanned" in text.splitlines()[0], text
        assert_rows_are_full_tensors(report, full)
    elif fault == "detach":
        assert named(report, "detached") == {"a.weight", "a.bias"}, text
    elif fault == "unused":
        assert named(report, "unused") == {"c.weight", "c.bias"}, text
        assert all(f.cause == "unused" for f in warnings), text
    elif fault == "not_in_optimizer":
        assert named(report, "not_in_optimizer") == {"c.weight", "c.bias"}, text
        assert not named(report, "detached") | named(report, "grad_cleared") | named(report, "no_backward"), text
    else:  # nan: DeepSpeed skips the step where it keeps fp32 masters; stage 0 in fp32 applies it
        skipped = engine.skipped_steps  # type: ignore[attr-defined]
        origin = report.nonfinite_origin
        assert origin is not None and origin["step"] == NAN_STEP and origin["name"] == "(input batch)", text
        if skipped:
            (f,) = [f for f in report.findings if f.cause == "skipped_steps"]
            assert f"1 of {STEPS}" in f.message and "DeepSpeed" in f.message, text
            assert not named(report, "nonfinite"), text  # the weights stayed finite
        else:
            assert stage == 0 and dtype == "fp32", f"DeepSpeed applied the NaN step at stage {stage} {dtype}"
            assert named(report, "nonfinite"), text
    assert not named(report, "grad_cleared"), text
    return fault


def check_monitor_of_the_module(stage: int, rank: int, world_size: int, seed: int) -> str:
    """Monitor(engine.module) stepped by hand between engine.backward() and
    engine.step() reads the gradients where DeepSpeed keeps them (the ZeRO
    marks on the parameters tell where); given the torch optimizer inside
    DeepSpeed's, which holds flat copies, the Monitor refuses in one line."""
    from zeroscan import Monitor

    engine = engine_of(stage, "bf16", "healthy", rank, seed)
    with pytest.raises(TypeError, match=r"optimizer AdamW holds none of the model's parameters.*DeepSpeed engine"):
        Monitor(engine.module, engine.optimizer.optimizer)
    group = dist.group.WORLD if world_size > 1 else None
    monitor = Monitor(engine.module, None, process_group=group)
    g = torch.Generator().manual_seed(seed + rank)
    for _ in range(STEPS):
        engine.backward(engine(batch("bf16", g)).float().pow(2).mean())
        monitor.step()
        engine.step()
    report = monitor.report()
    monitor.close()
    assert [f for f in report.findings if f.severity >= Severity.WARNING] == [], str(report)
    assert "8 gradients, 8 weights scanned" in str(report).splitlines()[0], str(report)
    return "ok"


CHECKS: dict[str, Check] = {
    f"zero{stage}-{dtype}-{fault}": functools.partial(check_case, stage, dtype, fault)
    for (stage, dtype), fault in itertools.product([*itertools.product(STAGES, DTYPES), BF16_OPTIMIZER], FAULTS)
}
CHECKS |= {f"zero{stage}-monitor_of_the_module": functools.partial(check_monitor_of_the_module, stage) for stage in (1, 2, 3)}


world = one_and_two_rank_world(CHECKS)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("case", list(CHECKS))
def test_deepspeed_zero_runs_are_diagnosed(world: World, case: str) -> None:
    world.assert_passed(case)


@pytest.mark.integration
def test_the_integration_refuses_what_is_not_an_engine() -> None:
    import zeroscan.integrations.deepspeed as zs_deepspeed

    with pytest.raises(TypeError, match=r"engine must be the DeepSpeedEngine .*got Linear"):
        zs_deepspeed.monitor(nn.Linear(2, 2))
