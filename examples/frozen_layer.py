"""A frozen layer (requires_grad=False): reported as INFO, since freezing is
usually intended; the rest of the model trains normally.

    python examples/frozen_layer.py
"""

from __future__ import annotations

import torch
from torch import nn

import zeroscan


def run(seed: int = 0, steps: int = 4) -> zeroscan.Report:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        model[0].requires_grad_(False)  # e.g. a pretrained feature extractor
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        with zeroscan.Monitor(model, opt) as monitor:
            for _ in range(steps):
                x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
        return monitor.report()


if __name__ == "__main__":
    print(run())
