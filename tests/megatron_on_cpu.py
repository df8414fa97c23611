"""Megatron-core on the CPU, for the tests: the stand-ins for its CUDA-only
calls, all of them here.

Megatron-core's DistributedDataParallel and optimizers run their arithmetic
with torch ops that work on any device, but they name CUDA outright in a few
places; on a CPU-only torch each of those raises. While `cuda_on_cpu()` is
entered:
  - a tensor made with device="cuda" (or a device index) is made on the CPU
    (torch.zeros(..., device="cuda") for the grad buffers and the loss scale);
  - torch.cuda.current_device() answers "cpu" (where buffers are allocated);
  - Tensor.type() of a CPU tensor answers with its CUDA name, since the
    optimizers check that the parameters they wrap are "torch.cuda.*Tensor".
Nothing else of Megatron is replaced: its parallel state, bucketing,
reduce-scatter and all-reduce (over gloo), main_grad buffers, fp32 master
weights, loss scaling and found-inf checks run as they do on GPUs. Gradient
clipping stays off (config.clip_grad=0): its multi-tensor path asserts CUDA
tensors by type in a way no stand-in here reaches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class _CudaOnCpu(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and (isinstance(device, int) or "cuda" in str(device)):
            kwargs["device"] = "cpu"
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(out, str):
            return out.replace("torch.", "torch.cuda.", 1)
        return out


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[None]:
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        with _CudaOnCpu():
            yield
    finally:
        torch.cuda.current_device = current_device  # type: ignore[assignment]


def init_parallel_state() -> None:
    """Megatron's parallel groups over the already initialized (gloo) world:
    data-parallel over every rank, no tensor or pipeline parallelism."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
