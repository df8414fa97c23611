"""Checkpoint verdicts in each tensor's role (zeroscan.checkpoint.roles): a freshly
initialised ResNet-18 or transformer layer scans without findings, one
all-zero kernel among its zero biases and running means is the one warning,
a NaN is an error in any role, and --diff says "unchanged" unless the
second file was trained from the first."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import fresh_generator, fresh_seed, save_file_in_order
from models import resnet18
from torch import nn

from zeroscan.cli import main
from zeroscan.checkpoint.roles import Role, judge_in_role, tensor_role
from zeroscan.verdicts import Cause, Severity

FORMATS = ["pt", "safetensors"]


def fresh(model: Callable[..., nn.Module] = resnet18, **kwargs: object) -> dict[str, torch.Tensor]:
    """The state_dict of a freshly initialised model(**kwargs), drawn under a
    fresh seed without touching the caller's RNG."""
    with torch.random.fork_rng():
        torch.manual_seed(fresh_seed())
        state = model(**kwargs).state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


def save(state: dict[str, torch.Tensor], path: Path, fmt: str) -> Path:
    path = path.with_suffix(f".{fmt}")
    if fmt == "pt":
        torch.save(state, path)
    else:
        save_file_in_order(state, path)
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    capsys.readouterr()  # drop the printed seed
    rc = main(list(argv))
    return rc, capsys.readouterr().out


def scan(capsys: pytest.CaptureFixture[str], path: Path, *argv: str) -> tuple[int, dict]:
    rc, out = run(capsys, "scan", "--json", str(path), *argv)
    return rc, json.loads(out)


@pytest.mark.parametrize("zero_init_residual", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_fresh_resnet18_has_no_findings(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fmt: str, zero_init_residual: bool
) -> None:
    state = fresh(zero_init_residual=zero_init_residual)
    rc, doc = scan(capsys, save(state, tmp_path / "resnet18", fmt), "--fail-on", "info")
    rows = {r["name"]: r for r in doc["files"][0]["tensors"]}
    assert list(rows) == list(state)
    # Not vacuous: the 20 BatchNorm layers' biases, running means and counters are all zero (and 8 bn2
    # weights under zero-init residual), their weights and running variances all one.
    assert sum(r["verdict"] == "exact_zero" for r in rows.values()) == (68 if zero_init_residual else 60)
    assert sum(r["verdict"] == "constant" for r in rows.values()) == (32 if zero_init_residual else 40)
    assert doc["summary"]["findings"] == {"info": 0, "warning": 0, "error": 0} and rc == 0
    assert rows["layer1.0.bn2.bias"]["reason"].endswith("normal for a bias")
    want_roles = {"conv1.weight": "weight", "bn1.weight": "scale", "bn1.bias": "bias",
                  "layer2.0.downsample.1.running_mean": "running_mean", "layer4.1.bn2.running_var": "running_var",
                  "layer3.0.downsample.1.num_batches_tracked": "counter", "fc.weight": "weight", "fc.bias": "bias"}
    assert {name: rows[name]["role"] for name in want_roles} == want_roles


@pytest.mark.parametrize("name", ["layer2.0.conv1.weight", "conv1.weight", "layer3.0.downsample.0.weight", "fc.weight"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_one_zero_weight_is_the_one_warning(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fmt: str, name: str
) -> None:
    state = fresh()
    state[name].zero_()
    path = save(state, tmp_path / "resnet18", fmt)
    rc, doc = scan(capsys, path)
    findings = [r for r in doc["files"][0]["tensors"] if r["severity"] != "ok"]
    assert [(r["name"], r["verdict"], r["severity"]) for r in findings] == [(name, "exact_zero", "warning")]
    assert rc == 0  # a warning passes the default --fail-on error
    rc, out = run(capsys, "scan", str(path), "--only-findings", "--fail-on", "warning")
    assert rc == 1
    assert [line for line in out.splitlines() if line.startswith("  ")] == [
        f"  WARNING {name}: exact_zero: all {state[name].numel()} values are exactly zero"
    ]
    assert out.rstrip().endswith("122 tensors scanned, 1 finding (1 warning)")


@pytest.mark.parametrize("name", ["bn1.running_var", "layer4.1.bn2.running_var", "layer2.0.downsample.1.running_mean",
                                  "layer1.1.bn1.bias", "layer3.0.bn2.weight", "layer2.1.conv2.weight"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_nan_is_an_error_in_every_role(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fmt: str, name: str
) -> None:
    g = fresh_generator()
    state = fresh()
    flat = state[name].view(-1)
    flat[int(torch.randint(0, flat.numel(), (), generator=g))] = math.nan
    path = save(state, tmp_path / "resnet18", fmt)
    rc, doc = scan(capsys, path)
    findings = [(r["name"], r["verdict"], r["severity"]) for r in doc["files"][0]["tensors"] if r["severity"] != "ok"]
    assert findings == [(name, "nonfinite", "error")]
    assert rc == 1  # the default --fail-on error fails a CI step
    rc, out = run(capsys, "scan", str(path))
    assert rc == 1 and f"ERROR {name}: nonfinite: " in out and " not finite (1 NaN); " in out
    assert run(capsys, "scan", str(path), "--fail-on", "none")[0] == 0


def test_a_zero_running_var_is_still_a_warning(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    state = fresh()
    state["layer1.0.bn1.running_var"].zero_()  # every input of every channel the same: a dead layer upstream
    _, doc = scan(capsys, save(state, tmp_path / "resnet18", "pt"))
    findings = [(r["name"], r["severity"]) for r in doc["files"][0]["tensors"] if r["severity"] != "ok"]
    assert findings == [("layer1.0.bn1.running_var", "warning")]


def transformer_layer() -> nn.Module:
    g = fresh_generator()
    d = int(torch.randint(2, 5, (), generator=g)) * 8
    return nn.ModuleDict({
        "embed": nn.Embedding(int(torch.randint(20, 200, (), generator=g)), d, padding_idx=0),
        "layer": nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=2 * d),
        "norm": nn.LayerNorm(d),
    })


def test_a_fresh_transformer_layer_has_no_findings(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    state = fresh(transformer_layer)
    assert not state["embed.weight"][0].any()  # the padding row is zero
    rc, doc = scan(capsys, save(state, tmp_path / "transformer", "safetensors"), "--fail-on", "info")
    rows = {r["name"]: r for r in doc["files"][0]["tensors"]}
    assert rows["layer.self_attn.in_proj_bias"]["verdict"] == "exact_zero"  # not vacuous
    assert doc["summary"]["findings"] == {"info": 0, "warning": 0, "error": 0} and rc == 0


@pytest.mark.parametrize(
    ("name", "shape", "role"),
    [
        ("layer1.0.conv1.weight", [64, 64, 3, 3], Role.WEIGHT),
        ("fc.weight", [10, 512], Role.WEIGHT),
        ("embed.weight", [100, 16], Role.WEIGHT),
        ("model.tensor", [4, 4], Role.WEIGHT),
        ("fc.bias", [10], Role.BIAS),
        ("layer.self_attn.in_proj_bias", [96], Role.BIAS),
        ("pos_bias", [8, 8], Role.BIAS),  # a bias by name whatever its shape
        ("bert.embeddings.LayerNorm.beta", [768], Role.BIAS),
        ("layer1.0.bn2.weight", [64], Role.SCALE),
        ("bert.embeddings.LayerNorm.gamma", [768], Role.SCALE),
        ("bn1.running_mean", [64], Role.RUNNING_MEAN),
        ("bn1.running_var#2", [64], Role.RUNNING_VAR),
        ("bn1.num_batches_tracked", [], Role.COUNTER),
        ("optimizer.state.0.exp_avg", [3], Role.OTHER),
        ("b", [5], Role.OTHER),
    ],
)
def test_tensor_role(name: str, shape: list[int], role: Role) -> None:
    assert tensor_role(name, shape) is role
    assert tensor_role(name, torch.Size(shape)) is role


def test_tensor_role_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="name must be a str, got int"):
        tensor_role(3, [1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="shape must be a sequence of ints, got int"):
        tensor_role("fc.weight", 2)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("role", "cause", "severity", "want"),
    [
        (Role.BIAS, Cause.EXACT_ZERO, Severity.WARNING, Severity.OK),
        (Role.SCALE, Cause.CONSTANT, Severity.INFO, Severity.OK),
        (Role.RUNNING_VAR, Cause.CONSTANT, Severity.INFO, Severity.OK),
        (Role.RUNNING_VAR, Cause.EXACT_ZERO, Severity.WARNING, Severity.WARNING),
        (Role.BIAS, Cause.UNDERFLOW, Severity.WARNING, Severity.WARNING),
        (Role.BIAS, Cause.NONFINITE, Severity.ERROR, Severity.ERROR),
        (Role.RUNNING_MEAN, Cause.NONFINITE, Severity.ERROR, Severity.ERROR),
        (Role.WEIGHT, Cause.EXACT_ZERO, Severity.WARNING, Severity.WARNING),
        (Role.OTHER, Cause.EXACT_ZERO, Severity.WARNING, Severity.WARNING),
    ],
)
def test_judge_in_role(role: Role, cause: Cause, severity: Severity, want: Severity) -> None:
    got, reason = judge_in_role(role, cause, severity, "why")
    assert got is want
    assert reason == "why" if want == severity else reason.startswith("why, which is normal for ")


@pytest.mark.parametrize("fmt", FORMATS)
def test_diff_says_unchanged_unless_trained_from_first(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fmt: str
) -> None:
    g = fresh_generator()
    before = fresh()
    after = {k: v.clone() for k, v in before.items()}
    w = after["layer2.0.conv1.weight"].view(-1)
    w[torch.randperm(w.numel(), generator=g)[:10]] += 0.25
    pa, pb = save(before, tmp_path / "a", fmt), save(after, tmp_path / "b", fmt)
    floats = sum(1 for k, v in before.items() if v.is_floating_point() and k != "layer2.0.conv1.weight")

    rc, out = run(capsys, "scan", str(pa), str(pb), "--diff", "--json", "--fail-on", "warning")
    rows = {r["name"]: r for r in json.loads(out)["tensors"]}
    assert rc == 0 and rows["layer2.0.conv1.weight"]["status"] == "changed"
    unchanged = [r for r in rows.values() if r["severity"] == "info"]
    assert len(unchanged) == floats
    assert all(r["reason"] == "unchanged while 1 other tensor changed" for r in unchanged)
    rc, out = run(capsys, "scan", str(pa), str(pb), "--diff", "--only-findings")
    assert "unchanged" in out and "never updated" not in out

    rc, out = run(capsys, "scan", str(pa), str(pb), "--diff", "--json", "--fail-on", "warning", "--trained-from-first")
    doc = json.loads(out)
    rows = {r["name"]: r for r in doc["tensors"]}
    assert rc == 1 and doc["trained_from_first"] is True
    never = [r for r in rows.values() if r["severity"] == "warning"]
    assert len(never) == floats and all(r["reason"].endswith("never updated") for r in never)
    assert rows["bn1.num_batches_tracked"]["severity"] == "ok"  # an integer counter is not trained
    rc, out = run(capsys, "scan", str(pa), str(pb), "--diff", "--only-findings", "--trained-from-first")
    assert "never updated" in out and "layer1.0.bn1.bias" in out


class MaskedAttention(nn.Module):
    """Keeps its additive masks as buffers, as many attention layers do."""

    def __init__(self, t: int) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        causal = torch.zeros(t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        self.register_buffer("causal_mask", causal)
        slopes = -torch.arange(t).float()[None, :].abs()
        self.register_buffer("alibi", slopes.expand(t, t).masked_fill(causal < 0, float("-inf")).clone())


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_additive_mask_buffer_is_normal_and_a_nan_in_it_is_not(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fmt: str
) -> None:
    """-inf alone in a tensor named as a mask (a causal mask; not named by the
    issue: an ALiBi buffer) is how an additive mask blocks attention; a NaN or
    a +inf in it, and -inf in a weight, stay errors."""
    g = fresh_generator()
    t = int(torch.randint(4, 9, (), generator=g))
    state = fresh(MaskedAttention, t=t)
    rc, doc = scan(capsys, save(state, tmp_path / "healthy", fmt), "--fail-on", "info")
    rows = {r["name"]: r for r in doc["files"][0]["tensors"]}
    assert {rows[n]["role"] for n in ("causal_mask", "alibi")} == {"mask"}
    assert rows["causal_mask"]["verdict"] == "nonfinite" and rows["causal_mask"]["severity"] == "ok"  # not vacuous
    assert "normal for an additive mask" in rows["alibi"]["reason"]
    assert doc["summary"]["findings"] == {"info": 0, "warning": 0, "error": 0} and rc == 0
    for name, value in (("causal_mask", math.nan), ("alibi", math.inf), ("proj.weight", -math.inf)):
        bad = {k: v.clone() for k, v in state.items()}
        bad[name].view(-1)[0] = value
        rc, doc = scan(capsys, save(bad, tmp_path / f"bad_{name}", fmt))
        errors = [r["name"] for r in doc["files"][0]["tensors"] if r["severity"] == "error"]
        assert errors == [name] and rc == 1, (name, errors)
