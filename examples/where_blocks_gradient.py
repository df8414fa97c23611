"""A torch.where that blocks the gradient to the unselected elements: the
masked-out weights get exactly zero gradient, step after step, and never train.

    python examples/where_blocks_gradient.py
"""

from __future__ import annotations

import torch
from torch import nn

import zeroscan


class MaskedLinear(nn.Linear):
    """Uses only the weights above a magnitude threshold, chosen once."""

    def __init__(self, n_in: int, n_out: int, keep: float) -> None:
        super().__init__(n_in, n_out)
        cutoff = self.weight.detach().abs().flatten().quantile(1.0 - keep)
        self.register_buffer("mask", self.weight.detach().abs() >= cutoff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.where(self.mask, self.weight, torch.zeros_like(self.weight))
        return nn.functional.linear(x, w, self.bias)


def run(seed: int = 0, steps: int = 4) -> zeroscan.Report:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = nn.Sequential(MaskedLinear(16, 32, keep=0.05), nn.Tanh(), nn.Linear(32, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with zeroscan.Monitor(model, opt) as monitor:
            for _ in range(steps):
                x, y = torch.randn(64, 16), torch.randn(64, 1)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        return monitor.report()


if __name__ == "__main__":
    print(run())
