"""Graded tests of exercise 2.2, mixed precision and loss scaling (phase2_advanced/guidelines.md, section 2.2).

Run them with `python tests/test_phase2.py -k 2_2` (your code) or
`pytest tests/test_phase2.py -k 2_2` (the reference); tests/test_phase2.py collects them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import grading
from compare import assert_no_problems, diff_report, state_dict_problems
from common.launch import run_world
from common.models import build_model
from phase2.test_2_1_accumulation import _accum_batch


class _FakeGpus:
    """Pretend CUDA devices of the given compute capabilities, at the level torch.cuda asks.

    Patches what torch.cuda's own functions rely on (availability, device count, the
    current device, per-device properties, the device context, the emulation probe), so
    every public way to ask works and answers consistently: get_device_capability(d),
    get_device_properties(d).major, is_bf16_supported(including_emulation=...) inside
    `with torch.cuda.device(d)`. As in torch 2.14.1 (torch/cuda/__init__.py), bf16 is
    "supported" by emulation on every GPU unless including_emulation=False.
    """

    def __init__(self, monkeypatch, capabilities: list[tuple[int, int]], current: int = 0):
        self.capabilities, self.current = capabilities, current
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: len(capabilities))
        monkeypatch.setattr(cuda, "_lazy_init", lambda: None)
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "set_device", self._set_device)
        monkeypatch.setattr(cuda, "_exchange_device", self._exchange)
        monkeypatch.setattr(cuda, "_maybe_exchange_device", self._exchange)
        monkeypatch.setattr(cuda, "get_device_properties", self.properties)
        monkeypatch.setattr(cuda, "get_device_name", lambda device=None: self.properties(device).name)
        monkeypatch.setattr(cuda, "_check_bf16_tensor_supported", lambda device: True)  # emulation works
        monkeypatch.setattr(torch.version, "hip", None)

    def index(self, device) -> int:
        if device is None:
            return self.current
        if isinstance(device, int):
            return device
        device = torch.device(device)
        assert device.type == "cuda", f"asked CUDA about a {device.type} device"
        return self.current if device.index is None else device.index

    def properties(self, device=None):
        index = self.index(device)
        assert 0 <= index < len(self.capabilities), f"no CUDA device {index}"
        major, minor = self.capabilities[index]
        return SimpleNamespace(major=major, minor=minor, name=f"fake GPU sm_{major}{minor}",
                               total_memory=16 * 2**30, multi_processor_count=80)

    def _set_device(self, device) -> None:
        self.current = self.index(device)

    def _exchange(self, index: int) -> int:
        previous = self.current
        if index >= 0:
            self.current = index
        return previous


# (capabilities of devices 0, 1, ...; the current device; {device spec: expected dtype})
_BF16, _FP16 = torch.bfloat16, torch.float16
MP_DTYPE_CASES = [
    ([(8, 0), (7, 0)], 0, {"cuda": _BF16, "cuda:0": _BF16, "cuda:1": _FP16, ("cuda", 1): _FP16, ("cuda", 0): _BF16}),
    ([(7, 5), (9, 0)], 0, {"cuda": _FP16, "cuda:0": _FP16, "cuda:1": _BF16, ("cuda", 1): _BF16, ("cuda",): _FP16}),
    ([(7, 5), (9, 0)], 1, {"cuda": _BF16, ("cuda",): _BF16, "cuda:0": _FP16, ("cuda", 0): _FP16}),
    ([(6, 1)], 0, {"cuda": _FP16, "cuda:0": _FP16}),         # Pascal (P100 is 6.0, GTX 10x0 6.1)
    ([(8, 6)], 0, {"cuda": _BF16, ("cuda", 0): _BF16}),      # Ampere consumer (RTX 30x0)
    ([(12, 0)], 0, {"cuda": _BF16}),                          # a future architecture
]
_MP_GPU_NAMES = {(6, 1): "Pascal", (7, 0): "Volta V100", (7, 5): "Turing T4", (8, 0): "Ampere A100",
                 (8, 6): "Ampere RTX 30x0", (9, 0): "Hopper H100", (12, 0): "a newer GPU"}


def test_2_2_autocast_dtype_per_device(grade, monkeypatch):
    mod = grade("2.2").load()
    assert mod.autocast_dtype("cpu") == torch.bfloat16, "CPU autocast: bfloat16"
    assert mod.autocast_dtype(torch.device("cpu")) == torch.bfloat16, "CPU autocast (torch.device): bfloat16"
    for other in ("meta", torch.device("mps"), "xpu:0"):  # nothing asks CUDA about a device that is not CUDA
        assert mod.autocast_dtype(other) == torch.bfloat16, \
            f"autocast_dtype({other!r}) = {mod.autocast_dtype(other)}: every device but CUDA gets bfloat16"
    problems = []
    for capabilities, current, expected in MP_DTYPE_CASES:
        with monkeypatch.context() as patch:
            gpus = _FakeGpus(patch, capabilities, current)
            for spec, dtype in expected.items():
                device = torch.device(*spec) if isinstance(spec, tuple) else spec
                shown = f"torch.device({', '.join(map(repr, spec))})" if isinstance(spec, tuple) else repr(spec)
                got = mod.autocast_dtype(device)
                gpu = gpus.capabilities[gpus.index(device)]
                where = (f"GPUs {[_MP_GPU_NAMES[c] + ' ' + '.'.join(map(str, c)) for c in capabilities]}, "
                         f"current device {current}: autocast_dtype({shown})")
                if got != dtype:
                    why = ("native bf16 (compute capability >= 8)" if dtype == _BF16 else
                           "no native bf16: fp16 + loss scaling (torch.cuda.is_bf16_supported() says True there "
                           "too, by emulation, unless including_emulation=False)")
                    problems.append(f"{where} = {got}, expected {dtype}: device {gpus.index(device)} is "
                                    f"{_MP_GPU_NAMES[gpu]}, {why}")
                if gpus.current != current:
                    problems.append(f"{where} changed the current CUDA device to {gpus.current}: ask about a device "
                                    "without selecting it (or restore it: `with torch.cuda.device(...)`)")
                    gpus.current = current
    assert_no_problems(problems, "the autocast dtype must follow the capability of the device asked about (mocked "
                                 "GPUs, no real GPU needed):")


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
# Property tests draw their cases from a fixed seed: a grading run is reproducible.
PROPERTY_SETTINGS = dict(derandomize=True, database=None, deadline=None)


def _mp_scaler_trace(scaler, events=MP_SCALER_EVENTS, resume_at=None, fresh=None):
    """Train a Linear(4, 3) through `scaler` over `events`; per step: (scale after update, skipped, scaled loss,
    params, scaler.state_dict()). resume_at=i: before step i the scaler is replaced by `fresh()` loaded from
    its state_dict(), as a run resumed from a checkpoint would."""
    gen = torch.Generator().manual_seed(0)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.copy_(torch.randn(3, 4, generator=gen))
        model.bias.copy_(torch.randn(3, generator=gen))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trace = []
    for step, (event, explicit_unscale) in enumerate(events):
        if step == resume_at:
            state, scaler = scaler.state_dict(), fresh()
            scaler.load_state_dict(state)
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
                      {k: v.detach().clone() for k, v in model.state_dict().items()}, dict(scaler.state_dict())))
    return trace


def test_2_2_loss_scaler_matches_torch_grad_scaler(grade):
    mod = grade("2.2").load()
    expected = _mp_scaler_trace(torch.amp.GradScaler("cpu", **MP_SCALER_ARGS))
    actual = _mp_scaler_trace(mod.LossScaler(**MP_SCALER_ARGS))
    for step, ((scale, skipped, scaled, state, _), (e_scale, e_skipped, e_scaled, e_state, _)) in enumerate(zip(actual, expected)):
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


_MP_EVENTS = st.lists(st.tuples(st.sampled_from(["ok", "ok", "ok", "inf", "nan", "huge"]), st.booleans()),
                      min_size=1, max_size=14)


def test_2_2_loss_scaler_rules_for_any_factors_and_interval(grade):
    """Any init_scale, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1 and any
    sequence of clean and overflowing steps (explicit unscale_ or not), resumed from a
    state_dict() at any step or not: after every step LossScaler and torch.amp.GradScaler agree
    on the scaled loss, the skip, the scale, the growth tracker and the parameters. (GradScaler
    keeps its scale in float32: scales are compared to 1e-5 relative.)"""
    mod = grade("2.2").load()

    @settings(max_examples=60, **PROPERTY_SETTINGS)
    @given(init_scale=st.floats(2.0**8, 2.0**24), growth=st.floats(1.01, 8.0), backoff=st.floats(0.01, 0.99),
           interval=st.integers(1, 4), events=_MP_EVENTS, resume=st.integers(0, 16))
    def check(init_scale, growth, backoff, interval, events, resume):
        args = dict(init_scale=init_scale, growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
        resume_at = resume if resume < len(events) else None
        expected = _mp_scaler_trace(torch.amp.GradScaler("cpu", **args), events, resume_at,
                                    lambda: torch.amp.GradScaler("cpu"))
        actual = _mp_scaler_trace(mod.LossScaler(**args), events, resume_at, lambda: mod.LossScaler())
        case = (f"LossScaler({', '.join(f'{k}={v!r}' for k, v in args.items())})"
                f"{f', resumed from its state_dict() before step {resume_at}' if resume_at is not None else ''}")
        for step, (got, want) in enumerate(zip(actual, expected)):
            (scale, skipped, scaled, state, saved), (e_scale, e_skipped, e_scaled, e_state, e_saved) = got, want
            what = (f"{case}, events {[e for e, _ in events[:step + 1]]}: step {step} ({events[step][0]} gradients"
                    f"{', unscale_ + clip before step' if events[step][1] else ''})")
            assert skipped == e_skipped, (f"{what}: the optimizer step was {'skipped' if skipped else 'taken'}; "
                                          f"GradScaler {'skips' if e_skipped else 'takes'} it")
            assert scale == pytest.approx(e_scale, rel=1e-5), (
                f"{what}: scale {scale!r} after update(), GradScaler has {e_scale!r} (scales so far: "
                f"{[t[0] for t in expected[:step + 1]]})")
            assert saved.get("_growth_tracker") == e_saved["_growth_tracker"], (
                f"{what}: state_dict()['_growth_tracker'] is {saved.get('_growth_tracker')!r}, GradScaler's is "
                f"{e_saved['_growth_tracker']} (clean steps since the scale last changed: a checkpoint must keep it)")
            assert_no_problems(
                [p for p in [diff_report(scaled.float(), e_scaled, f"{what}: scaler.scale(loss)", rtol=1e-5, atol=0)] if p] +
                state_dict_problems(state, e_state, f"{what}: parameter", rtol=1e-5, atol=1e-6),
                "LossScaler must drive the optimizer as torch.amp.GradScaler does:")

    grading.stop_hypothesis_at_todo(check)()  # a TODO is reported at once, not shrunk


def test_2_2_scale_that_would_overflow_does_not_grow(grade):
    """A clean step at a scale S whose growth S * growth_factor is no longer a finite float leaves S
    (and restarts the growth tracker), as GradScaler does: the scale never becomes inf."""
    mod = grade("2.2").load()
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no backward: no gradient, so nothing overflows
    for init_scale, growth in ((2.0**1023, 2.0), (1.5e308, 1.5), (2.0**1000, 2.0**30)):
        scaler = mod.LossScaler(init_scale=init_scale, growth_factor=growth, growth_interval=1)
        for step in range(2):
            scaler.step(optimizer)
            scaler.update()
            assert scaler.get_scale() == init_scale, (
                f"LossScaler(init_scale={init_scale!r}, growth_factor={growth!r}, growth_interval=1), clean step "
                f"{step}: the scale became {scaler.get_scale()!r}; {init_scale!r} * {growth!r} is not finite, so the "
                "scale must stay where it is")
            assert scaler.state_dict()["_growth_tracker"] == 0, \
                f"after a clean step at the growth interval the growth tracker restarts at 0, got {scaler.state_dict()}"


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


def _mp_reference_steps(batches, scaler_factory):
    """Per batch: the loss and the weights after a bf16-autocast step done right, on the MLP (SGD, lr 0.1)."""
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_factory()
    out = []
    for inputs, targets in batches:
        loss = _mp_reference_steps_on(model, optimizer, scaler, inputs, targets)
        out.append((loss, {k: v.clone() for k, v in model.state_dict().items()}))
    return out


def _mp_learner_steps(mod, batches, scaler_factory):
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_factory()
    return [(mod.mixed_precision_step(model, optimizer, scaler, inputs, targets, "cpu"),
             {k: v.clone() for k, v in model.state_dict().items()}) for inputs, targets in batches]


_MP_SCALERS = {"scaler=None": lambda: None,
               "torch.amp.GradScaler('cpu')": lambda: torch.amp.GradScaler("cpu", init_scale=2.0**12)}


def test_2_2_loss_is_computed_in_float32(grade):
    mod = grade("2.2").load()
    batches = [_accum_batch(32, step) for step in range(3)]
    problems = []
    for label, factory in _MP_SCALERS.items():
        expected = _mp_reference_steps(batches[:1], factory)
        (loss, state), ((e_loss, e_state),) = _mp_learner_steps(mod, batches[:1], factory)[0], expected
        if not isinstance(loss, float) or loss != pytest.approx(e_loss, rel=1e-6, abs=0):
            problems.append(f"{label}: returned loss {loss!r}, the float32 cross-entropy of the bf16 logits is "
                            f"{e_loss!r} (differs by {abs(float(loss) - e_loss):.3g}; bf16 rounds a loss near 2.3 "
                            "in steps of 0.0156)")
        problems += state_dict_problems(state, e_state, f"{label}, after one step, parameter", rtol=1e-5, atol=1e-7)
    assert_no_problems(problems, "the loss (and so the gradient) must be computed in float32 from the low-precision "
                                 "logits, e.g. F.cross_entropy(logits.float(), targets): a bf16 cross-entropy and its "
                                 "backward keep only bf16's 2-3 significant digits")


def test_2_2_each_step_uses_only_its_own_gradients(grade):
    mod = grade("2.2").load()
    batches = [_accum_batch(32, step) for step in range(3)]
    problems = []
    for label, factory in _MP_SCALERS.items():
        expected, got = _mp_reference_steps(batches, factory), _mp_learner_steps(mod, batches, factory)
        for step, ((loss, state), (e_loss, e_state)) in enumerate(zip(got, expected)):
            problems += state_dict_problems(state, e_state, f"{label}, after step {step}, parameter",
                                            rtol=1e-5, atol=1e-6)
    assert_no_problems(problems, "3 mixed-precision steps on 3 different batches must move the weights like 3 "
                                 "correct steps (SGD, no momentum): each step's gradient is its own batch's only "
                                 "(zero the gradients every step)")


class _PartlyTrained(nn.Module):
    """A frozen first layer, a trained head, and an auxiliary layer no forward uses (its .grad stays None)."""

    def __init__(self):
        super().__init__()
        self.mlp = build_model("mlp", (1, 8, 8), 10, seed=0)
        first = next(m for m in self.mlp.modules() if isinstance(m, nn.Linear))
        first.requires_grad_(False)
        self.unused = nn.Linear(10, 10)

    def forward(self, x):
        return self.mlp(x)


def test_2_2_step_with_frozen_and_unused_parameters(grade):
    """Parameters without a gradient (frozen, or unused by the forward) are in the optimizer too:
    the step must skip them, with LossScaler, torch's GradScaler or no scaler, on torch.device('cpu')."""
    mod = grade("2.2").load()
    batches = [_accum_batch(16, step) for step in range(3)]
    problems = []
    torch_scaler = lambda: torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)  # noqa: E731
    cases = [("LossScaler", lambda: mod.LossScaler(init_scale=2.0**12, growth_interval=2), torch_scaler),
             ("torch.amp.GradScaler('cpu')", torch_scaler, torch_scaler), ("scaler=None", lambda: None, lambda: None)]
    for label, graded_scaler, reference_scaler in cases:
        models, losses = [], []
        for ours in (True, False):
            torch.manual_seed(3)
            model = _PartlyTrained()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
            scaler = graded_scaler() if ours else reference_scaler()
            run = []
            for inputs, targets in batches:
                if ours:
                    run.append(mod.mixed_precision_step(model, optimizer, scaler, inputs, targets, torch.device("cpu")))
                else:
                    run.append(_mp_reference_steps_on(model, optimizer, scaler, inputs, targets))
            models.append(model)
            losses.append(run)
        what = f"{label}, a frozen layer and an unused one, 3 steps"
        if losses[0] != pytest.approx(losses[1], rel=1e-6):
            problems.append(f"{what}: returned losses {losses[0]}, expected {losses[1]}")
        problems += state_dict_problems(models[0].state_dict(), models[1].state_dict(), f"{what}: parameter",
                                        rtol=1e-5, atol=1e-6)
        for name, param in models[0].named_parameters():
            if not param.requires_grad and param.grad is not None:
                problems.append(f"{what}: the frozen {name} got a .grad")
    assert_no_problems(problems, "mixed_precision_step must train what has a gradient and leave the rest alone:")


def _mp_reference_steps_on(model, optimizer, scaler, inputs, targets):
    """One bf16-autocast step done right (GradScaler or none) on the given model; its loss."""
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(inputs)
    loss = F.cross_entropy(logits.float(), targets)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return loss.item()


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
                                 "skip both steps (all-reduce found_inf, with MAX or SUM) and the replicas stay identical:")


def test_precision_modules_reject_bad_arguments():
    """Not graded: the checks are given code, outside the exercises."""
    accumulation, mixed_precision = grading.reference("2.1"), grading.reference("2.2")
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = _accum_batch(4, 0)
    for micro in (0, -2):
        with pytest.raises(ValueError, match="micro_batch_size"):
            accumulation.accumulation_step(accumulation.GradSync(model), optimizer, inputs, targets, micro)
    for x, y in ((inputs, targets[:3]), (inputs[:0], targets[:0])):  # fewer targets; no sample at all
        with pytest.raises(ValueError, match="targets"):
            accumulation.accumulation_step(accumulation.GradSync(model), optimizer, x, y, 2)
    for bad in (dict(init_scale=0.0), dict(init_scale=-4.0), dict(growth_factor=1.0), dict(growth_factor=0.5),
                dict(backoff_factor=1.0), dict(backoff_factor=0.0), dict(backoff_factor=1.5), dict(growth_interval=0)):
        with pytest.raises(ValueError):
            mixed_precision.LossScaler(**bad)
    scaler = mixed_precision.LossScaler()
    with pytest.raises(RuntimeError, match="update"):
        scaler.update()
    model.zero_grad()
    scaler.scale(F.cross_entropy(model(inputs), targets)).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="unscale_"):  # gradients would be divided twice
        scaler.unscale_(optimizer)


class _ReturningSGD(torch.optim.SGD):
    """An optimizer whose step() returns something (as step(closure) returns the closure's loss)."""

    def step(self, closure=None):
        super().step(closure)
        return "stepped"


def _mp_direct_trace(scaler, inf_at: int = 2) -> dict:
    """GradScaler's loop written out by hand: scale a NON-scalar output (then sum it), unscale_ explicitly (with
    frozen and unused parameters whose .grad is None), clip, step (its return value), update; an inf in one
    gradient at step `inf_at`; also scale() of a bf16 and of a 2-D tensor."""
    torch.manual_seed(3)
    model = _PartlyTrained()
    optimizer = _ReturningSGD(model.parameters(), lr=0.1, momentum=0.9)
    trace = {"returned": [], "scale": [], "scaled": []}
    for step, (inputs, targets) in enumerate(_accum_batch(8, s) for s in range(4)):
        optimizer.zero_grad()
        scaler.scale(model(inputs) - F.one_hot(targets, 10)).pow(2).sum().div(2.0**16).backward()
        if step == inf_at:
            next(p for p in model.parameters() if p.grad is not None).grad[0].fill_(float("inf"))
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0,
                                       error_if_nonfinite=False)
        trace["returned"].append(scaler.step(optimizer))
        scaler.update()
        trace["scale"].append(scaler.get_scale())
    for t in (torch.tensor(3.0, dtype=torch.bfloat16), torch.tensor([[1.0, -2.0], [0.5, 4.0]])):
        trace["scaled"].append(scaler.scale(t).float())
    trace["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return trace


def test_2_2_loss_scaler_used_by_hand_like_grad_scaler(grade):
    """LossScaler driven as torch.amp.GradScaler is by hand: scale() of a non-scalar tensor and of a bf16 one,
    unscale_ called explicitly with parameters whose .grad is None (frozen, unused), a clip between unscale_ and
    step, step() returning what optimizer.step() returned (None when skipped), an inf in one step: the same
    returns, scales and parameters as GradScaler('cpu') with the same arguments."""
    mod = grade("2.2").load()
    kwargs = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    ours, theirs = _mp_direct_trace(mod.LossScaler(**kwargs)), _mp_direct_trace(torch.amp.GradScaler("cpu", **kwargs))
    problems = []
    if ours["returned"] != theirs["returned"]:
        problems.append(f"LossScaler.step returned {ours['returned']} in the 4 steps, GradScaler {theirs['returned']} "
                        "(what optimizer.step() returned; None for the step skipped on an inf)")
    if ours["scale"] != theirs["scale"]:
        problems.append(f"the scale after each update: {ours['scale']}, GradScaler's {theirs['scale']}")
    for i, (a, b) in enumerate(zip(ours["scaled"], theirs["scaled"])):
        problem = diff_report(a, b, f"LossScaler.scale({['a bf16 scalar', 'a 2-D tensor'][i]})", rtol=1e-2, atol=0)
        if problem:
            problems.append(problem)
    problems += state_dict_problems(ours["params"], theirs["params"], "after 4 steps, parameter", rtol=1e-5, atol=1e-6)
    assert_no_problems(problems, "LossScaler used by hand (scale, unscale_, clip, step, update) against "
                                 "torch.amp.GradScaler('cpu'):")
