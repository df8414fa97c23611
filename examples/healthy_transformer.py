"""A healthy small transformer (tied embeddings, softmax attention, GELU MLP)
trained for a few hundred steps on a next-token task: zeroscan stays quiet.

    python examples/healthy_transformer.py
"""

from __future__ import annotations

import math

import torch
from torch import nn

import zeroscan


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.softmax = nn.Softmax(dim=-1)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(c // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attn = self.softmax(scores.masked_fill(causal, float("-inf")))
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, heads: int = 4, layers: int = 2, length: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(0.02 * torch.randn(length, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(vocab: int, n: int, length: int, g: torch.Generator) -> torch.Tensor:
    """Noisy arithmetic sequences: each token is the previous one plus a stride."""
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + stride * torch.arange(length + 1)) % vocab
    noise = torch.rand(n, length + 1, generator=g) < 0.05
    return torch.where(noise, torch.randint(0, vocab, seq.shape, generator=g), seq)


def run(seed: int = 0, steps: int = 300, every: int = 1) -> zeroscan.Report:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed)
        model = TinyLM()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        with zeroscan.Monitor(model, opt, every=every, activations=True) as monitor:
            for _ in range(steps):
                seq = batch(64, 16, 16, g)
                logits = model(seq[:, :-1])
                loss = nn.functional.cross_entropy(logits.reshape(-1, 64), seq[:, 1:].reshape(-1))
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
        return monitor.report()


if __name__ == "__main__":
    print(run())
