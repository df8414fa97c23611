"""The shared harness of the large-model framework tests
(test_integration_deepspeed.py, test_integration_megatron.py): one small
network, healthy or with one planted fault, trained for STEPS steps on 1
and 2 gloo ranks, and the names a report gives each cause.

    healthy            no WARNING or ERROR; every row the full tensor's
    detach             a's output is detached         -> ERROR "detached" (a.*)
    unused             c is never called               -> WARNING "unused" (c.*)
    not_in_optimizer   c trains outside the optimizer  -> WARNING "not_in_optimizer" (c.*)
    nan                a NaN in the batch at NAN_STEP  -> a skipped step or a nonfinite ERROR,
                                                          born in "(input batch)"
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from world import Check, World, spawn_world
from zeroscan import Report

STEPS = 4
NAN_STEP = 2
FAULTS = ("healthy", "detach", "unused", "not_in_optimizer", "nan")
WORLD_TIMEOUT_S = 300.0
COLLECTIVE_TIMEOUT_S = 60.0


class Net(nn.Module):
    """Sizes that do not divide by 2, so that ZeRO pads the last rank's
    partition and Megatron's distributed optimizer cuts parameters in the middle."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault
        self.a = nn.Linear(16, 37)
        self.b = nn.Linear(37, 5)
        self.c = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.fault == "detach":
            h = h.detach()
        y = self.b(h)
        if self.fault != "unused":
            y = self.c(y)
        return self.head(y)


def named(report: Report, cause: str) -> set[str]:
    """Every parameter a finding of `cause` names."""
    out: set[str] = set()
    for f in report.findings:
        if f.cause == cause:
            out |= set(f.names or (f.name,))
    return out


def one_and_two_rank_world(checks: dict[str, Check]) -> Callable[..., World]:
    """A module-scoped `world` fixture, parametrized over worlds of 1 and 2
    ranks, that runs `checks`: `world = one_and_two_rank_world(CHECKS)`."""

    @pytest.fixture(scope="module", name="world", params=[1, 2], ids=["1rank", "2ranks"])
    def world_fixture(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> World:
        return spawn_world(
            request.param, checks, tmp_path_factory, timeout_s=WORLD_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S
        )

    return world_fixture
