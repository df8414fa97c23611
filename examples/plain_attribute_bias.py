"""A bias kept as a plain tensor attribute (requires_grad=True, not an
nn.Parameter): model.parameters() and the optimizer never see it.

    python examples/plain_attribute_bias.py
"""

from __future__ import annotations

import torch
from torch import nn

import zeroscan


class Affine(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)
        self.bias = torch.zeros(n_out, requires_grad=True)  # the bug: not nn.Parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.bias


def run(seed: int = 0, steps: int = 3) -> zeroscan.Report:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = nn.Sequential(Affine(6, 12), nn.Tanh(), nn.Linear(12, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with zeroscan.Monitor(model, opt) as monitor:
            for _ in range(steps):
                x, y = torch.randn(32, 6), torch.randn(32, 1)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        return monitor.report()


if __name__ == "__main__":
    print(run())
