"""zeroscan.guard: a step whose gradients hold NaN/Inf changes nothing.

Every optimizer variant (for-loop, foreach, fused) of SGD, Adam and AdamW is
run guarded beside an unguarded twin on the same batches: a good step equals
the twin's bit for bit; a bad step leaves every weight and every state tensor
bit-identical, and the step after it equals a twin that never saw the bad
batch. The step path is run with the host reads (item, tolist, bool, ...)
made to fail, and the flag computation is traced with fullgraph=True.
"""

from __future__ import annotations

import copy
import gc
import inspect
import math
import weakref

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from helpers import fresh_seed
from steps import (
    Batch, assert_moved, assert_same, backward, batches, bits, everything, host_reads_refused, make_model,
    step_past_freed_memory,
)
from zeroscan.guard import GuardReport, SkippedStep, StepGuard, guard, nonfinite_flags

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

CONFIGS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05}),
    "sgd_momentum_wd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    "sgd_nesterov": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adam_amsgrad": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "adamw_amsgrad": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}),
}
VARIANTS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
BAD_VALUES = [math.nan, math.inf, -math.inf]
GUARD_FILE = inspect.getsourcefile(StepGuard)

def make_optimizer(model: nn.Module, config: str, variant: str) -> torch.optim.Optimizer:
    cls, kwargs = CONFIGS[config]
    return cls(model.parameters(), **kwargs, **VARIANTS[variant])


def train(model: nn.Module, opt: torch.optim.Optimizer, data: list[Batch]) -> None:
    for batch in data:
        backward(model, opt, batch)
        opt.step()


def plant(model: nn.Sequential, g: torch.Generator, value: float) -> str:
    """Puts `value` at a random entry of one gradient; returns the parameter's name."""
    grad = model[2].weight.grad
    assert grad is not None
    i, j = (int(torch.randint(0, n, (), generator=g)) for n in grad.shape)
    grad[i, j] = value
    return "2.weight"


# ---- the step is a no-op exactly when it should be -------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("config", CONFIGS)
def test_good_steps_match_an_unguarded_twin(config: str, variant: str) -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    model = make_model(g)
    twin = copy.deepcopy(model)
    opt, twin_opt = make_optimizer(model, config, variant), make_optimizer(twin, config, variant)
    guarded = guard(opt, names=model)
    assert guarded.fused == (variant == "fused")
    for batch in batches(g, 3):
        before = everything(model, opt)
        train(model, opt, [batch])
        train(twin, twin_opt, [batch])
        assert_moved(before, everything(model, opt))
        assert_same(everything(model, opt), everything(twin, twin_opt))
    report = guarded.report()
    assert (report.steps, report.skipped, report.skipped_steps) == (3, 0, [])


@pytest.mark.parametrize("value", BAD_VALUES, ids=["nan", "posinf", "neginf"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("config", CONFIGS)
def test_a_bad_step_changes_nothing_and_the_next_matches_a_twin_that_skipped_it(
    config: str, variant: str, value: float
) -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    model = make_model(g)
    twin = copy.deepcopy(model)
    opt, twin_opt = make_optimizer(model, config, variant), make_optimizer(twin, config, variant)
    guarded = guard(opt, names=model)
    data = batches(g, 4)
    train(model, opt, data[:2])
    backward(model, opt, data[2])
    name = plant(model, g, value)
    before = everything(model, opt)
    opt.step()
    assert_same(everything(model, opt), before)
    assert not hasattr(opt, "found_inf")
    train(model, opt, data[3:])
    train(twin, twin_opt, data[:2] + data[3:])  # the twin never saw batch 2
    assert_moved(before, everything(model, opt))
    assert_same(everything(model, opt), everything(twin, twin_opt))
    report = guarded.report()
    assert (report.steps, report.skipped) == (4, 1)
    assert report.skipped_steps == [SkippedStep(2, [name])]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("config", CONFIGS)
def test_a_bad_first_step_leaves_the_new_state_at_zero(config: str, variant: str) -> None:
    """State created by a skipped first step is zero-filled: Adam's initial
    state exactly; for SGD's momentum buffer the next step then equals a first
    step in value (dampening 0)."""
    g = torch.Generator().manual_seed(fresh_seed())
    model = make_model(g)
    twin = copy.deepcopy(model)
    opt, twin_opt = make_optimizer(model, config, variant), make_optimizer(twin, config, variant)
    guard(opt)
    data = batches(g, 2)
    backward(model, opt, data[0])
    plant(model, g, math.nan)
    before = everything(model, opt)
    assert not any(name.startswith("state") for name in before)
    opt.step()
    after = everything(model, opt)
    assert_same({n: t for n, t in after.items() if n.startswith("param")}, before)
    created = {n: t for n, t in after.items() if n.startswith("state")}
    assert bool(created) == (config != "sgd")  # plain SGD keeps no state
    assert all(torch.equal(bits(t), bits(torch.zeros_like(t))) for t in created.values()), created
    train(model, opt, data[1:])
    train(twin, twin_opt, data[1:])
    assert_same(everything(model, opt), everything(twin, twin_opt), exact=not config.startswith("sgd"))


def test_none_gradients_are_not_scanned_and_the_report_names_the_right_parameter() -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    model = make_model(g)
    model[0].requires_grad_(False)  # its gradients stay None
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    guarded = guard(opt, names=model)
    data = batches(g, 2)
    train(model, opt, data[:1])
    backward(model, opt, data[1])
    assert model[0].weight.grad is None
    model[4].bias.grad[1] = math.inf
    before = everything(model, opt)
    opt.step()
    assert_same(everything(model, opt), before)
    assert guarded.report().skipped_steps == [SkippedStep(1, ["4.bias"])]


def test_only_the_given_params_are_scanned() -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    model = make_model(g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guarded = guard(opt, params=[model[0].weight, model[0].weight], names={model[0].weight: "first"})
    assert guarded.names == ["first"]
    backward(model, opt, batches(g, 1)[0])
    plant(model, g, math.nan)  # in 2.weight, which is not scanned: the step goes ahead
    opt.step()
    assert model[2].weight.isnan().any()
    backward(model, opt, batches(g, 1)[0])
    model[0].weight.grad[0, 0] = math.nan
    before = everything(model, opt)
    opt.step()
    assert_same(everything(model, opt), before)
    assert guarded.report().skipped_steps == [SkippedStep(1, ["first"])]


# ---- the fused path: found_inf --------------------------------------------


@pytest.mark.parametrize("config", ["sgd_momentum_wd", "adam"])
def test_the_fused_path_sets_found_inf_for_the_step_alone(config: str) -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    model = make_model(g)
    opt = make_optimizer(model, config, "fused")
    guard(opt)
    seen: list[torch.Tensor | None] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(getattr(o, "found_inf", None)))
    data = batches(g, 2)
    train(model, opt, data[:1])
    backward(model, opt, data[1])
    plant(model, g, math.nan)
    opt.step()
    assert [(t.dtype, t.shape, t.tolist()) for t in seen if t is not None] == [
        (torch.float32, torch.Size([]), 0.0),
        (torch.float32, torch.Size([]), 1.0),
    ]
    assert len(seen) == 2 and not hasattr(opt, "found_inf")
    # A found_inf already set (as GradScaler sets it) still skips a clean step, and is put back.
    theirs = torch.tensor(1.0)
    opt.found_inf = theirs
    backward(model, opt, data[0])
    before = everything(model, opt)
    opt.step()
    assert_same(everything(model, opt), before)
    assert opt.found_inf is theirs


def test_grad_scaler_with_a_fused_optimizer_matches_an_unguarded_twin() -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    model = make_model(g)
    twin = copy.deepcopy(model)
    opt, twin_opt = make_optimizer(model, "adam", "fused"), make_optimizer(twin, "adam", "fused")
    guarded = guard(opt)
    data = batches(g, 3)
    for m, o in ((model, opt), (twin, twin_opt)):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for step, batch in enumerate(data):
            o.zero_grad()
            scaler.scale((m(batch[0]) - batch[1]).square().mean()).backward()
            if step == 1:
                m[2].weight.grad[0, 0] = math.inf
            scaler.step(o)
            scaler.update()
    assert_same(everything(model, opt), everything(twin, twin_opt))
    assert (guarded.report().steps, guarded.report().skipped) == (3, 1)


# ---- report ---------------------------------------------------------------


def test_report_keeps_the_last_skipped_steps_in_a_ring() -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    model = make_model(g)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guarded = guard(opt, names=model, keep=3)
    bad_steps = {1: ["0.bias"], 2: ["2.weight", "4.bias"], 4: ["4.weight"], 5: ["0.bias"], 7: ["2.bias"]}
    params = dict(model.named_parameters())
    for step, batch in enumerate(batches(g, 9)):
        backward(model, opt, batch)
        for name in bad_steps.get(step, []):
            params[name].grad.view(-1)[0] = math.nan
        opt.step()
    report = guarded.report()
    assert isinstance(report, GuardReport)
    assert (report.steps, report.skipped) == (9, 5)
    assert report.skipped_steps == [SkippedStep(s, bad_steps[s]) for s in (4, 5, 7)]
    assert str(report) == (
        "skipped 5 of 9 steps (the last 3 listed); step 4: 4.weight; step 5: 0.bias; step 7: 2.bias (NaN/Inf in gradients)"
    )
    assert report.to_dict() == {
        "steps": 9,
        "skipped": 5,
        "skipped_steps": [{"step": s, "params": bad_steps[s]} for s in (4, 5, 7)],
        "not_scanned": {},
    }


def test_report_names_default_to_group_and_index() -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    model = make_model(g)
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[4].parameters(), "lr": 0.1}], lr=0.01)
    guarded = guard(opt)
    assert guarded.names == ["group0.param0", "group0.param1", "group1.param0", "group1.param1"]
    backward(model, opt, batches(g, 1)[0])
    model[4].weight.grad[0, 0] = math.nan
    model[0].bias.grad[0] = math.inf
    opt.step()
    report = guarded.report()
    assert str(report) == "skipped 1 of 1 steps; step 0: group0.param1, group1.param0 (NaN/Inf in gradients)"
    assert str(GuardReport(4, 0, [])) == "skipped 0 of 4 steps"


# ---- lifecycle -------------------------------------------------------------


def test_remove_and_with_uninstall_the_guard() -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    model = make_model(g)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with guard(opt) as guarded:
        with pytest.raises(RuntimeError, match=r"^zeroscan.guard: this optimizer is already guarded; call remove\(\)"):
            guard(opt)
    assert "removed" in repr(guarded)
    backward(model, opt, batches(g, 1)[0])
    plant(model, g, math.nan)
    opt.step()  # unguarded now: the NaN reaches the weights
    assert model[2].weight.isnan().any()
    guarded.remove()  # twice is fine
    guard(opt).remove()  # and it can be guarded again


def test_a_step_that_raises_leaves_no_found_inf_behind() -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    model = make_model(g)
    opt = make_optimizer(model, "adam", "fused")
    guarded = guard(opt)

    def fail(o: object, args: object, kwargs: object) -> None:
        raise ValueError("boom")

    handle = opt.register_step_pre_hook(fail)
    backward(model, opt, batches(g, 1)[0])
    with pytest.raises(ValueError, match="boom"):
        opt.step()
    assert hasattr(opt, "found_inf")  # the post hooks did not run
    handle.remove()
    opt.step()
    assert not hasattr(opt, "found_inf")
    assert guarded.report().steps == 1  # the step that raised is not counted


# ---- no host sync on the step path ----------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("config", ["sgd_momentum_wd", "adam_amsgrad"])
def test_the_step_path_reads_nothing_on_the_host(config: str, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    model = make_model(g)
    model[0].requires_grad_(False)  # some gradients None: the index path too
    opt = make_optimizer(model, config, variant)
    guarded = guard(opt, names=model)
    anywhere = config.startswith("sgd") or variant == "fused"  # torch's own step reads nothing there
    for step, batch in enumerate(batches(g, 3)):
        backward(model, opt, batch)
        if step == 1:
            plant(model, g, math.nan)
        with host_reads_refused(monkeypatch, only_from=None if anywhere else GUARD_FILE) as calls:
            opt.step()
        assert calls == []
    assert guarded.report().skipped_steps == [SkippedStep(1, ["2.weight"])]


def test_the_refusal_itself_works(monkeypatch: pytest.MonkeyPatch) -> None:
    with host_reads_refused(monkeypatch), pytest.raises(AssertionError, match="Tensor.item"):
        torch.ones(()).item()
    with host_reads_refused(monkeypatch), pytest.raises(AssertionError, match="Tensor.__bool__"):
        bool(torch.ones(()))


# ---- torch.compile ---------------------------------------------------------


def test_the_flags_trace_into_one_graph() -> None:
    counter = CompileCounterWithBackend("aot_eager")
    flags = torch.compile(nonfinite_flags, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(fresh_seed())
    grads = [torch.randn(5, 4, generator=g), torch.randn(7, generator=g).to(torch.bfloat16), torch.randn(3, 3, generator=g).t()]
    for value in (math.nan, math.inf, -math.inf):
        grads[1][3] = value
        grads[2][0, 1] = value
        want = [False, True, True]
        assert flags(grads).tolist() == nonfinite_flags(grads).tolist() == want
        grads[1][3] = grads[2][0, 1] = 0.0
        assert flags(grads).tolist() == [False, False, False]
    assert counter.frame_count == 1


@pytest.mark.parametrize("variant", ["loop", "fused"])
def test_a_compiled_optimizer_step_is_guarded(variant: str) -> None:
    """torch.compile(opt.step): the guard's hooks run eagerly inside it."""
    g = torch.Generator().manual_seed(fresh_seed())
    model = make_model(g)
    opt = make_optimizer(model, "adam", variant)
    guarded = guard(opt, names=model)
    step = torch.compile(opt.step, backend="eager")
    data = batches(g, 3)
    for i, batch in enumerate(data):
        backward(model, opt, batch)
        if i == 1:
            plant(model, g, math.nan)
        before = everything(model, opt)
        step()
        if i == 1:
            assert_same(everything(model, opt), before)
        else:
            assert_moved(before, everything(model, opt))
    assert guarded.report().skipped_steps == [SkippedStep(1, ["2.weight"])]
    assert all(p.isfinite().all() for p in model.parameters())


def test_a_compiled_model_with_a_nan_batch() -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    model = make_model(g)
    opt = make_optimizer(model, "adamw", "foreach")
    guarded = guard(opt, names=model)
    compiled = torch.compile(model, backend="eager")
    for i, (x, y) in enumerate(batches(g, 3)):
        if i == 2:
            x[0, 0] = math.nan  # every gradient turns NaN
        opt.zero_grad()
        (compiled(x) - y).square().mean().backward()
        before = everything(model, opt)
        opt.step()
        assert (i == 2) == all(torch.equal(bits(before[n]), bits(t)) for n, t in everything(model, opt).items())
    assert guarded.report().skipped_steps == [SkippedStep(2, [n for n, _ in model.named_parameters()])]


# ---- errors ----------------------------------------------------------------


def test_errors_name_the_argument_and_what_was_received() -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    model = make_model(g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [
        (lambda: guard([model.parameters()]), TypeError, "optimizer must be a torch.optim.Optimizer, got list"),
        (lambda: guard(opt, keep=0), ValueError, "keep must be a positive int, got 0"),
        (lambda: guard(opt, keep=True), ValueError, "keep must be a positive int, got True"),
        (lambda: guard(opt, keep="3"), ValueError, "keep must be a positive int, got '3'"),
        (lambda: guard(opt, params=model[0].weight), TypeError, "params must be an iterable of the optimizer's parameters, got Parameter"),
        (lambda: guard(opt, params=[model[0].weight, "x"]), TypeError, "params[1] must be a torch.Tensor, got str"),
        (lambda: guard(opt, params=[torch.zeros(2)]), ValueError, "params[0] is not a parameter of the optimizer"),
        (lambda: guard(opt, params=[]), ValueError, "params must hold at least one of the optimizer's parameters, got none"),
        (lambda: guard(opt, names=["a"]), TypeError, "names must be a dict of tensor -> str, an nn.Module or None, got list"),
        (lambda: guard(opt, names={model[0].weight: 3}), TypeError, "names must map tensors to str, got a Parameter -> int entry"),
    ]
    for make, error, message in cases:
        with pytest.raises(error) as info:
            make()
        assert str(info.value) == f"zeroscan.guard: {message}"
        assert "\n" not in str(info.value)
    guard(opt).remove()  # none of the failures left a guard behind


def test_step_time_errors() -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    model = make_model(g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(opt, names=model):
        backward(model, opt, batches(g, 1)[0])
        with pytest.raises(RuntimeError, match=r"^zeroscan.guard: optimizer.step\(closure\) is not supported"):
            opt.step(lambda: None)
        model[0].bias.grad = model[0].bias.grad.to_sparse()
        with pytest.raises(RuntimeError, match=r"^zeroscan.guard: the gradient of 0.bias is a torch.sparse_coo tensor; only dense local"):
            opt.step()
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
        with pytest.raises(RuntimeError, match=r"^zeroscan.guard: the optimizer's parameters changed since guard\(\)"):
            opt.step()


def test_a_cpu_step_count_for_accelerator_parameters_is_refused() -> None:
    """Non-capturable Adam keeps `step` on the CPU; meta parameters stand in
    for CUDA ones here (the check looks at the device type only)."""
    meta = nn.Linear(3, 2, device="meta")
    with pytest.raises(ValueError) as info:
        guard(torch.optim.Adam(meta.parameters()))
    assert str(info.value) == (
        "zeroscan.guard: param group 0 keeps its step count on the CPU (capturable=False, fused off) while its "
        "parameters are on meta; selecting it needs a host sync: create the optimizer with capturable=True or fused=True"
    )
    guard(torch.optim.Adam(meta.parameters(), capturable=True)).remove()
    guard(torch.optim.Adam(meta.parameters(), fused=True)).remove()
    guard(torch.optim.SGD(meta.parameters(), momentum=0.9)).remove()  # SGD keeps its state on the parameter's device
    mixed = torch.optim.SGD([*meta.parameters(), nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match=r"^zeroscan.guard: the optimizer's parameters are on cpu, meta; "):
        guard(mixed)


OTHER_OPTIMIZERS = {
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=0.01, momentum=0.5, centered=True),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.05),
    "adamax": lambda params: torch.optim.Adamax(params, lr=0.01),
    "radam": lambda params: torch.optim.RAdam(params, lr=0.01, foreach=True),
}


@pytest.mark.parametrize("name", OTHER_OPTIMIZERS)
def test_other_optimizers_take_the_snapshot_path(name: str) -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    model = make_model(g)
    twin = copy.deepcopy(model)
    opt, twin_opt = OTHER_OPTIMIZERS[name](model.parameters()), OTHER_OPTIMIZERS[name](twin.parameters())
    guarded = guard(opt, names=model)
    assert not guarded.fused
    data = batches(g, 3)
    train(model, opt, data[:1])
    backward(model, opt, data[1])
    plant(model, g, math.inf)
    before = everything(model, opt)
    opt.step()
    assert_same(everything(model, opt), before)
    train(model, opt, data[2:])
    train(twin, twin_opt, data[:1] + data[2:])
    assert_same(everything(model, opt), everything(twin, twin_opt))


@pytest.mark.parametrize("variant", ["loop", "fused"])
def test_state_on_another_device_than_its_parameter_is_refused(variant: str) -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    model = make_model(g)
    opt = make_optimizer(model, "adam", variant)
    train(model, opt, batches(g, 1))
    guard(opt, names=model)
    opt.state[model[0].weight]["step"] = torch.zeros((), device="meta")  # stands in for a CPU step of a CUDA parameter
    with pytest.raises(RuntimeError) as info:
        opt.step()
    assert str(info.value) == (
        "zeroscan.guard: optimizer.state[0.weight]['step'] is on meta but its parameter is on cpu; selecting it "
        "needs a host sync: create the optimizer with capturable=True or fused=True"
    )
    assert not hasattr(opt, "found_inf")


def test_a_guarded_optimizer_can_be_garbage_collected() -> None:
    model = make_model(torch.Generator().manual_seed(fresh_seed()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard(opt)
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None


# ---- a gradient whose memory was freed -------------------------------------------------


@pytest.mark.parametrize("bad", [None, *BAD_VALUES], ids=str)
@pytest.mark.parametrize("variant", ["loop", "foreach"])
def test_a_freed_gradient_is_left_out_and_named(variant: str, bad: float | None) -> None:
    g = torch.Generator().manual_seed(fresh_seed())
    model = make_model(g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, **VARIANTS[variant])
    guarded = guard(opt, names=model)
    step_past_freed_memory(opt)
    for batch in batches(g, 2):
        backward(model, opt, batch)
        model[0].weight.grad.untyped_storage().resize_(0)  # freed, shape kept
        if bad is not None:
            plant(model, g, bad)
        before = everything(model, opt)
        opt.step()
        if bad is None:
            assert_moved(before, everything(model, opt))
        else:
            assert_same(everything(model, opt), before)
    report = guarded.report()
    assert (report.steps, report.skipped) == (2, 0 if bad is None else 2)
    assert list(report.not_scanned) == ["0.weight"]
    assert report.not_scanned["0.weight"].startswith("the gradient has no data to scan: its storage holds 0 bytes")
    assert "not scanned at some steps: 0.weight" in str(report)
    assert report.to_dict()["not_scanned"] == report.not_scanned
