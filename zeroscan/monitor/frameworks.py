"""The optimizers of frameworks that keep their own copies of the parameters:
DeepSpeed (its engine, the ZeRO 1-3 optimizers, its bf16 and fp16
optimizers) and Megatron-core (ChainedOptimizer, DistributedOptimizer,
Float16OptimizerWithFloat16Params, FP32Optimizer).

Their param groups hold flat fp32 partitions or main copies, not the
model's parameters, and their step may decide, inside, not to update (an
overflow, a found inf). A `Framework` says, for one of them:
  step_owner   whose step() the Monitor wraps: the framework's own (its
               inner torch optimizer runs only on the steps it takes, after
               the gradients have moved);
  groups       an object whose param_groups hold the model's parameters, with
               each group's learning rate read from the inner optimizer;
  source       where the gradients are when the step begins (grad_source.py);
  skipped()    whether the step that just ran updated nothing, told by the
               framework: DeepSpeed's `overflow`, Megatron's returned success.
Recognized by class name and module, so that neither package is imported
here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from zeroscan.monitor.grad_source import GradSource, MainGrad, ZeroPartitions, source_for
from zeroscan.monitor.step_record import Param, StepRecord


class LiveGroup(Mapping[str, Any]):
    """One param group as a framework's model parameters and the inner
    optimizer's group: "params" are the model's, everything else (the lr)
    is read from the inner group as it is now."""

    def __init__(self, params: list[Any], inner: Mapping[str, Any] | None) -> None:
        self._params = params
        self._inner = inner

    def __getitem__(self, key: str) -> Any:
        if key == "params":
            return self._params
        if self._inner is None:
            raise KeyError(key)
        return self._inner[key]

    def __iter__(self) -> Iterator[str]:
        yield "params"
        if self._inner is not None:
            yield from (k for k in self._inner if k != "params")

    def __len__(self) -> int:
        return sum(1 for _ in self)


class Groups:
    """What the Monitor reads as an optimizer's param groups (optimizer.py)."""

    def __init__(self, param_groups: list[LiveGroup]) -> None:
        self.param_groups = param_groups


class Framework:
    def __init__(self, name: str, step_owner: object, groups: Groups, source: GradSource) -> None:
        self.name = name
        self.step_owner = step_owner
        self.groups = groups
        self.source = source

    def skipped(self, returned: Any) -> bool:
        """Whether the step that just returned `returned` updated nothing."""
        return bool(getattr(self.step_owner, "overflow", False))

    def judge(self, record: StepRecord, returned: Any) -> None:
        """The step of `record` returned `returned`: a skipped step, as a
        GradScaler's (steps.py), where it updated nothing."""
        if self.skipped(returned):
            record.stepped = False
            record.skipped_by = self.name


class MegatronFramework(Framework):
    def skipped(self, returned: Any) -> bool:
        # MegatronOptimizer.step() returns (update_successful, grad_norm, num_zeros_in_grad)
        if isinstance(returned, tuple) and returned and isinstance(returned[0], bool):
            return not returned[0]
        return False


def _kind(obj: object) -> tuple[str, str]:
    cls = type(obj)
    return cls.__module__, cls.__name__


def _inner_groups(optimizer: object) -> list[Mapping[str, Any]]:
    groups = getattr(getattr(optimizer, "optimizer", None), "param_groups", None)
    return list(groups) if isinstance(groups, list) else []


def _live(model_groups: list[list[Any]], inner: list[Mapping[str, Any]]) -> list[LiveGroup]:
    return [LiveGroup(list(g), inner[k] if k < len(inner) else None) for k, g in enumerate(model_groups)]


DEEPSPEED_GROUPS = ("bit16_groups", "fp16_groups", "bf16_groups")  # ZeRO 1-2, ZeRO 3 / fp16, bf16


def deepspeed(optimizer: object) -> Framework | None:
    """A DeepSpeedEngine, or one of its wrapping optimizers."""
    module, name = _kind(optimizer)
    if not module.startswith("deepspeed."):
        return None
    if name.endswith("Engine"):  # DeepSpeedEngine, PipelineEngine, DeepSpeedHybridEngine
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            return None
        found = deepspeed(inner)
        if found is not None:
            return found
        # stage 0 in fp32: the engine steps a torch optimizer, the gradients stay in .grad
        return Framework("DeepSpeed", inner, Groups(_live(_plain_groups(inner), _plain_inner(inner))),
                         ZeroPartitions())
    for attribute in DEEPSPEED_GROUPS:
        model_groups = getattr(optimizer, attribute, None)
        if isinstance(model_groups, list) and all(isinstance(g, list) for g in model_groups):
            source = ZeroPartitions(optimizer if "Stage3" in name else None, _fp16_masters(optimizer, model_groups))
            return Framework(f"DeepSpeed {name}", optimizer, Groups(_live(model_groups, _inner_groups(optimizer))),
                             source)
    return None


def _fp16_masters(optimizer: object, model_groups: list[list[Any]]) -> dict[int, Any]:
    """The fp32 master of each parameter under DeepSpeed's stage-0 fp16/bf16
    optimizers (the ZeRO ones keep theirs in the partitions): the unfused
    one's per parameter (`fp32_groups`), the fused one's as views into its
    flat group (`fp32_groups_flat`), in the order of its parameters."""
    out: dict[int, Any] = {}
    per_param = getattr(optimizer, "fp32_groups", None)
    flat = getattr(optimizer, "fp32_groups_flat", None)
    for k, group in enumerate(model_groups):
        if isinstance(per_param, list) and k < len(per_param) and len(per_param[k]) == len(group):
            out.update((id(p), m) for p, m in zip(group, per_param[k]))
        elif isinstance(flat, list) and k < len(flat) and flat[k].numel() == sum(p.numel() for p in group):
            offset = 0
            for p in group:
                out[id(p)] = flat[k].narrow(0, offset, p.numel()).view_as(p)
                offset += p.numel()
    return out


def _plain_groups(optimizer: object) -> list[list[Any]]:
    return [list(g["params"]) for g in getattr(optimizer, "param_groups", [])]


def _plain_inner(optimizer: object) -> list[Mapping[str, Any]]:
    return list(getattr(optimizer, "param_groups", []))


def megatron(optimizer: object) -> Framework | None:
    """A Megatron-core MegatronOptimizer (a ChainedOptimizer of them)."""
    module, name = _kind(optimizer)
    if not module.startswith("megatron."):
        return None
    parts = getattr(optimizer, "chained_optimizers", None)
    members = list(parts) if isinstance(parts, list) else [optimizer]
    groups: list[LiveGroup] = []
    sharding = []  # the DistributedOptimizers
    for member in members:
        inner = _inner_groups(member)
        if hasattr(member, "model_param_group_index_map"):  # DistributedOptimizer
            groups += _sharded_groups(member, inner)
            sharding.append(member)
            continue
        if hasattr(member, "float16_groups"):  # Float16OptimizerWithFloat16Params
            model = [a + b for a, b in zip(member.float16_groups, member.fp32_from_fp32_groups)]
        elif inner:  # FP32Optimizer: its torch optimizer holds the model's parameters
            model = [list(g["params"]) for g in inner]
        else:
            return None
        groups += _live(model, inner)
    ranges = OwnedRanges(sharding) if sharding else None
    return MegatronFramework(f"Megatron {name}", optimizer, Groups(groups), MainGrad(ranges))


def _sharded_groups(optimizer: Any, inner: list[Mapping[str, Any]]) -> list[LiveGroup]:
    """A DistributedOptimizer's groups: the parameters this rank owns a range
    of, in their groups (model_param_group_index_map), and one more group of
    the parameters that its grad buffers hold and other ranks update (their
    group is known on those ranks only; no learning rate is read for it)."""
    owned = optimizer.model_param_group_index_map  # param -> (group, index in it)
    model: list[list[Any]] = [[] for _ in inner]
    for p, (number, _) in owned.items():
        model[number].append(p)
    mine = {id(p) for p in owned}
    elsewhere = [p for b in optimizer.buffers for p in b.params if id(p) not in mine]
    return _live(model, inner) + ([LiveGroup(elsewhere, None)] if elsewhere else [])


class OwnedRanges:
    """The range of a parameter (flat) whose gradient and update this rank
    owns under Megatron's DistributedOptimizers: (0, 0) for none; None
    where none of them holds the parameter."""

    def __init__(self, optimizers: list[Any]) -> None:
        self._by_id = {id(p): optimizer for optimizer in optimizers for b in optimizer.buffers for p in b.params}

    def __call__(self, t: Any) -> tuple[int, int] | None:
        optimizer = self._by_id.get(id(t))
        if optimizer is None:
            return None
        try:
            r = optimizer._get_model_param_range_map(t)["param"]
        except KeyError:  # no element of it in this rank's shard
            return (0, 0)
        return (r.start, r.end)


def gradient_source(op: str, framework: Framework | None, groups: object, params: list[Param]) -> GradSource:
    """Where the Monitor reads the gradients: the framework's convention, or
    the one the parameters show (grad_source.source_for). Raises, in one
    line, for a torch optimizer that a framework steps on flat copies of the
    parameters (DeepSpeed's inner optimizer): its param groups hold none of
    the model's, and each would be called not_in_optimizer."""
    if framework is not None:
        return framework.source
    source = source_for(params)
    held = [t for g in getattr(groups, "param_groups", None) or () for t in g["params"]]
    mine = {id(p.tensor) for p in params}
    if groups is not None and source.moved and not any(id(t) in mine for t in held):
        raise TypeError(
            f"{op}: optimizer {type(groups).__name__} holds none of the model's parameters, but copies of them "
            f"(its gradients are read from {source.where}); pass the optimizer that steps it: the DeepSpeed "
            "engine (or engine.optimizer), or the optimizer get_megatron_optimizer() returned"
        )
    return source


def recognize(optimizer: object) -> Framework | None:
    """The Framework `optimizer` belongs to, or None (a torch optimizer, or
    a wrapper optimizer.py reads as it is)."""
    if optimizer is None:
        return None
    return deepspeed(optimizer) or megatron(optimizer)
