"""zeroscan in a DeepSpeed training loop: one call builds the Monitor from
the engine, whatever its ZeRO stage and precision.

    import zeroscan.integrations.deepspeed as zs_deepspeed

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=params)
    monitor = zs_deepspeed.monitor(engine)
    for batch in data:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
    print(monitor.report())

It is Monitor(engine.module, engine, process_group=<the group ZeRO
partitions over>): the Monitor scans at the step of the engine's own
optimizer (the ZeRO 1-3 optimizer, or its bf16/fp16 optimizer), reads each
gradient where DeepSpeed keeps it when that step begins (this rank's
partition, merged across the data-parallel group; zeroscan.monitor's
grad_source.py), reads the fp32 master weights that the step updates, and
counts a step that DeepSpeed skipped (an overflow: inf/NaN gradients) as a
skipped step. On one rank no process group is used. Keyword arguments go to
the Monitor (every, trace_nonfinite, thresholds, ...).

The loop is the user's, so its reports go where it sends them: to any
sink (zeroscan.loggers.Sink), as the other integrations send theirs,

    sink.log(zeroscan.loggers.scalars(report, summary=True), engine.global_steps)
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zeroscan.integrations import common
from zeroscan.monitor import Monitor

# Imported now, so that without DeepSpeed the import of this module fails
# with an error that names zeroscan's extra.
deepspeed = common.require("deepspeed", "deepspeed", "zeroscan.integrations.deepspeed")

__all__ = ["monitor"]

MONITOR = "zeroscan.integrations.deepspeed.monitor"


def monitor(engine: Any, **kwargs: Any) -> Monitor:
    """A Monitor of a DeepSpeedEngine's model, scanned at each of its steps (see the module doc)."""
    if not isinstance(engine, deepspeed.DeepSpeedEngine):
        raise TypeError(f"{MONITOR}: engine must be the DeepSpeedEngine that deepspeed.initialize() returned, "
                        f"got {type(engine).__name__}")
    if "process_group" not in kwargs:
        kwargs["process_group"] = _partition_group(engine)
    return Monitor(engine.module, engine, **kwargs)


def _partition_group(engine: Any) -> dist.ProcessGroup | None:
    """The data-parallel group ZeRO partitions over (None on one rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = getattr(engine.optimizer, "dp_process_group", None) or getattr(engine, "data_parallel_group", None)
    group = group if group is not None else dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None
