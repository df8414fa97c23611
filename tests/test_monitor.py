"""zeroscan.Monitor: gradient-cause analysis, per-step scanning, history
findings, the Report forms and robustness. Every case of examples/ runs here
(with a fresh seed) and its findings are checked exactly."""

from __future__ import annotations

import json
import math
import sys
import types
from typing import Any

import pytest
import torch
from torch import nn

import zeroscan
import zeroscan.monitor as monitor_module
import zeroscan.monitor.scanner as monitor_scans
from helpers import DEVICES, example, fresh_generator, serious, train_monitored
from zeroscan import Finding, Monitor, Report, Severity, Thresholds, Verdict

TENSOR_KEYS = {
    "name", "kind", "numel", "zero_fraction", "subnormal_fraction", "near_zero_fraction",
    "nan", "inf", "norm", "mean", "std", "min_abs", "max_abs",
}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def seed() -> int:
    return int(torch.randint(0, 2**31 - 1, (), generator=fresh_generator()))


def by_name(report: Report) -> dict[str, list[Finding]]:
    """Each tensor's own findings (the members of a grouped finding, by name)."""
    out: dict[str, list[Finding]] = {}
    for f in report.detailed:
        out.setdefault(f.name, []).append(f)
    return out


def causes(report: Report) -> set[tuple[str, str]]:
    """(name, cause) of each tensor's own finding (see Report.detailed)."""
    return {(f.name, f.cause) for f in report.detailed}


# ---- the cases of examples/ ------------------------------------------------


def test_detach_between_layers() -> None:
    report = example("detach_between_layers").run(seed())
    assert causes(report) == {("fc1.weight", "detached"), ("fc1.bias", "detached")}
    assert len(report.findings) == 1  # one cut, one finding
    for f in report.detailed:
        assert f.severity == Severity.ERROR and f.kind == "grad"
        assert ".detach()" in f.message and "Net" in f.message


def test_detach_hidden_in_custom_module() -> None:
    report = example("detach_in_custom_module").run(seed())
    cut = {"0.weight", "0.bias", "2.proj.weight", "2.proj.bias"}
    assert causes(report) == {(name, "detached") for name in cut}
    for f in report.detailed:
        assert "Normalize" in f.message  # where the cut is


def test_weight_detached_inside_forward() -> None:
    report = example("weight_detached_in_forward").run(seed())
    assert causes(report) == {("0.weight", "detached")}
    (f,) = report.findings
    assert f.severity == Severity.ERROR and "ScaledLinear" in f.message and "detached inside" in f.message


def test_input_without_grad_is_healthy() -> None:
    diagnosis, report = example("input_without_grad").run(seed())
    assert diagnosis.verdict is Verdict.HEALTHY
    assert report.findings == []
    grads = [t for t in report.tensors if t["kind"] == "grad"]
    assert len(grads) == 4 and all(t["norm"] > 0 for t in grads)


def test_plain_attribute_bias() -> None:
    report = example("plain_attribute_bias").run(seed())
    assert causes(report) == {("0.bias", "plain_attribute")}
    (f,) = report.findings
    assert f.severity == Severity.WARNING and f.kind == "param" and "nn.Parameter" in f.message


def test_modules_in_a_python_list() -> None:
    report = example("modules_in_a_list").run(seed())
    assert causes(report) == {("hidden", "plain_attribute")}
    (f,) = report.findings
    assert f.severity == Severity.WARNING and "hidden[0], hidden[1], hidden[2]" in f.message
    assert "use nn.ModuleList" in f.message


def test_gradscaler_skipping_every_step() -> None:
    report = example("gradscaler_skipping").run(seed())
    assert causes(report) == {(monitor_module.GLOBAL_NAME, "skipped_steps")}
    (f,) = report.findings
    assert f.severity == Severity.ERROR and "every one of the 4 monitored steps" in f.message
    assert "first appeared at step 0, in fc1.weight" in f.message


def test_parameter_left_out_of_optimizer() -> None:
    report = example("param_not_in_optimizer").run(seed())
    assert causes(report) == {("temperature", "not_in_optimizer")}
    assert "not changed for 4 monitored steps" in report.findings[0].message


def test_frozen_layer_is_info_only() -> None:
    report = example("frozen_layer").run(seed())
    assert causes(report) == {("0.weight", "frozen"), ("0.bias", "frozen")}
    assert all(f.severity == Severity.INFO for f in report.findings)


def test_dead_relu_layer() -> None:
    report = example("dead_relu").run(seed())
    assert causes(report) == {
        ("1", "dead_units"), ("0.weight", "exact_zero"), ("0.bias", "exact_zero"), ("2.weight", "exact_zero"),
    }
    assert report.findings[0].name == "1" and report.findings[0].severity == Severity.ERROR
    for f in report.findings[1:]:
        assert "1 is dead" in f.message
    act = [t for t in report.tensors if t["kind"] == "activation"]
    assert [t["name"] for t in act] == ["1"] and act[0]["zero_fraction"] == 1.0


def test_where_blocks_gradient_to_unselected_elements() -> None:
    mod = example("where_blocks_gradient")
    report = mod.run(seed())
    assert causes(report) == {("0.weight", "mostly_zero")}
    (f,) = report.findings
    assert "same" in f.message and "torch.where" in f.message
    grad = next(t for t in report.tensors if t["name"] == "0.weight" and t["kind"] == "grad")
    # truth: the entries that the mask leaves out, a twentieth of 16 x 32 kept
    assert grad["zero_fraction"] == pytest.approx(1 - 26 / 512, abs=2 / 512)


def test_float16_gradients_underflow() -> None:
    report = example("fp16_underflow").run(seed())
    assert {f.cause for f in report.findings} == {"underflow"}
    assert ("2.weight", "underflow") in causes(report)
    tensors = {(t["name"], t["kind"]): t for t in report.tensors}
    assert tensors[("2.weight", "grad")]["subnormal_fraction"] > 0
    assert report.history["subnormal_fraction"][-1][report.history["names"].index("2.weight")] > 0


def test_gradient_norm_shrinking_under_clipping() -> None:
    report = example("clipping_norm_drift").run(seed())
    assert causes(report) == {(monitor_module.GLOBAL_NAME, "norm_drift")}
    norms = report.history["grad_norm"]
    totals = [math.sqrt(sum(v * v for v in row)) for row in norms]
    assert totals[-1] < totals[0] / 100


def test_healthy_mlp_has_no_warnings() -> None:
    report = example("healthy_mlp").run(seed(), steps=300)
    assert serious(report) == [], str(report)
    assert report.step == 299


def test_healthy_transformer_has_no_warnings() -> None:
    report = example("healthy_transformer").run(seed(), steps=250)
    assert serious(report) == [], str(report)
    names = [t["name"] for t in report.tensors if t["kind"] == "weight"]
    assert "head.weight" not in names and "embed.weight" in names  # tied: scanned once
    assert any(t["kind"] == "activation" for t in report.tensors)


# ---- more causes ------------------------------------------------------------


class TwoLayer(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 1)
        self.spare = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "no_grad":
            with torch.no_grad():
                h = self.fc1(x)
        elif self.mode == "numpy":
            h = torch.from_numpy(self.fc1(x).detach().numpy())
        elif self.mode == "item":
            h = x[:, :1].expand(-1, 8) * self.fc1(x).mean().item()
        elif self.mode == "discarded":
            self.fc1(x)
            h = x.new_ones(x.shape[0], 8)
        else:
            h = self.fc1(x)
        return self.fc2(torch.tanh(h))


def train(model: nn.Module, steps: int = 2, **kwargs: Any) -> Report:
    g = fresh_generator()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with Monitor(model, opt, **kwargs) as mon:
        for _ in range(steps):
            x = torch.randn(16, 6, generator=g)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    return mon.report()


@pytest.mark.parametrize(
    "mode, cause, words",
    [
        ("no_grad", "detached", "torch.no_grad()"),
        ("numpy", "detached", ".detach()"),
        ("item", "detached", ".item()"),
        ("discarded", "unused", "discarded"),
    ],
)
def test_graph_cuts_are_told_apart(mode: str, cause: str, words: str) -> None:
    report = train(TwoLayer(mode))
    found = by_name(report)
    for name in ("fc1.weight", "fc1.bias"):
        (f,) = found[name]
        assert f.cause == cause and words in f.message, f.message
    (spare,) = found["spare.weight"]
    assert spare.cause == "unused" and "never ran" in spare.message
    assert "fc2.weight" not in found and "fc2.bias" not in found


def test_unused_parameter_of_a_module_that_ran() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))
            self.offset = nn.Parameter(torch.zeros(4))  # never used

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.gain

    report = train(nn.Sequential(nn.Linear(6, 4), Scale()))
    assert causes(report) == {("1.offset", "unused")}
    assert "ran in forward but never used" in report.findings[0].message


def test_backward_not_run_and_zero_grad_too_early() -> None:
    model = nn.Linear(5, 2)
    with Monitor(model) as mon:
        model(torch.randn(3, 5)).sum()  # forward only
        mon.step()
    report = mon.report()
    assert causes(report) == {("weight", "no_backward"), ("bias", "no_backward")}

    with Monitor(model) as mon:
        loss = model(torch.randn(3, 5)).sum()
        loss.backward()
        model.zero_grad(set_to_none=True)  # misuse: scanned after zero_grad
        mon.step(loss)
    found = mon.report().findings
    assert {f.cause for f in found} == {"grad_cleared"}
    assert all("zero_grad() (or .grad = None) ran between backward() and step()" in f.message for f in found)


def test_output_left_out_of_the_loss() -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.main = nn.Linear(3, 2)
            self.aux = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"main": self.main(x), "aux": self.aux(x)}

    model = TwoHeads()
    g = fresh_generator()
    with Monitor(model) as mon:
        loss = model(torch.randn(4, 3, generator=g))["main"].square().sum()
        loss.backward()
        mon.step(loss)
    report = mon.report()
    assert causes(report) == {("aux.weight", "unused"), ("aux.bias", "unused")}
    assert "loss does not use" in report.findings[0].message


def test_forward_under_no_grad_everywhere() -> None:
    model = nn.Linear(5, 2)
    with Monitor(model) as mon:
        with torch.no_grad():
            model(torch.randn(3, 5))
        mon.step()
    found = mon.report().findings
    assert {f.cause for f in found} == {"detached"} and "no_grad" in found[0].message


def manual(model: nn.Module, grads: list[dict[str, torch.Tensor]], **kwargs: Any) -> Report:
    """Runs steps where the gradients are set by hand (no optimizer)."""
    with Monitor(model, **kwargs) as mon:
        for step_grads in grads:
            for name, p in model.named_parameters():
                p.grad = step_grads.get(name)
            mon.step()
    return mon.report()


def test_exact_zero_underflow_vanishing_exploding_nonfinite() -> None:
    g = fresh_generator()
    names = ["zero", "sub", "vanish", "explode", "nan", "fine"]
    model = nn.ParameterDict({n: nn.Parameter(torch.randn(64, generator=g)) for n in names})
    w = {n: p.detach() for n, p in model.items()}
    tiny = torch.finfo(torch.float32).tiny
    nan_grad = torch.randn(64, generator=g)
    nan_grad[int(torch.randint(0, 64, (), generator=g))] = float("nan")
    grads = {
        "zero": torch.zeros(64),
        "sub": tiny * torch.rand(64, generator=g) * 0.9 + tiny * 0.05,
        "vanish": w["vanish"] * 1e-9,
        "explode": w["explode"] * 1e5,
        "nan": nan_grad,
        "fine": w["fine"] * 1e-2,
    }
    expected = {
        ("zero", "exact_zero"), ("sub", "underflow"), ("vanish", "vanishing"),
        ("explode", "exploding"), ("nan", "nonfinite"),
    }
    report = manual(model, [grads])
    assert causes(report) == expected
    assert {f.name: f.severity for f in report.detailed}["zero"] == Severity.INFO  # one step: maybe by design
    report = manual(model, [grads, grads])  # zero twice, the weight unchanged: it does not train
    assert causes(report) == expected | {(monitor_module.GLOBAL_NAME, "nonfinite"), ("fine", "not_updated")}
    sev = {f.name: f.severity for f in report.detailed}
    assert sev["nan"] == Severity.ERROR and sev["explode"] == Severity.ERROR and sev["sub"] == Severity.ERROR
    assert sev["zero"] == Severity.WARNING and sev["vanish"] == Severity.WARNING
    (first,) = [f for f in report.findings if f.name == monitor_module.GLOBAL_NAME]
    assert "first appeared at step 0, in nan" in first.message
    assert [f.name for f in first.members] == [monitor_module.GLOBAL_NAME, "nan"]  # where the NaN is, as one finding
    assert [f.severity for f in report.findings] == sorted((f.severity for f in report.findings), reverse=True)


def test_not_updated_lr_zero_and_below_ulp() -> None:
    g = fresh_generator()
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD([{"params": [model.weight], "lr": 0.0}, {"params": [model.bias], "lr": 0.1}])
    report = train_monitored(model, opt, g, steps=3, batch=8)
    assert causes(report) == {("weight", "not_updated")}
    assert "lr=0" in report.findings[0].message

    half = nn.Linear(4, 4).half()
    with torch.no_grad():  # |w| = 1: an update of lr * |g| <= 1e-6 is below one ulp (a random bias may not be)
        half.weight.fill_(1.0)
        half.bias.fill_(1.0)
    opt = torch.optim.SGD(half.parameters(), lr=1e-6)
    report = train_monitored(half, opt, g, steps=4, batch=8, thresholds=Thresholds(frozen_window=3))
    assert ("weight", "frozen_in_time") in causes(report) and ("bias", "frozen_in_time") in causes(report)
    assert "resolution" in by_name(report)["weight"][0].message


def test_zero_fraction_rising() -> None:
    g = fresh_generator()
    model = nn.ParameterDict({"w": nn.Parameter(torch.randn(100, generator=g))})
    steps = []
    for k in range(20):
        grad = torch.randn(100, generator=g)
        grad[: 4 + 5 * k] = 0.0  # 4 % rising to 99 %: the last step is also mostly zero
        steps.append({"w": grad})
    report = manual(model, steps)
    assert {(f.name, f.cause) for f in serious(report)} == {("w", "zero_fraction_rising")}
    assert causes(report) == {("w", "zero_fraction_rising"), ("w", "mostly_zero")}  # the latter: INFO
    assert report.history["zero_fraction"][-1] == [pytest.approx(0.99)]


def test_saturated_softmax_and_healthy_softmax() -> None:
    g = fresh_generator()
    model = nn.Sequential(nn.Linear(8, 16), nn.Softmax(dim=-1))
    with Monitor(model, activations=True) as mon:
        model(torch.randn(32, 8, generator=g)).log().mean().backward()
        mon.step()
    assert [f for f in mon.report().findings if f.kind == "activation"] == []
    with torch.no_grad():
        model[0].weight.mul_(1e4)
    with Monitor(model, activations=True) as mon:
        model(torch.randn(32, 8, generator=g)).max(dim=-1).values.sum().backward()
        mon.step()
    assert ("1", "saturated_softmax") in causes(mon.report())


# ---- scanning, history and the report ---------------------------------------


def test_one_scan_per_step_and_no_readback(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = monitor_scans.native_many

    def counting(tensors: list[torch.Tensor]) -> torch.Tensor:
        calls.append(len(tensors))
        return real(tensors)

    def no_decode(*args: Any) -> Any:
        raise AssertionError("the Monitor read results back during training")

    monitor_py = sys.modules["zeroscan.monitor.step_reads"]  # where the Monitor reads records back
    real_decode = monitor_py.decode_records
    monkeypatch.setattr(monitor_scans, "native_many", counting)
    monkeypatch.setattr(monitor_py, "decode_records", no_decode)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    g = fresh_generator()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = Monitor(model, opt, history=5)
    for _ in range(12):
        opt.zero_grad()
        model(torch.randn(4, 6, generator=g)).sum().backward()
        opt.step()
    # Per step: 4 gradients + 4 weights at optimizer.step(). When backward ends, the
    # first step reads the 4 gradients (the Monitor has not yet seen the loop let
    # them go: a skipped step would keep those); later steps read a witness there
    # (monitor/deferred.py): the first 64 values of each gradient, here the whole of
    # these small ones, kept apart from the step's rows.
    assert calls == [4, 8] * 12
    records = list(mon._log.records)
    assert len(records) == 5 and [r.step for r in records] == [7, 8, 9, 10, 11]
    for r in records:
        assert [buffer.shape for _, buffer in r.groups] == [(8, 16)] and r.rows is None
        assert r.witness is not None and r.witness.rows.shape == (4, 16)
        assert all(buffer.dtype == torch.int64 for _, buffer in r.groups)
    monkeypatch.setattr(monitor_py, "decode_records", real_decode)
    report = mon.report()
    mon.close()
    assert report.history["steps"] == [7, 8, 9, 10, 11]


def test_every_n_steps() -> None:
    model = nn.Linear(3, 1)
    g = fresh_generator()
    with Monitor(model, every=3) as mon:
        for _ in range(10):
            model.zero_grad()
            model(torch.randn(2, 3, generator=g)).sum().backward()
            mon.step()
    report = mon.report()
    assert report.history["steps"] == [0, 3, 6, 9] and report.step == 9
    assert mon.steps_seen == 10


def test_report_forms_match_the_truth(monkeypatch: pytest.MonkeyPatch) -> None:
    g = fresh_generator()
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    with Monitor(model, activations=True) as mon:
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(9, 5, generator=g)).square().sum().backward()
            mon.step()
    report = mon.report()
    d = report.to_dict()
    assert set(d) == {"step", "findings", "tensors", "history"} and d["step"] == 2
    assert [(t["name"], t["kind"]) for t in d["tensors"]] == [
        ("0.weight", "grad"), ("0.weight", "weight"), ("0.bias", "grad"), ("0.bias", "weight"),
        ("2.weight", "grad"), ("2.weight", "weight"), ("2.bias", "grad"), ("2.bias", "weight"),
        ("1", "activation"),
    ]
    params = dict(model.named_parameters())
    for t in d["tensors"]:
        assert set(t) == TENSOR_KEYS
        for key in TENSOR_KEYS - {"name", "kind"}:
            assert type(t[key]) in (int, float), key
        if t["kind"] == "activation":
            continue
        x = params[t["name"]].grad if t["kind"] == "grad" else params[t["name"]].detach()
        ref = zeroscan.reference_stats(x)
        assert t["numel"] == ref["numel"] and t["zero_fraction"] == ref["zeros"] / ref["numel"]
        assert t["norm"] == pytest.approx(ref["norm"], rel=1e-6)
        assert t["max_abs"] == ref["max_abs"]
    h = d["history"]
    assert h["steps"] == [0, 1, 2] and h["names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for key in ("grad_norm", "zero_fraction", "subnormal_fraction"):
        assert len(h[key]) == 3 and all(len(row) == 4 for row in h[key])
    assert h["grad_norm"][-1][0] == pytest.approx(float(params["0.weight"].grad.norm()), rel=1e-6)
    json.dumps(d)

    lines = report.to_json_lines().splitlines()
    assert len(lines) == len(report.findings) + len(report.tensors)
    parsed = [json.loads(line) for line in lines]
    assert all(p["step"] == 2 for p in parsed)
    assert [p["name"] for p in parsed if p["type"] == "tensor"] == [t["name"] for t in d["tensors"]]

    seen: dict[str, Any] = {}
    fake = types.ModuleType("zeroscan.plot")
    fake.plot_report = lambda report_dict, path: seen.update(report=report_dict, path=path)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "zeroscan.plot", fake)
    report.plot("out.png")
    assert seen["path"] == "out.png" and seen["report"] == d


def test_report_text_and_json_with_findings() -> None:
    report = example("dead_relu").run(seed())
    text = str(report)
    # The dead layer, and one grouped finding for the three zero gradients behind it.
    assert "1 error, 1 warning" in text and "dead_units" in text and "0.weight" in text
    assert len(report.detailed) == 4 and len(report.findings[1].members) == 3
    d = report.to_dict()
    assert d["findings"][0] == {
        "name": "1", "kind": "activation", "severity": "error", "cause": "dead_units",
        "message": report.findings[0].message,
    }
    nan_model = nn.Linear(2, 2)
    report = manual(nan_model, [{"weight": torch.full((2, 2), float("nan")), "bias": torch.ones(2)}])
    for line in report.to_json_lines().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))  # NaN became null
    assert report.to_dict()["tensors"][0]["mean"] != report.to_dict()["tensors"][0]["mean"]  # nan kept


def test_report_before_any_step() -> None:
    mon = Monitor(nn.Linear(2, 2))
    report = mon.report()
    mon.close()
    assert report.step == -1 and [t["kind"] for t in report.tensors] == ["weight", "weight"]
    (no_step,) = [f for f in report.findings if f.cause == "no_step"]
    assert no_step.severity == Severity.WARNING and "no training step was seen" in no_step.message


# ---- robustness ----------------------------------------------------------------


def test_model_without_parameters() -> None:
    model = nn.Sequential(nn.ReLU(), nn.Softmax(dim=-1))
    with Monitor(model, activations=True) as mon:
        for _ in range(3):
            model(torch.randn(4, 5))
            mon.step()
    report = mon.report()
    assert serious(report) == [] and [t["kind"] for t in report.tensors] == ["activation", "activation"]


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_devices_and_sparse_grads(device: str) -> None:
    g = fresh_generator()
    model = nn.ModuleDict({
        "emb": nn.Embedding(50, 8, sparse=True),
        "low": nn.Linear(8, 8).bfloat16(),  # float16 gradients here are subnormal now and then: a true finding
        "far": nn.Linear(8, 1).to(device),
    })
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, opt) as mon:
        for _ in range(2):
            opt.zero_grad()
            tokens = torch.randint(0, 50, (6,), generator=g)
            h = model["emb"](tokens)
            h = model["low"](h.bfloat16()).float()
            model["far"](h.to(device)).sum().backward()
            opt.step()
    report = mon.report()
    grads = {t["name"] for t in report.tensors if t["kind"] == "grad"}
    assert grads == {"emb.weight", "low.weight", "low.bias", "far.weight", "far.bias"}
    assert serious(report) == [], str(report)


# "cuda" in the name: the GPU job (benchmarks/gpu_check.sh) selects -k cuda.
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_one_scan_per_device_cpu_and_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    devices: list[str] = []
    real = monitor_scans.native_many
    monkeypatch.setattr(monitor_scans, "native_many", lambda ts: devices.append(str(ts[0].device)) or real(ts))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1).cuda())
    with Monitor(model) as mon:
        model[1](model[0](torch.randn(2, 4)).cuda()).sum().backward()
        mon.step()
    assert sorted(devices[-2:]) == ["cpu", "cuda:0"]
    assert serious(mon.report()) == []


def test_tied_parameters_scanned_once() -> None:
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    with Monitor(model) as mon:
        model(torch.randint(0, 10, (5,))).sum().backward()
        mon.step()
    report = mon.report()
    assert [(t["name"], t["kind"]) for t in report.tensors] == [("0.weight", "grad"), ("0.weight", "weight")]
    assert serious(report) == []


def test_monitor_never_changes_what_it_scans() -> None:
    g = fresh_generator()
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6), nn.Softmax(dim=-1))
    with Monitor(model, activations=True) as mon:
        x = torch.randn(4, 6, generator=g)
        out = model(x)
        before_out = out.detach().clone()
        out.log().sum().backward()
        model[0].weight.grad[0, 0] = float("nan")  # data that looks bad must not make step() raise
        before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
        mon.step()
    for n, p in model.named_parameters():
        w, gr = before[n]
        assert torch.equal(p.detach().view(torch.int32), w.view(torch.int32))
        assert torch.equal(p.grad.view(torch.int32), gr.view(torch.int32))
    assert torch.equal(out.detach(), before_out)
    assert ("0.weight", "nonfinite") in causes(mon.report())


def test_two_monitors_and_closing_twice() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks_before = (len(model._forward_hooks), len(model._forward_pre_hooks), len(opt._optimizer_step_pre_hooks))
    a = Monitor(model, opt, activations=True)
    b = Monitor(model, opt, activations=True)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
    assert a.report().history["steps"] == [0, 1] == b.report().history["steps"]
    a.close()
    a.close()
    opt.zero_grad()
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    assert b.report().history["steps"] == [0, 1, 2] and a.report().history["steps"] == [0, 1]
    with b:
        pass
    b.close()
    hooks_after = (len(model._forward_hooks), len(model._forward_pre_hooks), len(opt._optimizer_step_pre_hooks))
    assert hooks_after == hooks_before
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with pytest.raises(RuntimeError, match="closed"):
        a.step()
    with pytest.raises(RuntimeError, match="closed"):
        with a:
            pass


def test_exception_in_forward_leaves_no_mode_behind() -> None:
    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom")

    model = Boom()
    with Monitor(model) as mon:
        with pytest.raises(ValueError, match="boom"):
            model(torch.randn(1, 2))
        assert torch._C._len_torch_function_stack() == 0
        mon.step()
    assert torch._C._len_torch_function_stack() == 0


def test_misuse_raises_clear_errors() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="model"):
        Monitor("not a model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer"):
        Monitor(model, optimizer=model)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="every"):
        Monitor(model, every=0)
    with pytest.raises(ValueError, match="history"):
        Monitor(model, history=1)
    with pytest.raises(ValueError, match="mostly_zero"):
        Thresholds(mostly_zero=2.0)
    with pytest.raises(ValueError, match="drift_window"):
        Thresholds(drift_window=1)
    with Monitor(model, opt) as mon:
        with pytest.raises(RuntimeError, match="auto=False"):
            mon.step()
    with Monitor(model, opt, auto=False) as mon:
        with pytest.raises(TypeError, match="loss"):
            mon.step(loss=1.0)  # type: ignore[arg-type]
        mon.step()
