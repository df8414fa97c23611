"""An input with requires_grad=False is normal: the weights still get real
gradients, and zeroscan reports nothing wrong (diagnose(x) is HEALTHY).

    python examples/input_without_grad.py
"""

from __future__ import annotations

import torch
from torch import nn

import zeroscan


def run(seed: int = 0, steps: int = 5) -> tuple[zeroscan.Diagnosis, zeroscan.Report]:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 3))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        x = torch.randn(48, 12)  # requires_grad=False, as data usually is
        y = torch.randint(0, 3, (48,))
        with zeroscan.Monitor(model, opt, activations=True) as monitor:
            for _ in range(steps):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
        return zeroscan.diagnose(x), monitor.report()


if __name__ == "__main__":
    diagnosis, report = run()
    print("input:", diagnosis)
    print(report)
