"""Models with a planted birth of inf/NaN, for the trace_nonfinite tests.

A `Plant` module is the identity until armed; armed, it makes one of the
faults training runs meet. `Tiny transformer` and `SmallCNN` hold one, and
the transformer's attention can also be given a fully masked row. `PLANTS`
says, per fault, where the trace must say it was born.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

WIDTH, VOCAB, LENGTH = 16, 40, 8


class Plant(nn.Module):
    """x as it is, until `fault` is set; then the fault, at this module."""

    def __init__(self) -> None:
        super().__init__()
        self.fault: str | None = None
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fault = self.fault
        if fault is None:
            return x * self.scale
        if fault == "log_zero":  # forward: -inf
            return x + torch.log(torch.zeros_like(x[..., :1]))
        if fault == "divide_by_zero_norm":  # forward: x / 0 -> inf (NaN where x == 0)
            return x / (x - x).norm()
        if fault == "fp16_overflow":  # forward: a float16 matmul whose every sum passes 65504
            big = torch.full((x.shape[-1], x.shape[-1]), 6e4, dtype=torch.float16, device=x.device)
            return ((x.abs() + 1).half() @ big).float() + x
        if fault == "sqrt_at_zero":  # forward finite; backward: inf * 0 = NaN
            return x + torch.sqrt((x - x.detach()) ** 2)
        if fault == "sqrt_at_zero_of_weight":  # the same, in the gradient of this module's own weight only
            return x * self.scale + torch.sqrt((self.scale - self.scale.detach()) ** 2)
        raise ValueError(f"unknown fault {fault!r}")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.0)
        self.mask_out_row: int | None = None  # a query row that sees no key: softmax over nothing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        if self.mask_out_row is not None:
            mask[self.mask_out_row] = False
        scores = (q @ k.transpose(-1, -2) / WIDTH**0.5).masked_fill(~mask, float("-inf"))
        return self.proj(self.drop(scores.softmax(-1)) @ v)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.ln_2 = nn.LayerNorm(WIDTH)
        # The Plant first: the MLP's input is the Plant's too, so the innermost taker must be named.
        self.mlp = nn.Sequential(Plant(), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.Conv2d(8, WIDTH, 3, padding=1), nn.BatchNorm2d(WIDTH), nn.ReLU(inplace=True),
        )
        self.plant = Plant()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(WIDTH, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.features(images).permute(0, 2, 3, 1)  # channels last, for the Plant's matmul
        x = self.plant(x).permute(0, 3, 1, 2)
        return self.fc(torch.flatten(self.pool(x), 1))


class Expected(NamedTuple):
    phase: str  # "forward" or "backward"
    name: str  # the module (or parameter, or "(input batch)") the trace must name


PLANT_AT = {"transformer": "blocks.1.mlp.0", "cnn": "plant"}
WEIGHT_AT = {"transformer": "blocks.1.mlp.3.weight", "cnn": "fc.weight"}

# fault -> the models it is planted in, and what the trace must say.
PLANTS: dict[str, tuple[tuple[str, ...], dict[str, Expected]]] = {
    "log_zero": (("transformer", "cnn"), {m: Expected("forward", PLANT_AT[m]) for m in PLANT_AT}),
    "divide_by_zero_norm": (("transformer", "cnn"), {m: Expected("forward", PLANT_AT[m]) for m in PLANT_AT}),
    "fp16_overflow": (("transformer", "cnn"), {m: Expected("forward", PLANT_AT[m]) for m in PLANT_AT}),
    "sqrt_at_zero": (("transformer", "cnn"), {m: Expected("backward", PLANT_AT[m]) for m in PLANT_AT}),
    "sqrt_at_zero_of_weight": (("transformer", "cnn"), {m: Expected("backward", PLANT_AT[m]) for m in PLANT_AT}),
    "masked_softmax_row": (("transformer",), {"transformer": Expected("forward", "blocks.0.attn")}),
    "nan_input": (("cnn",), {"cnn": Expected("forward", "(input batch)")}),
    "nan_weight": (("transformer", "cnn"), {m: Expected("forward", WEIGHT_AT[m]) for m in WEIGHT_AT}),
    "loss_outside": (("transformer", "cnn"), {m: Expected("backward", "(outside the model)") for m in PLANT_AT}),
}

PLANT_FAULTS = ("log_zero", "divide_by_zero_norm", "fp16_overflow", "sqrt_at_zero", "sqrt_at_zero_of_weight")
CASES = [(fault, model) for fault, (models, _) in PLANTS.items() for model in models]


def make_model(kind: str, g: torch.Generator) -> nn.Module:
    torch.manual_seed(int(torch.randint(0, 2**31, (), generator=g)))
    return TinyTransformer() if kind == "transformer" else SmallCNN()


def batch(kind: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "transformer":
        tokens = torch.randint(0, VOCAB, (4, LENGTH + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 10, (4,), generator=g)


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, outside: bool = False) -> torch.Tensor:
    out = model(inputs)
    loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))
    if outside:  # the loss's own sqrt at 0: its value is finite, the gradient it gives the model is NaN
        loss = loss + ((out - out.detach()) ** 2).sum().sqrt()
    return loss


def arm(model: nn.Module, kind: str, fault: str | None, inputs: torch.Tensor) -> torch.Tensor:
    """Sets (or with None clears) the fault; returns the inputs to use."""
    planted = dict(model.named_modules())[PLANT_AT[kind]]
    for m in model.modules():
        if isinstance(m, Plant):
            m.fault = fault if m is planted and fault in PLANT_FAULTS else None
        if isinstance(m, Attention):
            m.mask_out_row = 3 if fault == "masked_softmax_row" and m is model.blocks[0].attn else None
    if fault == "nan_weight":
        with torch.no_grad():
            dict(model.named_parameters())[WEIGHT_AT[kind]][0, 0] = float("nan")
    if fault == "nan_input":
        inputs = inputs.clone()
        inputs[1, 2, 3, 4] = float("nan")
    return inputs
