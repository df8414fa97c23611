"""A healthy MLP trained for a few hundred steps: zeroscan stays quiet.

    python examples/healthy_mlp.py
"""

from __future__ import annotations

import torch
from torch import nn

import zeroscan


def run(seed: int = 0, steps: int = 300) -> zeroscan.Report:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        teacher = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 4))
        model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        with zeroscan.Monitor(model, opt, activations=True) as monitor:
            for _ in range(steps):
                x = torch.randn(32, 20)
                with torch.no_grad():
                    y = teacher(x) + 0.1 * torch.randn(32, 4)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        return monitor.report()


if __name__ == "__main__":
    print(run())
