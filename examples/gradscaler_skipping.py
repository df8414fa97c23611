"""Mixed precision whose every step GradScaler skips: log(relu(...)) gives
-inf wherever a unit is off, so every gradient holds NaN, GradScaler finds
it and never calls optimizer.step(). Nothing trains, and no error is raised.

    python examples/gradscaler_skipping.py
"""

from __future__ import annotations

import torch
from torch import nn

import zeroscan


class LogFeatures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.log(torch.relu(self.fc1(x))))  # the bug: log(0) = -inf


def run(seed: int = 0, steps: int = 4) -> zeroscan.Report:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LogFeatures()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu")
        with zeroscan.Monitor(model, opt) as monitor:
            for _ in range(steps):
                x, y = torch.randn(32, 6), torch.randn(32, 1)
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = nn.functional.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
                scaler.step(opt)  # skipped: the gradients hold NaN
                scaler.update()
        return monitor.report()


if __name__ == "__main__":
    print(run())
