"""A NaN born in an attention mask. A small causal language model pads its
batches on the left and masks the padding out of attention. At step 7 the
data loader yields a batch with a short sequence: for its first (padding)
positions the causal mask and the padding mask together leave no key at
all, softmax over a row of -inf gives NaN, and from that step on every
gradient, then every weight, is NaN. The loss says only "nan".

Monitor(trace_nonfinite=True) names the step (7, not the later step where
someone looks), the pass (forward) and the module (blocks.0.attn, in its own
code before it calls its output projection).

    python examples/nan_in_attention_mask.py
"""

from __future__ import annotations

import torch
from torch import nn

import zeroscan

VOCAB, WIDTH, LENGTH, PAD = 64, 32, 12, 0


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        allowed = causal & keep[:, None, :]  # [batch, query, key]: the bug: a padding query may see no key
        scores = (q @ k.transpose(-1, -2)) / WIDTH**0.5
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        return self.proj(weights @ v)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), keep)
        return x + self.mlp(self.ln_2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(LENGTH, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        keep = tokens != PAD
        x = self.emb(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x, keep)
        return self.head(x)


def batch(step: int, g: torch.Generator) -> torch.Tensor:
    """Full-length sequences, except at step 7: one of 3 tokens, left-padded."""
    tokens = torch.randint(1, VOCAB, (4, LENGTH + 1), generator=g)
    if step == 7:
        tokens[2, : LENGTH + 1 - 3] = PAD
    return tokens


def run(seed: int = 0, steps: int = 10) -> zeroscan.Report:
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with zeroscan.Monitor(model, opt, trace_nonfinite=True) as monitor:
        for step in range(steps):
            tokens = batch(step, g)
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(
                logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), ignore_index=PAD
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
    return monitor.report()


if __name__ == "__main__":
    report = run()
    print(report)
    print("\nReport.nonfinite_origin:", report.nonfinite_origin)
