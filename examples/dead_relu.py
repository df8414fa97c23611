"""A dead ReLU layer: every unit is zero for the whole batch, so the layers
before it (and the weight after it) get exactly zero gradients.

    python examples/dead_relu.py
"""

from __future__ import annotations

import torch
from torch import nn

import zeroscan


def run(seed: int = 0, steps: int = 3) -> zeroscan.Report:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
        with torch.no_grad():
            model[0].bias.fill_(-100.0)  # e.g. after one huge update
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with zeroscan.Monitor(model, opt, activations=True) as monitor:
            for _ in range(steps):
                x, y = torch.randn(64, 10), torch.randn(64, 1)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        return monitor.report()


if __name__ == "__main__":
    print(run())
