"""A gradient norm shrinking step after step under aggressive clipping (here a
clipping threshold that is tightened every step), so training stalls.

    python examples/clipping_norm_drift.py
"""

from __future__ import annotations

import torch
from torch import nn

import zeroscan


def run(seed: int = 0, steps: int = 30) -> zeroscan.Report:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        # lr 0.1 keeps the last, tiny clipped steps above the weights' resolution
        # (a smaller one can leave a weight bit-identical: a true "not_updated")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        max_norm = 1.0
        with zeroscan.Monitor(model, opt) as monitor:
            for _ in range(steps):
                x, y = torch.randn(32, 8), torch.randn(32, 1)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                max_norm *= 0.7  # the bug: the clip threshold decays with the schedule
                opt.step()
        return monitor.report()


if __name__ == "__main__":
    print(run())
