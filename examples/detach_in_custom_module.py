"""A detach hidden inside a custom module's forward: everything before it
(and inside it) silently stops training.

    python examples/detach_in_custom_module.py
"""

from __future__ import annotations

import torch
from torch import nn

import zeroscan


class Normalize(nn.Module):
    """Scales rows to unit norm; the norm is (wrongly) taken from a detached copy
    and the result rebuilt from it, so no gradient flows back."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        h = h.detach()  # hidden bug
        return h / h.norm(dim=-1, keepdim=True).clamp_min(1e-6)


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Normalize(16), nn.Linear(16, 1))


def run(seed: int = 0, steps: int = 3) -> zeroscan.Report:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = build()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        with zeroscan.Monitor(model, opt) as monitor:
            for _ in range(steps):
                x, y = torch.randn(32, 8), torch.randn(32, 1)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        return monitor.report()


if __name__ == "__main__":
    print(run())
