"""What the Monitor sees around a step that its scan of the tensors does not.

- the autocast state the model's forward pass began in, per device type of
  the parameters (read in the root forward pre-hook);
- whether a torch.amp.GradScaler ran the optimizer step: GradScaler.step
  calls optimizer.step(), whose pre-hook the Monitor's step hook is, so the
  scaler is on the stack of that hook (a frame of torch/amp/grad_scaler.py
  holding it as `self`);
- which parameters entered float16 ops in the probed forward pass (probe.py:
  an op that took the float32 parameter and gave a float16 result, as
  autocast's matmuls and convolutions do);
- which parameters reach the outputs only through a normalizing op
  (graph.normalizer_gates, on the probed forward pass's graph);
- how many in-place writes the gradients took between the end of backward()
  and the optimizer step (their version counters: clip_grad_value_ makes
  two, clamp_min_ and clamp_max_; clip_grad_norm_ one);
- whether the model runs as a stage of a torch.distributed.pipelining
  schedule (the schedule's stage is on the stack of the forward pass), and
  whether its forward detached its own input.

None of this reads a tensor's values. Parameters are named, not numbered,
so that a record keeps its meaning when the model's parameters change.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any, Literal, NamedTuple

import torch

from zeroscan.monitor.backward import GradState
from zeroscan.monitor.graph import normalizer_gates
from zeroscan.monitor.step_record import Param

MAX_FRAMES = 48  # frames looked up from a hook: GradScaler.step and a pipeline schedule sit within a dozen
# "enabled": a GradScaler that scales ran the step; "disabled": one created with enabled=False;
# "none": optimizer.step() ran without a GradScaler; None: not known (Monitor.step() called by hand).
ScalerState = Literal["enabled", "disabled", "none"] | None


class Stage(NamedTuple):
    """The torch.distributed.pipelining stage the model runs as: its index (0-based) and how many there are."""

    index: int
    count: int


class InputCut(NamedTuple):
    """A cut the model's forward made on its own input (which requires grad): what cut it, and the module where."""

    how: str
    where: str


@dataclass(frozen=True)
class StepContext:
    """What the Monitor saw around one monitored step (see the module doc)."""

    autocast: torch.dtype | None  # the dtype autocast ran the forward pass in; None: autocast was off
    scaler: ScalerState
    half: dict[str, str] | None  # parameter -> the module whose op took it into float16; None: not probed
    gates: dict[str, frozenset[str]] | None  # parameter -> the normalizing ops every way to the outputs crosses
    # How many in-place writes the gradients took after backward(): the distinct counts over the
    # nonempty gradients there then and now (0 included); None: not known.
    writes: frozenset[int] | None
    stage: Stage | None
    input_cut: InputCut | None


def autocast_dtype(device_types: set[str]) -> torch.dtype | None:
    """The dtype autocast is on with now for one of `device_types`, or None."""
    for device_type in sorted(device_types):
        try:
            if torch.is_autocast_enabled(device_type):
                return torch.get_autocast_dtype(device_type)
        except (RuntimeError, TypeError, ValueError):  # a device type autocast does not know
            continue
    return None


def _frames(start: FrameType | None) -> list[FrameType]:
    out = []
    frame = start
    while frame is not None and len(out) < MAX_FRAMES:
        out.append(frame)
        frame = frame.f_back
    return out


def _in_torch(frame: FrameType, path: str) -> bool:
    return frame.f_code.co_filename.replace("\\", "/").endswith(path)


def scaler_state() -> ScalerState:
    """Whether a GradScaler runs the optimizer step that calls this (see the module doc)."""
    in_optimizer_step = False
    for frame in _frames(sys._getframe(1)):
        if _in_torch(frame, "torch/amp/grad_scaler.py"):
            enabled = getattr(frame.f_locals.get("self"), "_enabled", None)
            if isinstance(enabled, bool):
                return "enabled" if enabled else "disabled"
        in_optimizer_step = in_optimizer_step or _in_torch(frame, "torch/optim/optimizer.py")
    return "none" if in_optimizer_step else None


def pipeline_stage() -> Stage | None:
    """The torch.distributed.pipelining stage whose forward calls this, if any."""
    for frame in _frames(sys._getframe(1)):
        if "torch/distributed/pipelining/" in frame.f_code.co_filename.replace("\\", "/"):
            stage = frame.f_locals.get("self")
            index, count = getattr(stage, "stage_index", None), getattr(stage, "num_stages", None)
            if isinstance(index, int) and isinstance(count, int):
                return Stage(index, count)
    return None


WRITE_SAMPLES = 16  # gradients whose in-place writes since backward are counted, per step


def grad_writes(params: list[Param], backward: GradState | None) -> frozenset[int] | None:
    """The distinct numbers of in-place writes into the nonempty gradients
    since `backward` (the gradients as backward() left them), over at most
    WRITE_SAMPLES of them spread over the list, so that its cost does not
    grow with the model (a clipping call writes every gradient alike); a
    gradient replaced or cleared since is left out. None when `backward` is
    not known."""
    if backward is None:
        return None
    counts: set[int] = set()
    looked = range(0, len(params), max(1, len(params) // WRITE_SAMPLES))
    for k in looked[:WRITE_SAMPLES]:
        p, was = params[k], backward[k] if k < len(backward) else None
        g = p.tensor.grad
        if was is not None and g is not None and was[0]() is g and g.numel():
            counts.add(g._version - was[1])
    return frozenset(counts)


class ContextWatch:
    """Gathers a StepContext over one monitored step: the forward pass's
    autocast and pipeline stage as it begins, what the probe saw (kept until
    the next probe), and the GradScaler and gradient writes at the step."""

    def __init__(self, params: list[Param]) -> None:
        self._params = params
        self._device_types = {p.tensor.device.type for p in params}
        self._autocast: torch.dtype | None = None
        self._stage: Stage | None = None
        self._half: dict[str, str] | None = None
        self._gates: dict[str, frozenset[str]] | None = None
        self._input_cut: InputCut | None = None

    def forward_started(self) -> None:
        """A monitored forward pass of the model begins (the root forward pre-hook)."""
        try:
            self._autocast = autocast_dtype(self._device_types)
            self._stage = pipeline_stage()
        except Exception:  # a hint only: never worth breaking the forward pass for
            self._autocast, self._stage = None, None

    def probed(self, half: dict[int, str], input_cut: tuple[str, str] | None, roots: list[Any],
               index: dict[int, int]) -> None:
        """A probed forward pass ended: `half` and `input_cut` as the probe
        saw them; `roots`: the grad_fns of its outputs; `index`: the graph
        walks' parameter index (wrappers' stand-ins included)."""
        names = [p.name for p in self._params]
        self._half = {names[i]: where for i, where in half.items()}
        self._input_cut = InputCut(*input_cut) if input_cut is not None else None
        try:
            gates = normalizer_gates(roots, index) if roots else {}
        except Exception:  # a graph node that cannot be read: no gate known
            gates = {}
        self._gates = {names[i]: kinds for i, kinds in gates.items()}

    def stamp(self, backward: GradState | None) -> StepContext:
        """The context of the step whose optimizer step runs now (see the module
        doc); `backward`: the gradients as backward() left them, where known."""
        return StepContext(
            self._autocast, scaler_state(), self._half, self._gates, grad_writes(self._params, backward),
            self._stage, self._input_cut,
        )
