"""A weight detached inside forward: the bias trains, the weight never does.

    python examples/weight_detached_in_forward.py
"""

from __future__ import annotations

import torch
from torch import nn

import zeroscan


class ScaledLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.detach() * 0.5  # the bug: should be self.weight * 0.5
        return nn.functional.linear(x, w, self.bias)


def run(seed: int = 0, steps: int = 3) -> zeroscan.Report:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = nn.Sequential(ScaledLinear(10, 20), nn.Tanh(), nn.Linear(20, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with zeroscan.Monitor(model, opt) as monitor:
            for _ in range(steps):
                x, y = torch.randn(32, 10), torch.randn(32, 1)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        return monitor.report()


if __name__ == "__main__":
    print(run())
