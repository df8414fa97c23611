"""zeroscan.guard: skip an optimizer step whose gradients hold NaN or Inf,
decided on the device, with no host sync.

A StepGuard hooks `optimizer.step()`. Its pre-step hook scans the present
gradients of the guarded parameters (None ones are skipped) with one native
stats_many pass per device into `bad`, a 0-d bool tensor on the device. No
one reads `bad` on the host; the step is skipped by device-side means:

- Fused optimizers (`_step_supports_amp_scaling`: Adam, AdamW, SGD with
  fused=True) take GradScaler's route. The guard sets `optimizer.found_inf`
  to a float32 0-d tensor holding exactly 1.0 on a bad step (the fused CPU and
  CUDA kernels return early only on `*found_inf == 1`), OR-ed with a
  found_inf that GradScaler already set, and puts the attribute back after the
  step. torch/optim/adam.py (torch 2.13) adds 1 to every `state['step']`
  before the kernel (line 876) and subtracts found_inf after it (lines
  896-899): a skipped step leaves `step` bit-identical (while step < 2**24,
  where float32 counts exactly). No copies: no memory cost.
- Any other optimizer (for-loop, foreach, third-party) steps as usual, but
  the guard first copies every parameter of the optimizer and every tensor of
  its state, and after the step selects `torch.where(bad, copy, current)`
  back into each one in place (the update may hold NaN: select, never blend).
  A bad step ends bit-identical to before, step count included; a good one is
  untouched. The copies double the memory of parameters plus state while the
  step runs. State entries that are not tensors are not restored.

State created by the step itself (a parameter's first step) has no copy: on a
bad step it is zero-filled. That is exactly Adam/AdamW's initial state. SGD
creates its momentum buffer from the first gradient instead; from a zero
buffer the next step computes momentum * 0 + (1 - dampening) * grad, the same
values when dampening is 0 (the default; +0.0 where the gradient holds -0.0).
Fused SGD leaves that buffer uninitialized (torch.empty_like, sgd.py line
511) when its first step is skipped; zeroing repairs it. Optimizers whose
lazy state starts elsewhere (NAdam, ASGD, Rprop) should take one clean step
before being guarded.

Non-capturable, non-fused Adam-family optimizers keep `state['step']` on the
CPU even for CUDA parameters; selecting it with a device `bad` would need a
sync, so guard() refuses them and asks for capturable=True or fused=True.
Sparse gradients are refused at step time (coalescing them would sync), and
so are DTensor ones: every rank must decide alike, as ranks holding the same
all-reduced (DDP) gradients do, and ranks holding shards would not.

Counting is device-side too: int64 counters of steps and skipped steps, and a
ring of the last `keep` skipped steps (step index, which guarded gradients
held NaN/Inf), written by index_copy_ at row `skipped % keep` on a bad step
and at a spare row otherwise. report() reads them back (that syncs).

The step path has no host read and no value-dependent branch or allocation,
so an eager step can be captured in a CUDA graph once a warm-up step has run
(the first step with a given pattern of None gradients copies a small index
to the device). nonfinite_flags traces under torch.compile(fullgraph=True);
inside a compiled optimizer.step() the hooks run eagerly (see below).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from zeroscan import ops
from zeroscan.ops import is_dtensor, unreadable  # importing zeroscan.ops registers the native ops
from zeroscan.result_row import NONFINITE
from zeroscan.stats import device_groups

OP = "zeroscan.guard"
MISSING: Any = object()  # the optimizer had no found_inf attribute
UNTOUCHED: Any = object()  # the guard did not set found_inf (the snapshot path)
# optimizer -> id of its guard (not the guard itself, which holds the optimizer and would keep it alive)
_GUARDS: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()


def nonfinite_flags(grads: list[Tensor]) -> Tensor:
    """bool [len(grads)]: which tensors (all on one device) hold a NaN or an
    infinity. One native pass; nothing is read on the host."""
    rows = ops.stats_many(grads, None)
    return rows[:, NONFINITE].sum(dim=1) > 0


@dataclass(frozen=True)
class SkippedStep:
    step: int  # counted from 0: the first optimizer.step() after guard() is step 0
    params: list[str]  # the guarded parameters whose gradients held NaN/Inf


@dataclass(frozen=True)
class GuardReport:
    steps: int
    skipped: int
    skipped_steps: list[SkippedStep]  # the last `keep` skipped steps, oldest first
    # Guarded gradients left out of a step's scan because their memory could
    # not be read (freed, as FSDP frees with resize_(0)): name -> why, the latest.
    not_scanned: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        text = f"skipped {self.skipped} of {self.steps} steps"
        if self.skipped_steps:
            shown = [f"step {s.step}: {_some(s.params)}" for s in self.skipped_steps]
            if self.skipped > len(self.skipped_steps):
                text += f" (the last {len(self.skipped_steps)} listed)"
            text += "; " + "; ".join(shown) + " (NaN/Inf in gradients)"
        if self.not_scanned:
            text += f"; not scanned at some steps: {_some(list(self.not_scanned))} (their memory could not be read)"
        return text


def _some(names: list[str], most: int = 4) -> str:
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


class _OpenStep(NamedTuple):
    """What the pre-step hook leaves for the post-step hook."""

    flags: Tensor  # bool [P] on the home device
    bad: Tensor  # 0-d bool on the home device
    params: list[Tensor]  # every parameter of the optimizer
    copies: list[Tensor] | None  # their copies; None on the fused path
    state: list[dict[str, Tensor | None]]  # per parameter: its state tensors' copies (None: fused path)
    found_inf: Any  # the optimizer's found_inf before the step, MISSING or UNTOUCHED


class StepGuard:
    """Makes `optimizer.step()` a no-op for a step whose gradients hold NaN/Inf
    (see the module doc); built by zeroscan.guard(). `with` removes it."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        params: Iterable[Tensor] | None = None,
        names: Mapping[Tensor, str] | nn.Module | None = None,
        keep: int = 16,
    ) -> None:
        self._install("zeroscan.StepGuard", optimizer, params, names, keep)

    @classmethod
    def _built_by(
        cls, op: str, optimizer: object, params: object, names: object, keep: object
    ) -> StepGuard:
        """A StepGuard whose refusals of its arguments name the public call `op`."""
        made = cls.__new__(cls)
        made._install(op, optimizer, params, names, keep)
        return made

    def _install(self, op: str, optimizer: Any, params: Any, names: Any, keep: Any) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{op}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"{op}: keep must be a positive int, got {keep!r}")
        if optimizer in _GUARDS:
            raise RuntimeError(f"{op}: this optimizer is already guarded; call remove() on its guard first")
        everything = _optimizer_params(optimizer)
        self._params = everything if params is None else _check_params(op, params, everything)
        self._all_ids = [id(p) for p in everything] if params is None else None
        self._names_by_id = _names_of(op, optimizer, names)
        self.names = [self._names_by_id[id(p)] for p in self._params]
        _check_devices(op, optimizer, everything)
        self.optimizer = optimizer
        self.keep = keep
        self._home = self._params[0].device
        self._steps = torch.zeros((), dtype=torch.int64, device=self._home)
        self._skipped = torch.zeros((), dtype=torch.int64, device=self._home)
        # Row `keep` of the ring is where a good step writes: never read.
        self._ring_steps = torch.full((keep + 1,), -1, dtype=torch.int64, device=self._home)
        self._ring_flags = torch.zeros((keep + 1, len(self._params)), dtype=torch.bool, device=self._home)
        self._indices: dict[tuple[int, ...], Tensor] = {}
        self._not_scanned: dict[str, str] = {}  # GuardReport.not_scanned
        self._open: _OpenStep | None = None
        self._handles = [
            optimizer.register_step_pre_hook(torch.compiler.disable(self._before_step)),
            optimizer.register_step_post_hook(torch.compiler.disable(self._after_step)),
        ]
        _GUARDS[optimizer] = id(self)

    @property
    def fused(self) -> bool:
        """Whether a bad step is skipped through the optimizer's found_inf (the
        fused kernels' own skip; every param group must be fused) rather than
        undone from copies."""
        optimizer = self.optimizer
        return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
            group.get("fused", True) for group in optimizer.param_groups
        )

    def __enter__(self) -> StepGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Removes the hooks; safe to call twice. report() keeps working."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._open is not None:
            self._restore_found_inf(self._open.found_inf)
            self._open = None
        if _GUARDS.get(self.optimizer) == id(self):
            del _GUARDS[self.optimizer]

    def report(self) -> GuardReport:
        """Reads the counters back (this waits for the device)."""
        steps, skipped = int(self._steps.item()), int(self._skipped.item())
        ring_steps = self._ring_steps.tolist()
        ring_flags = self._ring_flags.cpu()
        listed = []
        for n in range(max(0, skipped - self.keep), skipped):
            held = ring_flags[n % self.keep].nonzero().flatten().tolist()
            listed.append(SkippedStep(ring_steps[n % self.keep], [self.names[i] for i in held]))
        return GuardReport(steps, skipped, listed, dict(self._not_scanned))

    def __repr__(self) -> str:
        how = "fused found_inf" if self.fused else "snapshot and select"
        state = "removed" if not self._handles else "installed"
        return f"StepGuard({type(self.optimizer).__name__}, {len(self._params)} parameters, {how}, {state})"

    # ---- the step path: no host reads from here on ------------------------
    # The hooks run eagerly even inside a compiled optimizer.step(): traced by
    # dynamo (torch 2.13), the found_inf that the pre-hook sets on the
    # optimizer never reaches the fused kernel, so the step would not be
    # skipped. torch.compiler.disable is applied where they are registered:
    # it imports torch._dynamo, about a second that `import zeroscan` must not cost.

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._open is not None:  # the last step raised before its post hooks ran
            self._restore_found_inf(self._open.found_inf)
            self._open = None
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is not None:
            raise RuntimeError(f"{OP}: optimizer.step(closure) is not supported: the closure's gradients come after the scan")
        params = _optimizer_params(optimizer)
        if self._all_ids is not None and [id(p) for p in params] != self._all_ids:
            raise RuntimeError(f"{OP}: the optimizer's parameters changed since guard(); remove() it and guard again")
        fused = self.fused
        with torch.no_grad():
            flags = self._scan()
            bad = flags.any()
            state = [self._state_before(p, i, copy=not fused) for i, p in enumerate(params)]
            copies = None if fused else [p.detach().clone() for p in params]
            found_inf = self._set_found_inf(bad) if fused else UNTOUCHED
        self._open = _OpenStep(flags, bad, params, copies, state, found_inf)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        step, self._open = self._open, None
        if step is None:  # installed during this step
            return
        self._restore_found_inf(step.found_inf)
        with torch.no_grad():
            bad_on = {self._home: step.bad}
            for i, p in enumerate(step.params):
                bad = bad_on.get(p.device)
                if bad is None:  # another accelerator: a device-to-device copy
                    bad = bad_on[p.device] = step.bad.to(p.device, non_blocking=True)
                if step.copies is not None:
                    _select(bad, step.copies[i], p.detach())
                before = step.state[i]
                for key, t in optimizer.state.get(p, {}).items():
                    if not isinstance(t, Tensor):
                        continue
                    if key not in before:  # created by this step: zero on a bad one
                        self._check_state_device(p, i, key, t, after=True)
                        t.masked_fill_(bad, 0)
                    elif before[key] is not None:
                        _select(bad, before[key], t)
            slot = torch.where(step.bad, self._skipped % self.keep, self.keep).reshape(1)
            self._ring_steps.index_copy_(0, slot, self._steps.reshape(1))
            self._ring_flags.index_copy_(0, slot, step.flags.reshape(1, -1))
            self._skipped += step.bad
            self._steps += 1

    def _scan(self) -> Tensor:
        """bool [P] on the home device: which guarded gradients hold NaN/Inf."""
        present: list[int] = []  # guarded parameter index of each of grads
        grads: list[Tensor] = []
        for i, p in enumerate(self._params):
            grad = p.grad
            if grad is None:
                continue
            if grad.layout != torch.strided or is_dtensor(grad):
                kind = "DTensor" if is_dtensor(grad) else f"{grad.layout} tensor"
                raise RuntimeError(f"{OP}: the gradient of {self.names[i]} is a {kind}; only dense local gradients are scanned")
            present.append(i)
            grads.append(torch.view_as_real(grad) if grad.is_complex() else grad)
        try:
            return self._flags(present, grads)
        except RuntimeError:
            # The native check refused a gradient before scanning anything. One whose
            # memory was freed (FSDP frees with resize_(0)) is left out, like a None one,
            # and named in the report; any other refusal stands.
            kept = []
            for k, grad in enumerate(grads):
                why = unreadable(grad)
                if why is None:
                    kept.append(k)
                else:
                    self._not_scanned[self.names[present[k]]] = f"the gradient {why}"
            if len(kept) == len(grads):
                raise
            return self._flags([present[k] for k in kept], [grads[k] for k in kept])

    def _flags(self, present: list[int], grads: list[Tensor]) -> Tensor:
        """bool [P] on the home device from the gradients `grads` of the guarded
        parameters `present` (indices), the others False."""
        groups = device_groups(grads)
        if len(groups) == 1 and len(grads) == len(self._params) and grads[0].device == self._home:
            return nonfinite_flags(grads)  # every gradient present, one device
        flags = torch.zeros(len(self._params), dtype=torch.bool, device=self._home)
        for group in groups:
            found = nonfinite_flags([grads[k] for k in group]).to(self._home, non_blocking=True)
            flags.index_copy_(0, self._index([present[k] for k in group]), found)
        return flags

    def _index(self, indices: list[int]) -> Tensor:
        key = tuple(indices)
        index = self._indices.get(key)
        if index is None:  # the one host-to-device copy, on the first step with this pattern
            index = self._indices[key] = torch.tensor(indices, dtype=torch.int64, device=self._home)
        return index

    def _state_before(self, p: Tensor, i: int, *, copy: bool) -> dict[str, Tensor | None]:
        """p's state tensors now: their copies, or None each (the fused path)."""
        before: dict[str, Tensor | None] = {}
        for key, t in self.optimizer.state.get(p, {}).items():
            if isinstance(t, Tensor):
                self._check_state_device(p, i, key, t, after=False)
                before[key] = t.detach().clone() if copy else None
        return before

    def _check_state_device(self, p: Tensor, i: int, key: str, t: Tensor, *, after: bool) -> None:
        if t.device != p.device:
            when = " (this step was not guarded)" if after else ""
            raise RuntimeError(
                f"{OP}: optimizer.state[{self._names_by_id.get(id(p), f'parameter {i}')}][{key!r}] is on {t.device} but its parameter is on "
                f"{p.device}; selecting it needs a host sync: create the optimizer with capturable=True or fused=True{when}"
            )

    def _set_found_inf(self, bad: Tensor) -> Any:
        previous = getattr(self.optimizer, "found_inf", MISSING)
        skip = bad
        if isinstance(previous, Tensor):  # GradScaler's: skip when either says so
            skip = bad | (previous.to(self._home, non_blocking=True) != 0)
        self.optimizer.found_inf = skip.to(torch.float32)  # type: ignore[attr-defined]
        return previous

    def _restore_found_inf(self, previous: Any) -> None:
        if previous is UNTOUCHED:
            return
        if previous is MISSING:
            self.optimizer.__dict__.pop("found_inf", None)
        else:
            self.optimizer.found_inf = previous  # type: ignore[attr-defined]


def _select(bad: Tensor, copy: Tensor, current: Tensor) -> None:
    torch.where(bad, copy, current, out=current)


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _check_params(op: str, params: Iterable[Tensor], everything: list[Tensor]) -> list[Tensor]:
    if isinstance(params, Tensor) or not isinstance(params, Iterable):
        raise TypeError(f"{op}: params must be an iterable of the optimizer's parameters, got {type(params).__name__}")
    known = {id(p) for p in everything}
    chosen: dict[int, Tensor] = {}
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"{op}: params[{i}] must be a torch.Tensor, got {type(p).__name__}")
        if id(p) not in known:
            raise ValueError(f"{op}: params[{i}] is not a parameter of the optimizer")
        chosen.setdefault(id(p), p)
    if not chosen:
        raise ValueError(f"{op}: params must hold at least one of the optimizer's parameters, got none")
    return list(chosen.values())


def _names_of(op: str, optimizer: torch.optim.Optimizer, names: object) -> dict[int, str]:
    """id(parameter) -> its name, for every parameter of the optimizer."""
    found: dict[int, str] = {}
    if isinstance(names, nn.Module):
        for name, p in names.named_parameters():
            found.setdefault(id(p), name)
    elif isinstance(names, Mapping):
        for t, name in names.items():
            if not isinstance(t, Tensor) or not isinstance(name, str):
                raise TypeError(f"{op}: names must map tensors to str, got a {type(t).__name__} -> {type(name).__name__} entry")
            found[id(t)] = name
    elif names is not None:
        raise TypeError(f"{op}: names must be a dict of tensor -> str, an nn.Module or None, got {type(names).__name__}")
    for i, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            found.setdefault(id(p), f"group{i}.param{j}")
    return found


def _check_devices(op: str, optimizer: torch.optim.Optimizer, params: list[Tensor]) -> None:
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1 and "cpu" in devices:
        raise ValueError(
            f"{op}: the optimizer's parameters are on {', '.join(devices)}; the flag moves between accelerators "
            "without a host sync, but not to the CPU: guard CPU and accelerator parameters with separate optimizers"
        )
    for i, group in enumerate(optimizer.param_groups):
        if "capturable" in group and not group["capturable"] and not group.get("fused"):
            device = next((p.device for p in group["params"] if p.device.type != "cpu"), None)
            if device is not None:
                raise ValueError(
                    f"{op}: param group {i} keeps its step count on the CPU (capturable=False, fused off) while its "
                    f"parameters are on {device}; selecting it needs a host sync: create the optimizer with "
                    "capturable=True or fused=True"
                )


def guard(
    optimizer: torch.optim.Optimizer,
    *,
    params: Iterable[Tensor] | None = None,
    names: Mapping[Tensor, str] | nn.Module | None = None,
    keep: int = 16,
) -> StepGuard:
    """Installs a StepGuard: from now on an optimizer.step() whose gradients
    hold NaN/Inf changes nothing (see the module doc).

    params: the parameters whose gradients are scanned (default: all of the
        optimizer's); a bad step is skipped for all of them either way.
    names: names for report(): a dict tensor -> name, or a module (its
        named_parameters()); others are named like `group0.param3`.
    keep: how many of the last skipped steps report() lists.
    """
    return StepGuard._built_by("zeroscan.guard", optimizer, params, names, keep)
