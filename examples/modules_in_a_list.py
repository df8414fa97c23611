"""Layers kept in a plain Python list instead of nn.ModuleList:
model.parameters() never sees them, so the optimizer never trains them,
.to(device) never moves them and state_dict() never saves them.

    python examples/modules_in_a_list.py
"""

from __future__ import annotations

import torch
from torch import nn

import zeroscan


class Stack(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.hidden = [nn.Linear(width, width) for _ in range(depth)]  # the bug: not nn.ModuleList
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for layer in self.hidden:
            h = torch.tanh(layer(h))
        return self.out(h)


def run(seed: int = 0, steps: int = 3) -> zeroscan.Report:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Stack()
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
