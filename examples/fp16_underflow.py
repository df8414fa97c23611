"""float16 gradients that underflow: without loss scaling, small gradients
become subnormal or flush to zero in float16.

    python examples/fp16_underflow.py
"""

from __future__ import annotations

import torch
from torch import nn

import zeroscan


def run(seed: int = 0, steps: int = 3) -> zeroscan.Report:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).half()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with zeroscan.Monitor(model, opt) as monitor:
            for _ in range(steps):
                x = torch.randn(16, 32).half()
                y = model(x).detach() + 1e-3 * torch.randn(16, 1).half()  # nearly fitted already
                opt.zero_grad()
                # a loss averaged over many elements and a small residual: tiny gradients
                loss = nn.functional.mse_loss(model(x), y) * 1e-3
                loss.backward()
                opt.step()
        return monitor.report()


if __name__ == "__main__":
    print(run())
