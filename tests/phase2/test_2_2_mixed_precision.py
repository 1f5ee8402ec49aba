"""Graded tests of exercise 2.2, mixed precision and loss scaling (phase2_advanced/guidelines.md, section 2.2).

Run them with `python tests/test_phase2.py -k 2_2` (your code) or
`pytest tests/test_phase2.py -k 2_2` (the reference); tests/test_phase2.py collects them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import grading
from compare import assert_no_problems, diff_report, state_dict_problems
from common.launch import run_world
from common.models import build_model
from phase2.test_2_1_accumulation import _accum_batch


def test_2_2_autocast_dtype_per_device(grade, monkeypatch):
    mod = grade("2.2").load()
    assert mod.autocast_dtype("cpu") == torch.bfloat16, "CPU autocast: bfloat16"
    assert mod.autocast_dtype(torch.device("cpu")) == torch.bfloat16, "CPU autocast (torch.device): bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert mod.autocast_dtype("cuda") == torch.bfloat16, "a GPU that supports bf16 (Ampere+): bfloat16"
    assert mod.autocast_dtype(torch.device("cuda", 0)) == torch.bfloat16, "cuda:0 with bf16 support: bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert mod.autocast_dtype("cuda") == torch.float16, "a GPU without bf16 (e.g. V100, T4): float16"


_MP_INF, _MP_NAN = float("inf"), float("nan")
# (what happens at this step, call unscale_ + clip_grad_norm_ before step). growth_interval = 3.
MP_SCALER_EVENTS = [
    ("ok", False), ("ok", False), ("inf", False),   # overflow after 2 good steps: the tracker must restart at 0
    ("ok", False), ("ok", True), ("ok", False),     # 3 good steps: the scale grows at step 5, not at step 3
    ("huge", False),                                # finite gradients that overflow only once scaled
    ("nan", False), ("ok", False), ("ok", True),
    ("ok", False), ("inf", True), ("ok", False), ("ok", False), ("ok", False), ("ok", True),
]
MP_SCALER_ARGS = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)


def _mp_scaler_trace(scaler):
    """Train a Linear(4, 3) through `scaler` over MP_SCALER_EVENTS; per step: (scale after update, skipped, params)."""
    gen = torch.Generator().manual_seed(0)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.copy_(torch.randn(3, 4, generator=gen))
        model.bias.copy_(torch.randn(3, generator=gen))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trace = []
    for event, explicit_unscale in MP_SCALER_EVENTS:
        x, c = torch.randn(5, 4, generator=gen), torch.randn(5, 3, generator=gen)
        if event == "inf":
            c[1, 2] = _MP_INF
        elif event == "nan":
            c[0, 0] = _MP_NAN
        elif event == "huge":
            c = c.sign() * 1e36  # x 2^10 > 3.4e38: inf in float32
        optimizer.zero_grad()
        loss = (model(x) * c).sum()
        scaled = scaler.scale(loss)
        scaled.backward()
        if explicit_unscale:  # the gradient-clipping pattern: clip the TRUE gradients
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        skipped = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        trace.append((float(scaler.get_scale()), skipped, scaled.detach().clone(),
                      {k: v.detach().clone() for k, v in model.state_dict().items()}))
    return trace


def test_2_2_loss_scaler_matches_torch_grad_scaler(grade):
    mod = grade("2.2").load()
    expected = _mp_scaler_trace(torch.amp.GradScaler("cpu", **MP_SCALER_ARGS))
    actual = _mp_scaler_trace(mod.LossScaler(**MP_SCALER_ARGS))
    for step, ((scale, skipped, scaled, state), (e_scale, e_skipped, e_scaled, e_state)) in enumerate(zip(actual, expected)):
        event, explicit = MP_SCALER_EVENTS[step]
        what = f"step {step} ({event} gradients{', unscale_ + clip before step' if explicit else ''}):"
        problem = diff_report(scaled.float(), e_scaled, f"{what} scaler.scale(loss)", rtol=1e-6, atol=0)
        assert problem is None, problem
        assert skipped == e_skipped, (f"{what} the optimizer step was {'skipped' if skipped else 'taken'}; "
                                      f"GradScaler {'skips' if e_skipped else 'takes'} it "
                                      "(skip exactly when some gradient is inf/nan)")
        assert scale == e_scale, (f"{what} scale {scale:g} after update(), GradScaler has {e_scale:g} "
                                  f"(scales so far: {[t[0] for t in expected[:step + 1]]}; growth_interval=3, "
                                  "backoff resets the growth counter)")
        assert_no_problems(state_dict_problems(state, e_state, f"{what} parameter", rtol=1e-6, atol=1e-7),
                           "parameters differ from a run with torch.amp.GradScaler (step on UNSCALED gradients, "
                           "unscale once per step)")


def test_2_2_bf16_step_keeps_fp32_master_weights(grade):
    mod = grade("2.2").load()
    gen = torch.Generator().manual_seed(7)
    inputs, targets = torch.randn(32, 1, 8, 8, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    fp32 = build_model("mlp", (1, 8, 8), 10, seed=0)
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append(o.dtype)) for m in model.modules()
             if isinstance(m, nn.Linear)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mod.LossScaler(init_scale=2.0**8, growth_interval=2)
    loss = mod.mixed_precision_step(model, optimizer, scaler, inputs, targets, "cpu")
    for h in hooks:
        h.remove()
    assert seen and all(d == torch.bfloat16 for d in seen), \
        f"Linear outputs inside the step had dtypes {seen}: run the forward under torch.autocast('cpu', torch.bfloat16)"
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, f"parameter {name} is {p.dtype}: master weights must stay float32 (autocast " \
                                         "casts copies per op; never model.to(bfloat16))"
        assert p.grad is not None and p.grad.dtype == torch.float32, f"{name}.grad must be a float32 gradient"

    reference_optimizer = torch.optim.SGD(fp32.parameters(), lr=0.1)
    fp32_loss = F.cross_entropy(fp32(inputs), targets)
    fp32_loss.backward()
    reference_optimizer.step()
    assert isinstance(loss, float) and loss == pytest.approx(fp32_loss.item(), rel=2e-2), \
        f"bf16 step returned loss {loss!r}, the fp32 loss is {fp32_loss.item():.5f} (expected within bf16 precision)"
    assert_no_problems(state_dict_problems(model.state_dict(), fp32.state_dict(), "after one step, parameter",
                                           rtol=0, atol=2e-3),
                       "a bf16-autocast step must move the fp32 weights like an fp32 step, within bf16 precision "
                       "(unscale the gradients before the step)")
    losses = [loss] + [mod.mixed_precision_step(model, optimizer, scaler, inputs, targets, "cpu") for _ in range(5)]
    assert losses[-1] < losses[0] - 0.05, f"6 bf16 steps on one batch should lower the loss, got {losses}"
    assert scaler.get_scale() == 2.0**11, \
        f"after 6 good steps with growth_interval=2 the scale must be 2^8 * 2^3 = 2048, got {scaler.get_scale():g} " \
        "(call scaler.update() once per step)"

    before = {k: v.clone() for k, v in model.state_dict().items()}
    overflowing = mod.LossScaler(init_scale=2.0**140)  # loss * 2^140 is inf in float32
    loss = mod.mixed_precision_step(model, optimizer, overflowing, inputs, targets, "cpu")
    assert loss == loss and abs(loss) < 100, f"return the unscaled loss, got {loss}"
    assert_no_problems(state_dict_problems(model.state_dict(), before, "after an overflowing step,", 0, 0),
                       "a step whose scaled gradients overflow must be skipped (scaler.step)")
    assert overflowing.get_scale() == 2.0**139, f"after an overflow the scale must halve, got {overflowing.get_scale():g}"
    mod.mixed_precision_step(model, optimizer, None, inputs, targets, "cpu")
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items()), \
        "with scaler=None (bf16 needs none) the step must be a plain backward and optimizer.step()"


MP_FOUND_INF_STEPS = 5  # rank 1 gets an inf gradient at step 1, rank 0 a nan at step 3


def _mp_found_inf_trace(scaler, rank: int | None):
    """Steps of a Linear(4, 3) identical on every rank except the injected inf/nan (rank None: both)."""
    gen = torch.Generator().manual_seed(3)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.copy_(torch.randn(3, 4, generator=gen))
        model.bias.copy_(torch.randn(3, generator=gen))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trace = []
    for step in range(MP_FOUND_INF_STEPS):
        x, c = torch.randn(5, 4, generator=gen), torch.randn(5, 3, generator=gen)
        if step == 1 and rank in (1, None):
            c[2, 1] = _MP_INF
        if step == 3 and rank in (0, None):
            c[4, 0] = _MP_NAN
        optimizer.zero_grad()
        scaler.scale((model(x) * c).sum()).backward()
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        trace.append((float(scaler.get_scale()), all(torch.equal(b, p) for b, p in zip(before, model.parameters()))))
    return trace, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _mp_found_inf_rank(ref: grading.ModuleRef):
    mod = ref.load()
    return _mp_found_inf_trace(mod.LossScaler(init_scale=2.0**6, growth_interval=2), dist.get_rank())


def test_2_2_found_inf_is_agreed_across_ranks(grade):
    results = run_world(_mp_found_inf_rank, 2, args=(grade("2.2"),))
    expected_trace, expected_state = _mp_found_inf_trace(torch.amp.GradScaler("cpu", init_scale=2.0**6, growth_interval=2), None)
    problems = []
    for rank, (trace, state) in enumerate(results):
        for step, ((scale, skipped), (e_scale, e_skipped)) in enumerate(zip(trace, expected_trace)):
            if (scale, skipped) != (e_scale, e_skipped):
                problems.append(f"rank {rank}, step {step}: {'skipped' if skipped else 'stepped'} with scale {scale:g} "
                                f"after update; expected {'skipped' if e_skipped else 'stepped'}, scale {e_scale:g}")
        problems += state_dict_problems(state, expected_state, f"rank {rank}, final", rtol=1e-6, atol=1e-7)
    assert_no_problems(problems, "rank 1 alone sees an inf at step 1, rank 0 alone a nan at step 3: every rank must "
                                 "skip both steps (all-reduce found_inf with MAX) and the replicas stay identical:")


def test_precision_modules_reject_bad_arguments():
    """Not graded: the checks are given code, outside the exercises."""
    accumulation, mixed_precision = grading.reference("2.1"), grading.reference("2.2")
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = _accum_batch(4, 0)
    with pytest.raises(ValueError, match="micro_batch_size"):
        accumulation.accumulation_step(model, accumulation.GradSync(model), optimizer, inputs, targets, 0)
    with pytest.raises(ValueError, match="targets"):
        accumulation.accumulation_step(model, accumulation.GradSync(model), optimizer, inputs, targets[:3], 2)
    for bad in (dict(init_scale=0.0), dict(growth_factor=1.0), dict(backoff_factor=1.0), dict(growth_interval=0)):
        with pytest.raises(ValueError):
            mixed_precision.LossScaler(**bad)
    scaler = mixed_precision.LossScaler()
    with pytest.raises(RuntimeError, match="update"):
        scaler.update()
