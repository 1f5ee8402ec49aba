"""Graded tests of exercise 2.4, ZeRO-style sharding (phase2_advanced/guidelines.md, section 2.4).

Run them with `python tests/test_phase2.py -k 2_4` (your code) or
`pytest tests/test_phase2.py -k 2_4` (the reference); tests/test_phase2.py collects them.

Each stage runs in its own world of 3 ranks, and each scenario of a stage is reported by
its own tests, so a bug in one stage (or one scenario) fails only the tests that see it.
What is graded is behaviour: the parameters reached, the bytes a rank holds (between
steps and at the peak), and the collectives it calls; not the layout of the shards (a
per-parameter sharding passes as well as one flat vector per unit).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import grading
from common.measure import CollectiveLog, PeakBytes, ring_elements_sent, training_memory
from compare import assert_no_problems, diff_report, state_dict_problems
from scenarios import SharedWorld, run_scenarios

_WORLD, _BATCH = 3, 12  # 4 samples per rank
_AGREE_S = 20  # how long ranks wait for each other between scenarios
_CLASSES = {1: "ZeroStage1", 2: "ZeroStage2", 3: "ZeroStage3"}
_ADAM = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
# eps far above the gradients' size: Adam's update is then ~ lr * exp_avg / eps, proportional to
# the gradient, so a gradient N times too large (summed over ranks, not averaged) moves the
# parameters ~N times too far, where plain Adam (m / sqrt(v)) would hide the factor.
_SGD_LIKE = dict(lr=0.05, betas=(0.9, 0.999), eps=1.0, weight_decay=0.0)


def _mlp() -> nn.Module:
    """7 Linear layers, 1045 parameters, the largest layer 182 (17%): a gradient that exists whole is visible."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(4, 13), nn.ReLU()]
        for _ in range(5):
            layers += [nn.Linear(13, 13), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(13, 5))


class Gated(nn.Module):
    """Linear, then times a learned per-feature `scale` only while `use_scale` is True."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.full((width,), 1.5))
        self.use_scale = True

    def forward(self, x):
        y = self.linear(x)
        return y * self.scale if self.use_scale else y


def _gated_mlp() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 13), nn.ReLU(), Gated(13), nn.ReLU(), nn.Linear(13, 5))


@dataclass(frozen=True)
class Scenario:
    what: str
    model: Callable[[], nn.Module]
    adam: dict
    steps: int
    backward_passes: int = 1  # per step, each on its own micro-batch of _BATCH samples
    use_scale: tuple = ()  # Gated.use_scale per step


_SCENARIOS = {
    "adam": Scenario("3 Adam steps (weight decay 0.1)", _mlp, _ADAM, 3),
    "sgd_like": Scenario("2 steps of Adam with eps = 1.0, so the update is proportional to the gradient",
                         _mlp, _SGD_LIKE, 2),
    "accumulate": Scenario("2 steps, each of 2 backward passes on 2 micro-batches then step() (eps = 1.0)",
                           _mlp, _SGD_LIKE, 2, backward_passes=2),
    "unused": Scenario("3 Adam steps of a model whose Gated unit skips its `scale` parameter in steps 1 and 3",
                       _gated_mlp, _ADAM, 3, use_scale=(False, True, False)),
}


def _batches(scenario: Scenario) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, per backward pass: (inputs (_BATCH, 4), targets (_BATCH,)), the whole batch of all ranks."""
    gen = torch.Generator().manual_seed(5)
    return [[(torch.randn(_BATCH, 4, generator=gen), torch.randint(0, 5, (_BATCH,), generator=gen))
             for _ in range(scenario.backward_passes)] for _ in range(scenario.steps)]


def _set_use_scale(model: nn.Module, scenario: Scenario, step: int) -> None:
    for module in model.modules():
        if isinstance(module, Gated):
            module.use_scale = scenario.use_scale[step]


# ---------------------------------------------------------------- inside a rank


def _run_scenario(mod, stage: int, scenario: Scenario) -> dict:
    rank = dist.get_rank()
    part = slice(rank * (_BATCH // _WORLD), (rank + 1) * (_BATCH // _WORLD))
    model = scenario.model()
    optimizer = getattr(mod, _CLASSES[stage])(model, **scenario.adam)
    peak = PeakBytes(lambda: training_memory(model, optimizer))
    between_steps, sent = [], []
    for step, micro_batches in enumerate(_batches(scenario), start=1):
        if scenario.use_scale:
            _set_use_scale(model, scenario, step - 1)
        with CollectiveLog(on_call=lambda call: peak.sample(f"{call.name} in step {step}")) as log:
            for inputs, targets in micro_batches:
                F.cross_entropy(model(inputs[part]), targets[part]).backward()
                peak.sample(f"the end of backward in step {step}")
            optimizer.step()
        between_steps.append(peak.sample(f"the end of step {step}"))
        per_name: dict[str, float] = {}
        for call in log.calls:
            per_name[call.name] = per_name.get(call.name, 0.0) + ring_elements_sent(call, _WORLD)
        sent.append(per_name)
    return {"state": optimizer.full_state_dict(), "between_steps": between_steps, "peak": peak.peak,
            "peak_where": peak.where, "sent": sent}


def _zero_stage_rank(ref: grading.ModuleRef, stage: int) -> dict:
    """Every scenario, in turn, agreeing after each (tests/scenarios.py): if one rank raised
    while the others wait inside a collective it left, they never arrive, and this rank
    ends the world with its error (a clear failure now, not a deadlock later)."""
    mod = ref.load()
    return run_scenarios({name: partial(_run_scenario, mod, stage, scenario) for name, scenario in _SCENARIOS.items()},
                         _AGREE_S)


# ---------------------------------------------------------------- in the parent

_world = SharedWorld(_zero_stage_rank, _WORLD)


def _results(ref: grading.ModuleRef, stage: int, name: str) -> list[dict]:
    """Per rank, the results of one scenario of one stage; one world per stage, shared by its tests."""
    return _world.results(name, ref, stage, world=f"{_CLASSES[stage]}: the world of {_WORLD} ranks",
                          what=f"{_CLASSES[stage]} during {_SCENARIOS[name].what}")


_truths: dict = {}


def _ground_truth(name: str) -> dict:
    """One process, torch.optim.Adam, the whole batch; a parameter without gradient counts as a zero gradient."""
    if name not in _truths:
        scenario = _SCENARIOS[name]
        model = scenario.model()
        optimizer = torch.optim.Adam(model.parameters(), **scenario.adam)
        for step, micro_batches in enumerate(_batches(scenario)):
            if scenario.use_scale:
                _set_use_scale(model, scenario, step)
            for inputs, targets in micro_batches:
                F.cross_entropy(model(inputs), targets).backward()
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            optimizer.step()
            optimizer.zero_grad()
        _truths[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return _truths[name]


def _parameters_problems(results: list[dict], name: str, stage: int) -> list[str]:
    expected, cls = _ground_truth(name), _CLASSES[stage]
    problems = []
    for rank, r in enumerate(results):
        problems += state_dict_problems(r["state"], expected, f"{cls}, rank {rank}:", rtol=1e-4, atol=1e-5)
        if rank:
            problems += state_dict_problems(r["state"], results[0]["state"], f"{cls}, rank {rank} vs rank 0:", 0, 0)
    return problems


def _header(name: str, stage: int) -> str:
    return (f"{_CLASSES[stage]} on {_WORLD} ranks ({_BATCH // _WORLD} samples each), {_SCENARIOS[name].what}, "
            f"must end with the parameters of one process on all {_BATCH} samples with torch.optim.Adam, "
            "on every rank:")


def _psi(name: str) -> tuple[int, int]:
    """(parameters, parameter tensors) of the scenario's model."""
    params = list(_SCENARIOS[name].model().parameters())
    return sum(p.numel() for p in params), len(params)


def _memory_expected(stage: int, name: str) -> tuple[dict, dict, int]:
    """(bytes between steps by kind, the same in units of Psi as text, tolerance in bytes) for fp32 Adam.

    Kinds as common.measure.training_memory: the model's full parameters, their .grad, and
    what the optimizer keeps besides (shards, Adam state). The tolerance is padding: up
    to N-1 elements per parameter tensor in each of 4 arrays (params, grads, exp_avg, exp_avg_sq).
    """
    psi, tensors = _psi(name)
    n = _WORLD
    per_psi = {1: (4, 4, 8 / n), 2: (4, 0, 12 / n), 3: (0, 0, 16 / n)}[stage]
    freed = "0: each p.grad freed once reduced"
    text = {1: ("4 Psi", "4 Psi", "8 Psi/N"), 2: ("4 Psi", freed, "12 Psi/N (grad shard + Adam)"),
            3: ("0: each unit freed after use", freed, "16 Psi/N (param and grad shards + Adam)")}[stage]
    kinds = ("params", "grads", "optimizer")
    return ({k: round(f * psi) for k, f in zip(kinds, per_psi)}, dict(zip(kinds, text)), 16 * (n - 1) * tensors)


_KIND_WORDS = {"params": "full parameters (the model's)", "grads": "full gradients (the model's .grad)",
               "optimizer": "optimizer-held tensors (shards, Adam state)"}


def _memory_problems(results: list[dict], name: str, stage: int) -> list[str]:
    expected, text, tol = _memory_expected(stage, name)
    problems = []
    for rank, r in enumerate(results):
        for step, got in enumerate(r["between_steps"], start=1):
            for kind, value in expected.items():
                if got[kind] > value + tol:
                    problems.append(f"{_CLASSES[stage]}, rank {rank}, after step {step}: holds {got[kind]} bytes of "
                                    f"{_KIND_WORDS[kind]}, expected {value} ({text[kind]}) + at most {tol} of padding")
    return problems


# ---------------------------------------------------------------- the tests


def test_2_4_adam_update_matches_torch_adam(grade):
    mod = grade("2.4").load()
    gen = torch.Generator().manual_seed(3)
    problems = []
    for weight_decay in (0.0, 0.1):
        hyper = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-8, weight_decay=weight_decay)
        start = torch.randn(7, 5, generator=gen)
        reference = nn.Parameter(start.clone())
        torch_adam = torch.optim.Adam([reference], **hyper)
        param, exp_avg, exp_avg_sq = start.clone(), torch.zeros(7, 5), torch.zeros(7, 5)
        for step in range(1, 5):
            grad = torch.randn(7, 5, generator=gen)
            given = grad.clone()
            mod.adam_update(param, given, exp_avg, exp_avg_sq, step, **hyper)
            reference.grad = grad.clone()
            torch_adam.step()
            state = torch_adam.state[reference]
            for what, got, want in (("param", param, reference.detach()), ("exp_avg", exp_avg, state["exp_avg"]),
                                    ("exp_avg_sq", exp_avg_sq, state["exp_avg_sq"]),
                                    ("grad (must not change)", given, grad)):
                problem = diff_report(got, want, f"weight_decay={weight_decay}, step {step}, {what}",
                                      rtol=1e-5, atol=1e-7)
                if problem:
                    problems.append(problem)
    assert_no_problems(problems, "adam_update vs torch.optim.Adam on a (7, 5) tensor, 4 steps, random gradients:")


def _check_trains_like_data_parallel_adam(grade, stage):
    """3 Adam steps on 3 ranks end where one process with torch.optim.Adam ends, on every rank."""
    results = _results(grade("2.4"), stage, "adam")
    assert_no_problems(_parameters_problems(results, "adam", stage), _header("adam", stage))


def _check_gradient_is_averaged_over_ranks(grade, stage):
    """With eps = 1.0 (update proportional to the gradient) too: the gradient is the mean over ranks, not the sum."""
    results = _results(grade("2.4"), stage, "sgd_like")
    problems = _parameters_problems(results, "sgd_like", stage)
    if problems:
        start, expected = _SCENARIOS["sgd_like"].model().state_dict(), _ground_truth("sgd_like")
        moved = sum((results[0]["state"][k] - start[k]).norm() ** 2 for k in start) ** 0.5
        should = sum((expected[k] - start[k]).norm() ** 2 for k in start) ** 0.5
        problems.insert(0, f"rank 0's parameters moved {moved / should:.2f}x as far as they should (with eps = 1.0 the "
                           f"step is proportional to the gradient: ~{_WORLD}x means summed over the {_WORLD} ranks "
                           "instead of averaged)")
    assert_no_problems(problems, _header("sgd_like", stage))


def _check_gradients_accumulate_over_backward_passes(grade, stage):
    """Two backward passes then step() is one step on the sum of both passes' gradients."""
    results = _results(grade("2.4"), stage, "accumulate")
    assert_no_problems(_parameters_problems(results, "accumulate", stage),
                       _header("accumulate", stage) + " (two backward passes add their gradients, as .grad does; the "
                                                      "reference's loss is the sum of the two micro-batches' losses)")


def _check_parameter_without_gradient(grade, stage):
    """A parameter the forward skipped: no hang, a zero gradient for it, and everything freed after the step."""
    results = _results(grade("2.4"), stage, "unused")
    problems = _parameters_problems(results, "unused", stage) + _memory_problems(results, "unused", stage)
    assert_no_problems(problems, _header("unused", stage) + " (a parameter without gradient in a backward counts as "
                                                          "a zero gradient), and free what it frees after every step:")


def _check_memory_between_steps(grade, stage):
    """Bytes held after every step, by kind, within padding of the stage's formula."""
    results = _results(grade("2.4"), stage, "adam")
    psi, _ = _psi("adam")
    assert_no_problems(_memory_problems(results, "adam", stage),
                       f"bytes each rank holds after each step (common.measure.training_memory), Psi = {psi} fp32 "
                       f"parameters, N = {_WORLD}:")


def _check_peak_memory(grade, stage):
    """Bytes held at every collective and at the end of every backward: the full gradient (stage 3: the full
    parameters) never exists at once."""
    results = _results(grade("2.4"), stage, "adam")
    expected, text, tol = _memory_expected(stage, "adam")
    psi, _ = _psi("adam")
    half = 4 * psi // 2  # the full gradient (or, stage 3, the full parameters) must never exist at once
    bounds = {kind: (value + tol, f"{value} ({text[kind]}) + {tol} of padding") for kind, value in expected.items()}
    if stage >= 2:
        bounds["grads"] = (half, f"{half}, half the model's gradient: reduce-scatter each unit's gradients as soon "
                                 "as backward has produced them all, and free them")
    if stage == 3:
        bounds["params"] = (half, f"{half}, half the model's parameters: gather a unit just before it runs, free it "
                                  "right after (forward) or once its gradients are reduced (backward)")
    problems = []
    for rank, r in enumerate(results):
        for kind, (bound, how) in bounds.items():
            if r["peak"][kind] > bound:
                problems.append(f"{_CLASSES[stage]}, rank {rank}: {r['peak'][kind]} bytes of {_KIND_WORDS[kind]} at "
                                f"{r['peak_where'][kind]}; at most {how}")
    assert_no_problems(problems, f"peak bytes each rank holds, sampled at every collective and at the end of every "
                                 f"backward, Psi = {psi} fp32 parameters in 7 layers, N = {_WORLD}:")


def _check_communication_per_step(grade, stage):
    """Elements sent per step (ring model of the calls made): stage 2 moves what DP does, RS + all-gather."""
    results = _results(grade("2.4"), stage, "adam")
    psi, tensors = _psi("adam")
    n = _WORLD
    factor, how = {1: (3, "an all-reduce of the gradient (2) and an all-gather of the parameters (1)"),
                   2: (2, "a reduce-scatter of the gradient (1) and an all-gather of the parameters (1): DP's volume"),
                   3: (3, "an all-gather in forward (1), one in backward (1), a reduce-scatter (1)")}[stage]
    bound = factor * psi * (n - 1) / n + 3 * (n - 1) * tensors  # + padding
    problems = []
    for rank, r in enumerate(results):
        for step, per_name in enumerate(r["sent"], start=1):
            total = sum(per_name.values())
            if total > bound:
                calls = ", ".join(f"{k} {v / psi:.2f}" for k, v in sorted(per_name.items()))
                problems.append(f"{_CLASSES[stage]}, rank {rank}, step {step}: sends {total / psi:.2f} x Psi "
                                f"({calls}), at most {bound / psi:.2f}")
    hint = (" An all-reduce then a slice moves twice a reduce-scatter's bytes (2(N-1)/N vs (N-1)/N): use "
            "dist.reduce_scatter_tensor." if stage == 2 else "")
    assert_no_problems(problems, f"elements each rank sends per step (forward, backward, step), counted from the "
                                 f"collectives it calls with the ring model, in units of Psi = {psi}, N = {n}; "
                                 f"expected ~{factor} (N-1)/N = {factor * (n - 1) / n:.2f}: {how}.{hint}")


def _one_test_per_stage(check) -> None:
    """test_2_4_<what>_stage1..3 from `check(grade, stage)`: each stage is its own test (and world), so a
    negative control, or a learner's bug, in one stage fails only that stage's tests."""
    for stage in _CLASSES:
        def test(grade, stage=stage):
            check(grade, stage)
        test.__name__ = test.__qualname__ = f"test_2_4_{check.__name__.removeprefix('_check_')}_stage{stage}"
        test.__doc__ = f"{_CLASSES[stage]}: {check.__doc__}"
        globals()[test.__name__] = test


for _check in (_check_trains_like_data_parallel_adam, _check_gradient_is_averaged_over_ranks,
               _check_gradients_accumulate_over_backward_passes, _check_parameter_without_gradient,
               _check_memory_between_steps, _check_peak_memory, _check_communication_per_step):
    _one_test_per_stage(_check)
