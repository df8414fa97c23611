"""The Monitor on real training code: the bugs people hit with ResNet-18,
GPT-2, BERT, Mixtral, LoRA, AMP and checkpointing, each named with its
parameter and cause, and healthy designs that must raise nothing above INFO
over 20+ steps. transformers and peft come from the `models` test extra
(small configs, no downloads); ResNet-18 is tests/models.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from helpers import example, fresh_generator, serious
from models import resnet18
from zeroscan import Monitor, Report, Severity
from zeroscan.monitor import GLOBAL_NAME

STEPS = 22  # "over 20+ steps"


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture
def g() -> torch.Generator:
    gen = fresh_generator()
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))  # model init
    return gen


def causes(report: Report) -> set[tuple[str, str]]:
    """(name, cause) of each tensor's own finding (see Report.detailed)."""
    return {(f.name, f.cause) for f in report.detailed}


def above_info(report: Report) -> list[str]:
    return [f"{f.severity.name} {f.name} {f.cause}: {f.message}" for f in serious(report)]


def fit(
    model: nn.Module,
    batch: Callable[[], tuple[Any, ...]],
    loss_of: Callable[..., torch.Tensor],
    *,
    steps: int = STEPS,
    lr: float = 1e-3,
    opt: torch.optim.Optimizer | None = None,
    **monitor: Any,
) -> Report:
    """`steps` AdamW steps of the usual loop under a Monitor; its report."""
    opt = opt or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    with Monitor(model, opt, **monitor) as mon:
        for _ in range(steps):
            opt.zero_grad()
            loss_of(model, *batch()).backward()
            opt.step()
    return mon.report()


def images(g: torch.Generator, n: int = 4, classes: int = 10) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    return lambda: (torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, classes, (n,), generator=g))


def classify(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


# ---- transformers / peft (the `models` test extra) ---------------------------


def transformers_or_skip() -> Any:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def gpt2(**config: Any) -> nn.Module:
    t = transformers_or_skip()
    cfg = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=32)
    return t.GPT2LMHeadModel(t.GPT2Config(**{**cfg, **config}))


def tokens(g: torch.Generator, vocab: int = 96, n: int = 4, length: int = 16) -> Callable[[], tuple[torch.Tensor]]:
    return lambda: (torch.randint(0, vocab, (n, length), generator=g),)


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


# ---- 1. unregistered trainable state ------------------------------------------


class Containers(nn.Module):
    """Modules and parameters kept in plain Python containers."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.blocks = [nn.Linear(8, 8), nn.Linear(8, 8)]  # meant: nn.ModuleList
        self.heads = {"a": nn.Linear(8, 2)}  # meant: nn.ModuleDict
        self.gains = (nn.Parameter(torch.ones(8)),)  # meant: nn.ParameterList
        self.skip = [self.stem]  # a second reference to a registered module: fine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = torch.relu(block(h)) * self.gains[0]
        return self.heads["a"](h)


def test_modules_and_parameters_in_plain_containers(g: torch.Generator) -> None:
    model = Containers()
    report = fit(model, lambda: (torch.randn(8, 6, generator=g), torch.randint(0, 2, (8,), generator=g)),
                 classify, steps=2)
    found = {f.name: f for f in report.findings}
    assert set(found) == {"blocks", "heads", "gains"}, str(report)
    assert all(f.cause == "plain_attribute" and f.severity == Severity.WARNING for f in found.values())
    assert "blocks[0], blocks[1]" in found["blocks"].message and "use nn.ModuleList" in found["blocks"].message
    assert "heads['a']" in found["heads"].message and "use nn.ModuleDict" in found["heads"].message
    assert "gains[0]" in found["gains"].message and "use nn.ParameterList" in found["gains"].message


# ---- 2. the model as it is now ---------------------------------------------------


@pytest.mark.parametrize("replaced", ["after_monitor", "before_monitor"])
def test_head_replaced_after_the_optimizer(g: torch.Generator, replaced: str) -> None:
    model = resnet18(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    if replaced == "before_monitor":
        model.fc = nn.Linear(512, 5)
    with Monitor(model, opt) as mon:
        if replaced == "after_monitor":
            model.fc = nn.Linear(512, 5)  # a new head: the optimizer still holds the old one
        for _ in range(3):
            x, y = images(g, classes=5)()
            opt.zero_grad()
            classify(model, x, y).backward()
            opt.step()
    report = mon.report()
    assert causes(report) == {("fc.weight", "not_in_optimizer"), ("fc.bias", "not_in_optimizer")}, str(report)
    assert all("never ran" not in f.message for f in report.findings)
    rows = {(t["name"], t["kind"]): t for t in report.tensors}
    assert rows[("fc.weight", "weight")]["numel"] == 512 * 5  # the new head is scanned
    assert rows[("fc.weight", "grad")]["norm"] > 0


def test_module_deleted_is_noticed_at_report(g: torch.Generator) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 1)
            self.extra = nn.Linear(4, 4)  # never used

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with Monitor(model, opt) as mon:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 4, generator=g)).square().mean().backward()
            opt.step()
        assert {f.name for f in mon.report().detailed} == {"extra.weight", "extra.bias"}
        del model.extra  # no registration hook runs for del
        report = mon.report()
    assert report.findings == [], str(report)
    assert {t["name"] for t in report.tensors} == {"fc.weight", "fc.bias"}


# ---- 3. steps where optimizer.step() does not run ----------------------------------


def scaler_loop(
    model: nn.Module, g: torch.Generator, steps: int, init_scale: float, gain: float = 1.0
) -> tuple[Report, int]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    taken = 0
    with Monitor(model, opt) as mon:
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = gain * model(torch.randn(8, 6, generator=g)).float().square().mean()
            scaler.scale(loss).backward()
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            taken += scaler.get_scale() >= scale  # the scale falls exactly when the step was skipped
    return mon.report(), taken


def test_gradscaler_skipping_every_step_is_an_error(g: torch.Generator) -> None:
    model = example("gradscaler_skipping").LogFeatures()  # log(relu(...)): NaN gradients
    report, taken = scaler_loop(model, g, steps=5, init_scale=2.0**16)
    assert taken == 0
    (skip,) = [f for f in report.findings if f.cause == "skipped_steps"]
    assert skip.severity == Severity.ERROR and skip.name == GLOBAL_NAME, str(report)
    assert "every one of the 5 monitored steps" in skip.message
    assert "first appeared at step 0, in fc1.weight, fc1.bias" in skip.message
    assert report.step == 4 and "0 tensors" not in str(report)
    assert not [f for f in report.findings if f.cause == "nonfinite"]  # named once, in the skip finding


def test_gradscaler_calibrating_is_info(g: torch.Generator) -> None:
    """A huge initial scale overflows the first steps; GradScaler halves it
    until the steps go through: normal, at most INFO."""
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    report, taken = scaler_loop(model, g, steps=STEPS, init_scale=2.0**127, gain=10.0)
    assert 0 < taken < STEPS
    assert above_info(report) == []
    (skip,) = [f for f in report.findings if f.cause == "skipped_steps"]
    assert skip.severity == Severity.INFO and f"{STEPS - taken} of {STEPS}" in skip.message, skip.message


def test_report_without_any_step_scans_what_is_there(g: torch.Generator) -> None:
    model = nn.Linear(6, 2)
    mon = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(4, 6, generator=g)).square().sum().backward()  # backward, no step
    report = mon.report()
    mon.close()
    (no_step,) = [f for f in report.findings if f.cause == "no_step"]
    assert no_step.severity == Severity.WARNING and "no optimizer step was seen after the 1 monitored" in no_step.message
    grads = {t["name"]: t for t in report.tensors if t["kind"] == "grad"}
    assert grads["weight"]["norm"] == pytest.approx(float(model.weight.grad.norm()), rel=1e-6)


# ---- 4. whole-model causes named once ----------------------------------------------


@pytest.mark.parametrize("warm", [0, 2], ids=["first step", "gradients read at the step only"])
@pytest.mark.parametrize("how", ["clip_to_zero", "loss_times_zero", "loss_times_zero_clipped"])
def test_every_gradient_zero_is_one_finding(g: torch.Generator, how: str, warm: int) -> None:
    """After `warm` ordinary steps the Monitor reads the gradients at the step
    only, and what backward left is told by the witness it reads then
    (monitor/deferred.py); at the first step, by its read of every gradient."""
    model = resnet18(num_classes=4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    batch = images(g, classes=4)
    with Monitor(model, opt) as mon:
        for step in range(warm + 1):
            x, y = batch()
            opt.zero_grad()
            loss = classify(model, x, y)
            (loss * 0 if how.startswith("loss_times_zero") and step == warm else loss).backward()
            if how == "clip_to_zero" and step == warm:
                nn.utils.clip_grad_norm_(model.parameters(), max_norm=0)
            if how == "loss_times_zero_clipped":  # changes the gradients in place after backward, by 1
                nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
            opt.step()
    report = mon.report()
    zero = [f for f in report.findings if f.cause == "exact_zero"]
    assert len(zero) == 1 and zero[0].name == GLOBAL_NAME, str(report)
    words = "nonzero when backward() finished" if how == "clip_to_zero" else "backward() itself produced zeros"
    assert words in zero[0].message and f"({len(list(model.parameters()))} tensors)" in zero[0].message


# ---- 5. healthy designs: nothing above INFO over 20+ steps -------------------------


class MoE(nn.Module):
    """Top-1 routing over experts in an nn.ModuleList: an expert that gets no
    token in a step gets no gradient in that step."""

    def __init__(self, experts: int = 8, width: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        with torch.no_grad():  # every expert as likely as the others (a random router may starve one)
            self.router.weight.copy_(3 * torch.eye(experts, width))
            self.router.bias.zero_()
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.router(x).softmax(-1)
        top = gate.argmax(-1)
        h = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = top == e
            if hit.any():
                h = h.index_put((hit.nonzero()[:, 0],), expert(x[hit]) * gate[hit, e : e + 1])
        return self.out(h)


def test_moe_experts_without_tokens_in_some_steps(g: torch.Generator) -> None:
    model = MoE()
    seen = torch.zeros(8, dtype=torch.bool)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Monitor(model, opt) as mon:
        for _ in range(STEPS):
            x = torch.randn(6, 8, generator=g)  # 6 tokens, 8 experts: some always idle
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            seen |= torch.tensor([e.weight.grad is not None for e in model.experts])
    report = mon.report()
    assert above_info(report) == [], str(report)
    idle = {f.name for f in report.findings if f.cause == "conditional"}
    assert all(f.severity == Severity.INFO for f in report.findings)
    never = {f"experts.{e}.weight" for e in range(8) if not seen[e]}
    assert not never, "an expert never got a token: not the design this test is about"
    assert idle  # 6 tokens top-1 over 8 experts: at least 2 idle at every step


def test_mixtral_trains_without_alarms(g: torch.Generator) -> None:
    t = transformers_or_skip()
    model = t.MixtralForCausalLM(t.MixtralConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
        vocab_size=96, max_position_embeddings=32, num_local_experts=8, num_experts_per_tok=2,
    ))
    report = fit(model, tokens(g), lm_loss)
    assert above_info(report) == [], str(report)


def test_lora_zero_init_is_info_then_trains(g: torch.Generator) -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    first = fit(model, tokens(g), lm_loss, steps=1)
    lora_a = {f.name for f in first.findings if f.cause == "exact_zero"}
    assert lora_a and all("lora_A" in name for name in lora_a), str(first)  # B = 0: A's first gradient is 0
    assert above_info(first) == [], str(first)
    report = fit(model, tokens(g), lm_loss)
    assert above_info(report) == [], str(report)
    assert {f.cause for f in report.findings} == {"frozen"}  # the base model, one consistent cause


def test_resnet_zero_init_residual(g: torch.Generator) -> None:
    model = resnet18(zero_init_residual=True)
    first = fit(model, images(g), classify, steps=1, lr=1e-2)
    zero = {f.name for f in first.detailed if f.cause == "exact_zero"}
    assert "layer1.0.conv2.weight" in zero and above_info(first) == [], str(first)
    assert len([f for f in first.findings if f.cause == "exact_zero"]) == 1  # one design, one finding
    report = fit(model, images(g), classify, steps=STEPS, lr=1e-2)
    assert above_info(report) == [], str(report)


def test_frozen_backbone_with_a_new_head(g: torch.Generator) -> None:
    model = resnet18()
    for p in model.parameters():
        p.requires_grad_(False)
    model.fc = nn.Linear(512, 3)
    report = fit(model, images(g, classes=3), classify, lr=1e-2)
    assert above_info(report) == [], str(report)
    assert {f.cause for f in report.findings} == {"frozen"}


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_transformers_train_without_alarms(g: torch.Generator, name: str) -> None:
    if name == "gpt2":  # tied input and output embeddings; rows of unused tokens get no gradient
        report = fit(gpt2(), tokens(g, vocab=48), lm_loss, activations=True)
    else:
        t = transformers_or_skip()
        model = t.BertForSequenceClassification(t.BertConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=96,
            max_position_embeddings=32, num_labels=3,
        ))
        batch = tokens(g)
        report = fit(model, lambda: (*batch(), torch.randint(0, 3, (4,), generator=g)),
                     lambda m, ids, y: m(input_ids=ids, labels=y).loss)
    assert above_info(report) == [], str(report)


def test_gradient_checkpointing_non_reentrant(g: torch.Generator) -> None:
    model = gpt2()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    report = fit(model, tokens(g), lm_loss)
    assert report.findings == [], str(report)


def test_gradient_accumulation(g: torch.Generator) -> None:
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with Monitor(model, opt) as mon:
        for _ in range(STEPS):
            opt.zero_grad()
            for _ in range(4):  # four micro-batches per optimizer step
                (model(torch.randn(4, 6, generator=g)).square().mean() / 4).backward()
            opt.step()
    report = mon.report()
    assert report.findings == [] and report.history["steps"] == list(range(STEPS)), str(report)
    last = {t["name"]: t for t in report.tensors if t["kind"] == "grad"}
    assert last["0.weight"]["norm"] == pytest.approx(float(model[0].weight.grad.norm()), rel=1e-6)


def test_autocast_bfloat16(g: torch.Generator) -> None:
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x).float().square().mean()

    report = fit(model, lambda: (torch.randn(16, 6, generator=g),), loss)
    assert above_info(report) == [], str(report)


def test_gan_detach_monitoring_both_nets(g: torch.Generator) -> None:
    gen = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 6))
    disc = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    bce = nn.functional.binary_cross_entropy_with_logits
    with Monitor(gen, opt_g) as mon_g, Monitor(disc, opt_d) as mon_d:
        for _ in range(STEPS):
            real = torch.randn(8, 6, generator=g)
            fake = gen(torch.randn(8, 4, generator=g))
            opt_d.zero_grad()
            d_loss = bce(disc(real), torch.ones(8, 1)) + bce(disc(fake.detach()), torch.zeros(8, 1))
            d_loss.backward()
            opt_d.step()
            opt_g.zero_grad()
            bce(disc(fake), torch.ones(8, 1)).backward()  # also fills disc's .grad; no opt_d step follows
            opt_g.step()
    report_g, report_d = mon_g.report(), mon_d.report()
    assert report_g.findings == [] and report_d.findings == [], f"{report_g}\n{report_d}"
    assert report_g.history["steps"] == list(range(STEPS))
    # The generator's backward pass through disc is no step of disc: only its own steps show.
    assert len(report_d.history["steps"]) == STEPS


# ---- 6. causes worded precisely -------------------------------------------------------


def test_loss_rebuilt_from_a_number_vs_zero_grad_before_step(g: torch.Generator) -> None:
    model = nn.Linear(5, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, opt) as mon:
        opt.zero_grad()
        loss = model(torch.randn(3, 5, generator=g)).square().sum()
        torch.tensor(loss.item(), requires_grad=True).backward()  # the graph is gone
        opt.step()
    rebuilt = mon.report().findings
    assert {f.cause for f in rebuilt} == {"no_backward"}
    assert all("rebuilt from a Python number" in f.message and "zero_grad" not in f.message for f in rebuilt)

    with Monitor(model, opt) as mon:
        model(torch.randn(3, 5, generator=g)).square().sum().backward()
        opt.zero_grad()  # between backward() and step()
        opt.step()
    cleared = mon.report().findings
    assert {f.cause for f in cleared} == {"grad_cleared"}
    assert all("ran between backward() and step()" in f.message and "rebuilt" not in f.message for f in cleared)


def test_reentrant_checkpoint_without_grad_inputs(g: torch.Generator) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(checkpoint(self.block, x, use_reentrant=True))  # x does not require grad

    model = Net()
    report = fit(model, lambda: (torch.randn(4, 6, generator=g),), lambda m, x: m(x).square().mean(), steps=2)
    assert causes(report) == {("block.0.weight", "detached"), ("block.0.bias", "detached")}, str(report)
    for f in report.findings:
        assert "use_reentrant=True" in f.message and "use_reentrant=False" in f.message
        assert "torch.no_grad()" not in f.message


def test_first_nonfinite_step_and_parameters(g: torch.Generator) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with Monitor(model, opt) as mon:
        for step in range(6):
            opt.zero_grad()
            model(torch.randn(4, 4, generator=g)).square().mean().backward()
            if step == 3:
                model[2].bias.grad.fill_(float("nan"))  # poisons the weights from here on
            opt.step()
    report = mon.report()
    (first,) = [f for f in report.findings if f.name == GLOBAL_NAME and f.cause == "nonfinite"]
    assert "first appeared at step 3, in 2.bias" in first.message and first.severity == Severity.ERROR
