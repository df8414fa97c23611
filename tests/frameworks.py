"""The shared harness of the framework integration tests (test_integration_*.py).

Every framework trains the same tiny GPT-2, built from a config (no
download), for a few steps on CPU, healthy or with one planted problem:

    frozen             one MLP block set requires_grad_(False)          -> INFO "frozen"
    not_in_optimizer   one MLP block trains but the optimizer lacks it  -> WARNING "not_in_optimizer"
    detached           the LM head reads a detached hidden state        -> ERROR "detached"
    nan                one weight of the MLP set to NaN                 -> ERROR "nonfinite"

plant_nan_at(model, step) is apart from those: one module's forward returns
NaN at one optimizer step, for the trace_nonfinite tests.

`require(name)` imports a framework; where ZEROSCAN_REQUIRE_FRAMEWORKS is
set (.ci/run sets it) a missing one fails the test instead of skipping it,
so CI cannot pass with the integrations untested.
"""

from __future__ import annotations

import importlib
import os
import re
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from zeroscan import Cause, Severity

VOCAB = 96
LENGTH = 16
PLANTED = "transformer.h.1.mlp"  # the block each problem is planted in
PROBLEMS: dict[str, tuple[Cause, Severity]] = {
    "frozen": (Cause.FROZEN, Severity.INFO),
    "not_in_optimizer": (Cause.NOT_IN_OPTIMIZER, Severity.WARNING),
    "detached": (Cause.DETACHED, Severity.ERROR),
    "nan": (Cause.NONFINITE, Severity.ERROR),
}


def require(name: str) -> ModuleType:
    """Imports the framework `name`, skipping the test where it is missing
    (failing it instead under ZEROSCAN_REQUIRE_FRAMEWORKS=1)."""
    if os.environ.get("ZEROSCAN_REQUIRE_FRAMEWORKS"):
        return importlib.import_module(name)
    return pytest.importorskip(name)


def tiny_gpt2(seed: int = 0) -> nn.Module:
    """A 2-layer GPT-2 with 32-wide embeddings, from a config."""
    transformers = require("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def token_rows(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """`n` rows of random token ids (input_ids [LENGTH] and labels [LENGTH])."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (LENGTH,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def plant(model: nn.Module, problem: str) -> nn.Module:
    """Plants `problem` (a key of PROBLEMS, or "healthy") in `model`; returns it."""
    block = model.get_submodule(PLANTED)
    if problem == "frozen":
        block.requires_grad_(False)
    elif problem == "detached":
        head = model.get_submodule("lm_head")
        head.register_forward_pre_hook(lambda module, args: (args[0].detach(),))
    elif problem == "nan":
        with torch.no_grad():
            block.get_parameter("c_fc.weight")[0, 0] = float("nan")
    elif problem not in ("healthy", "not_in_optimizer"):
        raise ValueError(f"plant: problem must be 'healthy' or one of {sorted(PROBLEMS)}, got {problem!r}")
    return model


NAN_MODULE = f"{PLANTED}.act"  # the module plant_nan_at makes return NaN


class NaNAtCall(nn.Module):
    """Runs `inner`, and multiplies its output by NaN in the `at`-th (0-based)
    forward call made with grad mode on: with one forward pass per optimizer
    step, the forward pass of optimizer step `at` (steps counted from 0, as
    the Monitor counts them)."""

    def __init__(self, inner: nn.Module, at: int) -> None:
        super().__init__()
        self.inner = inner
        self.at = at
        self.calls = 0  # forward calls with grad mode on so far

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls - 1 == self.at:
                y = y * float("nan")
        return y


def plant_nan_at(model: nn.Module, step: int, prefix: str = "") -> str:
    """Makes the planted block's activation return NaN at optimizer step
    `step` (NaNAtCall); returns its qualified name in the model, `prefix`
    first (the name a Monitor on a module holding the model gives it)."""
    block = model.get_submodule(PLANTED)
    block.act = NaNAtCall(block.act, step)
    return prefix + NAN_MODULE


def assert_nan_born_at(report: Any, name: str, step: int) -> None:
    """`report` (a Monitor's, with trace_nonfinite=True) names the NaN of
    plant_nan_at as born in `name`'s forward at optimizer step `step`: in
    Report.nonfinite_origin and in one nonfinite_origin finding."""
    origin = report.nonfinite_origin
    assert origin is not None, str(report)
    assert (origin["name"], origin["pass"], origin["step"]) == (name, "forward", step), origin
    assert (origin["kind"], origin["values"], origin["micro_batch"]) == ("activation", "NaN", 0), origin
    born = [f for f in report.findings if f.cause == Cause.NONFINITE_ORIGIN]
    assert [f.name for f in born] == [name], str(report)
    assert f"NaN was born at step {step}, in the forward pass" in born[0].message, born[0].message


def trained_params(model: nn.Module, problem: str) -> list[nn.Parameter]:
    """What the optimizer gets: every parameter that requires grad, less
    the planted block's under "not_in_optimizer"."""
    left_out = {id(p) for p in model.get_submodule(PLANTED).parameters()} if problem == "not_in_optimizer" else set()
    return [p for p in model.parameters() if p.requires_grad and id(p) not in left_out]


def optimizer(model: nn.Module, problem: str, lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.AdamW(trained_params(model, problem), lr=lr)


def finding_names(findings: list[dict[str, Any]], problem: str) -> set[str]:
    """The names of the tensors that the findings (to_dict() form) of the
    planted problem's cause and severity are about: a grouped finding's
    members, each under its own name."""
    cause, severity = PROBLEMS[problem]
    return {
        str(f["name"]) for g in findings for f in (g.get("members") or [g])
        if f["cause"] == cause.value and f["severity"] == severity.name.lower()
    }


def lines(caplog: pytest.LogCaptureFixture, text: str) -> list[tuple[int, int, str]]:
    """(step named, level, message) of each "zeroscan step N: ..." line that holds `text`."""
    out = []
    for r in caplog.records:
        match = re.match(r"zeroscan step (\d+): ", r.getMessage()) if r.name == "zeroscan" else None
        if match and text in r.getMessage():
            out.append((int(match[1]), r.levelno, r.getMessage()))
    return out
