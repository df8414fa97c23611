"""A .detach() between two layers: the first layer never gets a gradient.

    python examples/detach_between_layers.py
"""

from __future__ import annotations

import torch
from torch import nn

import zeroscan


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x)).detach()  # the bug: cuts fc1 out of the graph
        return self.fc2(h)


def run(seed: int = 0, steps: int = 3) -> zeroscan.Report:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Net()
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
