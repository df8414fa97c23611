"""The rule book of zeroscan/value_rules.py: diagnose and the Monitor judge a
tensor's values by the same rules, in the same order, on fresh random data
of several families and dtypes; and a rule added to the book reaches both."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroscan
from zeroscan import value_rules
from zeroscan.monitor import rules as monitor_rules
from zeroscan.value_rules import Rule
from zeroscan.verdicts import Cause, Verdict
from helpers import fresh_generator
from test_diagnosis import normal, shuffled, subnormal

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# What the Monitor reports for a gradient of each verdict: its own words for
# the verdicts it knows more about; nothing of the values for a healthy one.
MONITOR_CAUSES = {
    Verdict.NONFINITE: {Cause.NONFINITE},
    Verdict.EXACT_ZERO: {Cause.EXACT_ZERO, Cause.UNDERFLOW},
    Verdict.UNDERFLOW: {Cause.UNDERFLOW},
    Verdict.PARTIAL_UNDERFLOW: {Cause.UNDERFLOW},
    Verdict.MOSTLY_ZERO: {Cause.MOSTLY_ZERO, Cause.ZERO_BY_STRUCTURE},
    Verdict.HEALTHY: set(),
}


class GradientIs(nn.Module):
    """A parameter whose gradient is exactly the tensor it is given: the loss
    is sum(w * g) with w all ones."""

    def __init__(self, grad: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones_like(grad))
        self.register_buffer("g", grad)

    def forward(self) -> torch.Tensor:
        return (self.w * self.g).float().sum()


def family(name: str, n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if name == "randn":
        return normal(n, dtype, g, scale=0.1)
    if name == "nan":
        x = normal(n, dtype, g, scale=0.1)
        x[int(torch.randint(0, n, (), generator=g))] = float("nan")
        return x
    if name == "zeros":
        return torch.zeros(n, dtype=dtype)
    if name == "subnormal_and_zeros":
        k = int(torch.randint(1, n // 2, (), generator=g))
        return shuffled(torch.cat([subnormal(k, dtype, g), torch.zeros(n - k, dtype=dtype)]), g)
    if name == "mostly_zero":
        k = int(0.95 * n)
        return shuffled(torch.cat([torch.zeros(k, dtype=dtype), normal(n - k, dtype, g, scale=0.1)]), g)
    if name == "mostly_zero_and_partly_subnormal":
        # Both MOSTLY_ZERO and PARTIAL_UNDERFLOW hold: the order decides, the same for both callers.
        k, s = int(0.95 * n), max(1, n // 100)
        parts = [torch.zeros(k, dtype=dtype), subnormal(s, dtype, g), normal(n - k - s, dtype, g, scale=0.1)]
        return shuffled(torch.cat(parts), g)
    assert name == "partly_subnormal"
    k = max(1, n // 20)
    return shuffled(torch.cat([subnormal(k, dtype, g), normal(n - k, dtype, g, scale=0.1)]), g)


FAMILIES = ["randn", "nan", "zeros", "subnormal_and_zeros", "mostly_zero", "mostly_zero_and_partly_subnormal",
            "partly_subnormal"]


def monitor_causes(grad: torch.Tensor) -> set[Cause]:
    """The causes of the Monitor's findings about the gradient `grad`, after one step."""
    model = GradientIs(grad)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with zeroscan.Monitor(model, opt) as monitor:
        opt.zero_grad()
        model().backward()
        assert torch.equal(model.w.grad.nan_to_num(), grad.nan_to_num())
        opt.step()
        report = monitor.report()
    return {Cause(f.cause) for f in report.findings if f.name == "w" and f.kind == "grad"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FAMILIES)
def test_diagnose_and_the_monitor_give_one_verdict(dtype: torch.dtype, name: str) -> None:
    g = fresh_generator()
    grad = family(name, 4 * int(torch.randint(64, 256, (), generator=g)), dtype, g)
    verdict = zeroscan.diagnose(grad).verdict
    if name == "mostly_zero_and_partly_subnormal":
        assert verdict is Verdict.PARTIAL_UNDERFLOW
    assert monitor_causes(grad) <= MONITOR_CAUSES[verdict] | {Cause.VANISHING}
    if verdict is not Verdict.HEALTHY:
        assert monitor_causes(grad), (name, verdict)


def test_a_new_rule_reaches_diagnose_and_the_monitor(monkeypatch: pytest.MonkeyPatch) -> None:
    # A rule the Monitor has no words of its own for is reported in the rule's words.
    big = Rule(Verdict.CONSTANT, lambda v, _: v.max_abs > 100.0, lambda v, _: f"|x| reaches {v.max_abs:.3g}")
    book = list(value_rules.RULES)
    book.insert(2, big)  # after EMPTY and NONFINITE
    monkeypatch.setattr(value_rules, "RULES", tuple(book))
    monkeypatch.setattr(monitor_rules, "_WEIGHED_BY_NORMS", frozenset({Verdict.MOSTLY_ZERO, Verdict.HEALTHY}))
    g = fresh_generator()
    grad = normal(512, torch.float32, g, scale=0.1)
    grad[int(torch.randint(0, 512, (), generator=g))] = 300.0
    d = zeroscan.diagnose(grad)
    assert d.verdict is Verdict.CONSTANT and d.reason == "|x| reaches 300"
    model = GradientIs(grad)
    with zeroscan.Monitor(model, auto=False) as monitor:
        model().backward()
        monitor.step()
        found = [f for f in monitor.report().findings if f.name == "w" and f.kind == "grad"]
    assert [(f.cause, f.message) for f in found] == [(Cause.CONSTANT, "the gradient of w: |x| reaches 300")]
