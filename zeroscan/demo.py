"""`zeroscan demo`: a short tour of what zeroscan tells apart, on built-in examples.

Six small cases, each diagnosed in plain words: a healthy tensor, one that is
exactly zero, one that underflowed in float16, one poisoned by a NaN, a
layer whose output is detached (its parameters get no gradient), and a
parameter left out of the optimizer. The first four use zeroscan.diagnose on
one tensor; the last two train a three-layer model for a few steps under
zeroscan.Monitor. Two more show a NaN step skipped on the device by
zeroscan.guard, and what an fp8 cast of a gradient would lose (histogram and
headroom). Everything is seeded, so the tour reads the same each time.
run_demo returns 1 if any case is not diagnosed as expected.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from typing import Any, TextIO

import torch
from torch import nn

from zeroscan.diagnosis import Diagnosis, Verdict, diagnose
from zeroscan.safe_text import printable

WIDTH = 100


class Tour:
    """Writes the numbered sections and keeps count of surprises."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.section = 0
        self.unexpected: list[str] = []

    def say(self, text: str = "", indent: int = 0) -> None:
        if not text:
            self.out.write("\n")
            return
        pad = " " * indent
        self.out.write(textwrap.fill(text, WIDTH, initial_indent=pad, subsequent_indent=pad + "  ") + "\n")

    def title(self, text: str) -> None:
        self.section += 1
        self.out.write(f"\n{self.section}. {text}\n")

    def verdict(self, d: Diagnosis, want: Verdict) -> None:
        self.say(f"{d.verdict.name} ({d.severity.name.lower()}): {d.reason}", indent=3)
        self.say(repr(d.stats), indent=3)
        if d.verdict is not want:
            self.unexpected.append(f"section {self.section}: expected {want.name}, got {d.verdict.name}")


def tensor_cases(tour: Tour, g: torch.Generator) -> None:
    x = torch.randn(4096, generator=g)
    tour.title("A healthy tensor: torch.randn(4096)")
    tour.verdict(diagnose(x), Verdict.HEALTHY)

    tour.title("Exactly zero: the gradient of a bias behind a ReLU that never fires")
    z = torch.zeros(4096)
    tour.verdict(diagnose(z), Verdict.EXACT_ZERO)
    tour.say("Every value is +0.0 or -0.0: no signal reached this tensor at all.", indent=3)

    tour.title("Underflowed: float32 gradients of about 1e-6 stored in float16")
    small = torch.randn(4096, generator=g) * 1e-6
    half = small.to(torch.float16)
    d = diagnose(half)
    tour.verdict(d, Verdict.UNDERFLOW)
    flushed = int((half == 0).sum()) - int((small == 0).sum())
    tour.say(
        f"float16's smallest normal number is {torch.finfo(torch.float16).tiny:.3g}. The cast flushed "
        f"{flushed} of the 4096 values to zero and kept the rest as subnormals with a few bits of "
        "precision, so (x == 0).all() is False and yet the values are mostly rounding. That is underflow, "
        "not a true zero: scale the loss (torch.amp.GradScaler) or train in bfloat16.",
        indent=3,
    )

    tour.title("NaN-poisoned: one NaN among 4096 values")
    poisoned = torch.randn(4096, generator=g)
    poisoned[1234] = float("nan")
    tour.verdict(diagnose(poisoned), Verdict.NONFINITE)
    tour.say(
        f"x.sum() is {float(poisoned.sum())} and so is every result computed from it. zeroscan counts "
        "the NaN, and its mean, std and norm cover the finite values only, so they still mean something.",
        indent=3,
    )


class Net(nn.Module):
    """embed -> hidden -> head, optionally with hidden's output detached."""

    def __init__(self, detach: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.hidden = nn.Linear(16, 16)
        self.head = nn.Linear(16, 2)
        self.detach = detach

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        h = self.hidden(h)
        if self.detach:
            h = h.detach()  # the bug: nothing before this line gets a gradient
        return self.head(torch.relu(h))


def train(model: Net, optimizer: torch.optim.Optimizer, g: torch.Generator, steps: int = 4) -> Any:
    """A few SGD steps under a Monitor; returns its report."""
    from zeroscan.monitor import Monitor

    with Monitor(model, optimizer) as monitor:
        for _ in range(steps):
            optimizer.zero_grad()
            x = torch.randn(32, 8, generator=g)
            y = torch.randint(0, 2, (32,), generator=g)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return monitor.report()


def show_findings(tour: Tour, report: Any, cause: str, limit: int = 2) -> None:
    found = [f for f in report.findings if f.cause == cause]
    for f in found[:limit]:
        tour.say(f"{f.severity.name} {f.name} ({f.kind}, {f.cause}): {f.message}", indent=3)
    if len(found) > limit:
        tour.say(f"... and the same for {', '.join(f.name for f in found[limit:])}", indent=3)
    if not found:
        tour.unexpected.append(f"section {tour.section}: no {cause!r} finding")


def model_cases(tour: Tour, g: torch.Generator, plot: str | None) -> None:
    try:
        importlib.import_module("zeroscan.monitor")
    except ImportError as e:
        tour.say()
        tour.say(f"(The last two cases need zeroscan.Monitor, which cannot be imported here: {e}.)")
        return

    tour.title("A detached layer: forward() calls .detach() on hidden's output")
    model = Net(detach=True)
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.1), g)
    tour.say(
        f"After backward, embed.weight.grad is {model.embed.weight.grad}: no error, no warning, the "
        "layer silently stops learning. zeroscan.Monitor says why:",
        indent=3,
    )
    show_findings(tour, report, "detached")
    if plot:
        written = report.plot(plot)
        tour.say(f"(gradient flow of this model drawn to {printable(written)})", indent=3)

    tour.title("A parameter missing from the optimizer: SGD built without head.bias")
    model = Net(detach=False)
    params = [p for name, p in model.named_parameters() if name != "head.bias"]
    report = train(model, torch.optim.SGD(params, lr=0.1), g)
    tour.say("head.bias gets a gradient every step, but optimizer.step() never touches it:", indent=3)
    show_findings(tour, report, "not_in_optimizer")


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Copies of the weights and of every optimizer state tensor."""
    state = [v for p in model.parameters() for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return [t.detach().clone() for t in [*model.parameters(), *state]]


def guard_case(tour: Tour, g: torch.Generator) -> None:
    from zeroscan.guard import guard

    tour.title("A NaN step skipped on the device: zeroscan.guard(optimizer)")
    model = Net(detach=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    steps, poisoned_step = 4, 2
    with guard(optimizer, names=model) as g_step:
        for step in range(steps):
            optimizer.zero_grad()
            x = torch.randn(32, 8, generator=g)
            if step == poisoned_step:
                x[3, 5] = float("nan")  # one bad input poisons every gradient
            y = torch.randint(0, 2, (32,), generator=g)
            nn.functional.cross_entropy(model(x), y).backward()
            before = snapshot(model, optimizer)
            optimizer.step()
            if step == poisoned_step:
                after = snapshot(model, optimizer)
                unchanged = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
        report = g_step.report()
    tour.say(str(report), indent=3)
    tour.say(
        f"Weights and Adam's state after the bad step: {'unchanged' if unchanged else 'CHANGED'}. The "
        "decision never left the device (no .item(), no host sync), as GradScaler's found_inf does, "
        "but for any optimizer and without AMP.",
        indent=3,
    )
    if not unchanged or report.skipped != 1 or report.skipped_steps[0].step != poisoned_step:
        tour.unexpected.append(f"section {tour.section}: the NaN step was not skipped alone")


def headroom_case(tour: Tour, g: torch.Generator) -> None:
    from zeroscan.headroom import headroom
    from zeroscan.stats import stats

    tour.title("What an fp8 cast would lose: a gradient's log2-magnitude histogram")
    grad = torch.randn(65536, generator=g) * torch.exp(2 * torch.randn(65536, generator=g)) * 1e-4
    s = stats(grad, histogram=True)  # the same single pass, with a bin per binade
    h = s.histogram
    assert h is not None
    top = int(h.exponents[h.counts.nonzero()[0][-1]])
    low = int(h.exponents[h.counts.nonzero()[0][0]])
    tour.say(f"|x| spans 2^{low} .. 2^{top + 1}: {top - low + 1} binades, from one scan.", indent=3)
    unscaled = headroom(h, "e4m3", scale=1.0)
    scaled = headroom(h, "e4m3", amax=s.max_abs)
    tour.say(str(unscaled), indent=3)
    tour.say(str(scaled), indent=3)
    flushed = f"{100 * scaled.to_zero.low / h.numel:.2g}–{100 * scaled.to_zero.high / h.numel:.2g}%"
    tour.say(
        f"Cast as it is, most of this gradient flushes to zero in e4m3. Scaled by 448 / amax, {flushed} "
        f"still would: {top - low + 1} binades are more than e4m3's 18 normal and subnormal ones. "
        "The ranges are what a histogram cannot decide: values in a binade that a rounding boundary cuts.",
        indent=3,
    )
    if unscaled.to_zero.low < h.numel // 2:
        tour.unexpected.append(f"section {tour.section}: expected most values to flush unscaled")


def run_demo(out: TextIO | None = None, plot: str | None = None) -> int:
    """Writes the tour to `out` (default stdout); draws the detached model's
    gradient flow to `plot` if given. Returns 0, or 1 if a case surprised."""
    out = out or sys.stdout
    tour = Tour(out)
    tour.say("zeroscan demo: one fused pass over a tensor tells truly zero from underflowed, "
             "NaN-poisoned from healthy, and a Monitor tells why a gradient is missing.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the models' initial weights
        g = torch.Generator().manual_seed(0)
        tensor_cases(tour, g)
        model_cases(tour, g, plot)
        guard_case(tour, g)
        headroom_case(tour, g)
    tour.say()
    tour.say("Next: `zeroscan scan model.pt` (add --json, --fail-on warning, --plot scan.png), "
             "`zeroscan diff a.pt b.pt`, and zeroscan.Monitor(model, optimizer) in your training loop.")
    if tour.unexpected:
        sys.stderr.write("zeroscan demo: unexpected results: " + "; ".join(tour.unexpected) + "\n")
        return 1
    return 0
