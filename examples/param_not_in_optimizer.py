"""A parameter left out of the optimizer: it gets gradients but never changes.

    python examples/param_not_in_optimizer.py
"""

from __future__ import annotations

import torch
from torch import nn

import zeroscan


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x))) / self.temperature


def run(seed: int = 0, steps: int = 4) -> zeroscan.Report:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Net()
        # the bug: the optimizer is built from the submodules only
        opt = torch.optim.Adam([*model.body.parameters(), *model.head.parameters()], lr=1e-3)
        with zeroscan.Monitor(model, opt) as monitor:
            for _ in range(steps):
                x, y = torch.randn(32, 8), torch.randn(32, 1)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        return monitor.report()


if __name__ == "__main__":
    print(run())
