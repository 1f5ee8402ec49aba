"""Graded tests of exercise 2.4, ZeRO-style sharding (phase2_advanced/guidelines.md, section 2.4).

Run them with `python tests/test_phase2.py -k 2_4` (your code) or
`pytest tests/test_phase2.py -k 2_4` (the reference); tests/test_phase2.py collects them.

Each stage runs in its own world of 3 ranks and in one of 2, and each scenario of a
stage is reported by its own tests, so a bug in one stage (or one scenario) fails only
the tests that see it. Stages 1 and 2 wrap torch.optim optimizers (`ZeroStage1(params,
torch.optim.AdamW, lr=...)`); stage 3 wraps the model and a torch.optim optimizer steps
its parameters (`torch.optim.AdamW(ZeroStage3(model).parameters(), lr=...)`). Each is
compared with that optimizer in one process on the whole batch: SGD with momentum, Adam,
AdamW, Adafactor, param groups with their own lr and weight decay under an LR scheduler,
tied and frozen parameters, gradient accumulation, several steps, a state_dict round
trip. Stage 3 is also held to what Stanford CS336's FSDP tests ask (3 SGD steps on 2 ranks
equal to one process, bitwise in fp32 and within a stated tolerance with a compute dtype;
gradients shaped and typed like their shards; replicated gradients the same on every
rank; run through tests/peer_adapters/cs336_fsdp.py), and against torch's own
`fully_shard` (FSDP2) on the same model: the same weights and the same bytes per rank.
What is graded is behaviour: the parameters reached, the bytes a rank holds (between
steps and at the peak), and the collectives it calls; not the layout of the shards (whole
parameters per rank, flat slices of every parameter, one flat vector per unit, or dim-0
rows as FSDP2 cuts them, alike within the bounds each test states).
"""

from __future__ import annotations

import copy
import functools
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import grading
from common.measure import CollectiveLog, PeakBytes, ring_elements_sent, training_memory
from compare import assert_no_problems, diff_report, state_dict_problems
from scenarios import SharedWorld, run_scenarios

_WORLD, _SMALL_WORLD, _BATCH = 3, 2, 12  # 4 samples per rank (6 in the world of 2)
_AGREE_S = 20  # how long ranks wait for each other between scenarios
_CLASSES = {1: "ZeroStage1", 2: "ZeroStage2", 3: "ZeroStage3"}
_ADAM = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
_SGD = dict(lr=0.05, momentum=0.9)  # a step proportional to the gradient: a sum over ranks goes N times too far


def _mlp() -> nn.Module:
    """7 Linear layers, 1045 parameters (3 ranks do not divide it), the largest layer 182 (17%): a gradient that
    exists whole is visible."""
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


def _frozen_mlp(tied: bool = False) -> nn.Module:
    """Linear 4-13, `a` 13-13, a frozen 13-13 (weight and bias), `b` 13-13, a 13-5 with a frozen bias; with
    tied=True `b` uses `a`'s weight (one Parameter in two layers, as an embedding and an output layer share
    theirs): 325 trainable parameters, odd, so neither 2 nor 3 ranks divide them."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        model = nn.Sequential(nn.Linear(4, 13), nn.ReLU(), nn.Linear(13, 13), nn.ReLU(), nn.Linear(13, 13), nn.ReLU(),
                              nn.Linear(13, 13), nn.ReLU(), nn.Linear(13, 5))
    if tied:
        model[6].weight = model[2].weight
    for p in (model[4].weight, model[4].bias, model[8].bias):
        p.requires_grad_(False)
    return model


class Fork(nn.Module):
    """One Linear(width, 2 width) whose output is returned as a tuple of its two halves."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, 2 * width)

    def forward(self, x):
        y = self.linear(x)
        return y[:, : y.shape[1] // 2], y[:, y.shape[1] // 2 :]


class Join(nn.Module):
    """Takes Fork's tuple (a, b): Linear(a) * b, so both halves reach the loss."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, pair):
        a, b = pair
        return self.linear(a) * b


def _forked_mlp() -> nn.Module:
    """A unit (Fork) whose output is a tuple of two tensors, both used by the next unit."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(4, 13), nn.ReLU(), Fork(13), Join(13), nn.ReLU(), nn.Linear(13, 5))


def _two_groups(model: nn.Module) -> list[dict]:
    """The first two layers at lr 0.1 without weight decay, the rest at lr 0.02 with 0.01 (default lr 0.05)."""
    params = list(model.parameters())
    return [{"params": params[:4], "lr": 0.1, "weight_decay": 0.0},
            {"params": params[4:], "lr": 0.02, "weight_decay": 0.01}]


@dataclass(frozen=True)
class Scenario:
    what: str
    model: Callable[[], nn.Module]
    optimizer: str  # a torch.optim class: wrapped by stages 1-2, stepping stage 3's parameters
    kwargs: dict
    steps: int
    backward_passes: int = 1  # per step, each on its own micro-batch of _BATCH samples
    use_scale: tuple = ()  # Gated.use_scale per step
    groups: Callable[[nn.Module], list[dict]] | None = None  # param groups (default: model.parameters())
    lr_decay: float | None = None  # torch.optim.lr_scheduler.StepLR(step_size=1, gamma=lr_decay) after each step
    set_to_none: bool = True  # zero_grad(set_to_none=...) before each step
    resume_after: int | None = None  # state_dict() after this step, loaded into a fresh model and optimizer
    may_refuse: tuple = ()  # stages that may refuse it at construction with a ValueError instead
    evaluate: bool = False  # after the steps, a forward under torch.no_grad() on _EVAL_INPUTS (an evaluation)
    closure: bool = False  # optimizer.step(closure): zero_grad, forward and backward inside the closure
    one_backward: bool = False  # the backward_passes micro-batches all go forward, then ONE backward of their sum


_SCENARIOS = {
    "adam": Scenario("3 torch.optim.Adam steps (weight decay 0.1)", _mlp, "Adam", _ADAM, 3, evaluate=True),
    "sgd": Scenario("2 steps of torch.optim.SGD with momentum 0.9 (the update is proportional to the gradient)",
                    _mlp, "SGD", _SGD, 2),
    "accumulate": Scenario("2 SGD steps (momentum, weight decay 0.01), each of 2 backward passes on 2 micro-batches "
                           "then step(), zero_grad(set_to_none=False) before each", _mlp, "SGD",
                           dict(_SGD, weight_decay=0.01), 2, backward_passes=2, set_to_none=False),
    "unused": Scenario("3 Adam steps of a model whose Gated unit skips its `scale` parameter in steps 1 and 3",
                       _gated_mlp, "Adam", _ADAM, 3, use_scale=(False, True, False)),
    "groups": Scenario("3 SGD steps (momentum) with 2 param groups (lr 0.1 and 0.02, weight decay 0 and 0.01) and "
                       "a StepLR scheduler halving every lr after each step", _mlp, "SGD", _SGD, 3, groups=_two_groups,
                       lr_decay=0.5),
    "tied_frozen": Scenario("3 torch.optim.AdamW steps (decoupled weight decay 0.1) of a model with a weight tied "
                            "between two layers and 3 frozen parameters (requires_grad=False)",
                            partial(_frozen_mlp, tied=True), "AdamW", _ADAM, 3),
    "frozen": Scenario("3 Adam steps (weight decay 0.1) of a model with 3 frozen parameters (requires_grad=False)",
                       _frozen_mlp, "Adam", _ADAM, 3),
    "tied_adam": Scenario("2 Adam steps of a model with a weight tied between two layers (units)",
                          partial(_frozen_mlp, tied=True), "Adam", _ADAM, 2, may_refuse=(3,)),
    "adafactor": Scenario("3 torch.optim.Adafactor steps (factored second moments of each weight matrix, updates "
                          "clipped per tensor: it needs whole parameters)", _mlp, "Adafactor",
                          dict(lr=1e-2, weight_decay=0.1), 3, may_refuse=(2,)),
    "two_forwards": Scenario("2 SGD steps (momentum), each ONE backward of the sum of two micro-batches' losses, "
                             "both forwarded first (every unit runs twice before its backward)", _mlp, "SGD", _SGD,
                             2, backward_passes=2, one_backward=True),
    "tuple": Scenario("3 Adam steps of a model whose unit Fork returns a tuple of two tensors, both used by the next "
                      "unit", _forked_mlp, "Adam", _ADAM, 3),
    "closure": Scenario("2 SGD steps (momentum) as optimizer.step(closure), the closure running zero_grad, forward "
                        "and backward and returning the loss", _mlp, "SGD", _SGD, 2, closure=True),
    "resume": Scenario("3 AdamW steps, the optimizer's state_dict() after step 2 loaded into a fresh model (same "
                       "parameters) and optimizer that take step 3", _mlp, "AdamW", _ADAM, 3, resume_after=2),
}
_NAMES = {1: ["adam", "sgd", "accumulate", "unused", "groups", "tied_frozen", "adafactor", "resume"],
          3: ["adam", "sgd", "accumulate", "unused", "frozen", "tied_adam", "tuple", "two_forwards", "refusals",
              "modes"]}
_NAMES[2] = _NAMES[1] + ["closure", "refusals"]
_NAMES[1] = _NAMES[1] + ["closure", "refusals"]
# the world of 2: stages 1 and 2 again; stage 3 as CS336's FSDP tests run it, and against torch's fully_shard
_SMALL_NAMES = {1: ["groups", "tied_frozen", "differential"], 2: ["groups", "tied_frozen", "differential"],
                3: ["peer_fp32", "peer_fp16", "peer_bf16", "fully_shard"]}
_OTHER_WHAT = {"refusals": "the documented errors",
               "modes": "ZeroStage3(model, compute_dtype=torch.float32, replicate_below=0) (the defaults spelled out) "
                        "read before any step, evaluated in eval mode under torch.no_grad() and under autocast, then "
                        "trained with a keyword argument (test test_2_4_modes_and_spelled_defaults_stage3)",
               "differential": "torch.optim.SGD, Adam and AdamW with options drawn by Hypothesis (test "
                               "test_2_4_matches_torch_optim_for_drawn_options)",
               "fully_shard": "3 AdamW steps next to torch's fully_shard on the same model",
               **{f"peer_{name}": f"3 SGD steps of a small language model with compute dtype {name} (CS336's FSDP tests)"
                  for name in ("fp32", "fp16", "bf16")}}


_EVAL_INPUTS = torch.randn(_BATCH, 4, generator=torch.Generator().manual_seed(9))


def _batches(scenario: Scenario) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, per backward pass: (inputs (_BATCH, 4), targets (_BATCH,)), the whole batch of all ranks."""
    gen = torch.Generator().manual_seed(5)
    return [[(torch.randn(_BATCH, 4, generator=gen), torch.randint(0, 5, (_BATCH,), generator=gen))
             for _ in range(scenario.backward_passes)] for _ in range(scenario.steps)]


def _set_use_scale(model: nn.Module, scenario: Scenario, step: int) -> None:
    for module in model.modules():
        if isinstance(module, Gated):
            module.use_scale = scenario.use_scale[step]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------- inside a rank


def _build(mod, stage: int, scenario: Scenario, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    """(what the forward calls, the optimizer): stages 1-2 wrap the optimizer, stage 3 the model."""
    cls = getattr(torch.optim, scenario.optimizer)
    if stage == 3:
        net = mod.ZeroStage3(model)
        return net, cls(net.parameters(), **scenario.kwargs)
    params = scenario.groups(model) if scenario.groups else model.parameters()
    return model, getattr(mod, _CLASSES[stage])(params, cls, **scenario.kwargs)


def _run_scenario(mod, stage: int, name: str) -> dict:
    scenario = _SCENARIOS[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    share = _BATCH // world
    part = slice(rank * share, (rank + 1) * share)
    model = scenario.model()
    try:
        net, optimizer = _build(mod, stage, scenario, model)
    except ValueError as exc:
        if stage in scenario.may_refuse:
            return {"refused": f"{type(exc).__name__}: {exc}"}
        raise
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, scenario.lr_decay) if scenario.lr_decay else None
    peak = PeakBytes(lambda: training_memory(net, optimizer))
    between_steps, sent, gathered = [], [], []  # gathered: per backward pass, parameter elements all-gathered

    def backward(loss: torch.Tensor, log: CollectiveLog, step: int) -> None:
        first = len(log.calls)
        loss.backward()
        gathered.append((step, sum(c.numel * world for c in log.calls[first:] if c.name in _GATHERS)))
    for step, micro_batches in enumerate(_batches(scenario), start=1):
        if scenario.use_scale:
            _set_use_scale(model, scenario, step - 1)
        if not scenario.closure:
            optimizer.zero_grad(set_to_none=scenario.set_to_none)
        losses = []

        def closure(optimizer=optimizer, net=net, micro_batches=micro_batches, step=step):
            """What torch.optim's step(closure) runs: zero_grad, forward, backward; returns the loss."""
            optimizer.zero_grad(set_to_none=scenario.set_to_none)
            total = 0.0
            for inputs, targets in micro_batches:
                loss = F.cross_entropy(net(inputs[part]), targets[part])
                loss.backward()
                total += loss.item()
            losses.append(total)
            return total

        with CollectiveLog(on_call=lambda call: peak.sample(f"{call.name} in step {step}")) as log:
            if scenario.closure:
                returned = optimizer.step(closure)
                if losses != [returned]:
                    raise AssertionError(f"step {step}: step(closure) ran the closure {len(losses)} times (must be "
                                         f"once) and returned {returned!r}; the closure returned {losses}")
            elif scenario.one_backward:
                backward(sum(F.cross_entropy(net(inputs[part]), targets[part]) for inputs, targets in micro_batches),
                         log, step)
                peak.sample(f"the end of backward in step {step}")
                optimizer.step()
            else:
                for inputs, targets in micro_batches:
                    backward(F.cross_entropy(net(inputs[part]), targets[part]), log, step)
                    peak.sample(f"the end of backward in step {step}")
                optimizer.step()
        if scheduler is not None:
            scheduler.step()
        between_steps.append(peak.sample(f"the end of step {step}"))
        per_name: dict[str, float] = {}
        for call in log.calls:
            per_name[call.name] = per_name.get(call.name, 0.0) + ring_elements_sent(call, world)
        sent.append(per_name)
        if step == scenario.resume_after:
            saved = optimizer.state_dict()
            fresh = scenario.model()
            fresh.load_state_dict(_state(model))
            model = fresh
            net, optimizer = _build(mod, stage, scenario, model)
            optimizer.load_state_dict(saved)
    evaluated = None
    if scenario.evaluate:
        with torch.no_grad():
            evaluated = net(_EVAL_INPUTS[part]).clone()
    state = net.full_state_dict() if stage == 3 else _state(model)
    return {"state": state, "between_steps": between_steps, "peak": peak.peak, "peak_where": peak.where, "sent": sent,
            "eval": evaluated, "gathered": gathered}


class SignSGD(torch.optim.Optimizer):
    """p -= lr * sign(grad): its update of an element depends on that element alone, but ZeroStage2 cannot know it
    (not a subclass of one of ZeroStage2.ELEMENTWISE), so it must refuse it."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


class NesterovSGD(torch.optim.SGD):
    """A subclass of torch.optim.SGD, one of ZeroStage2.ELEMENTWISE: accepted."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, lr=lr, momentum=0.9, nesterov=True)


def _refusals(mod, stage: int) -> list[str]:
    """Every error the docstrings promise, provoked on this rank (no collective is involved: construction and
    load_state_dict only). Returns what was not refused as documented."""
    problems = []

    def expect(error: type, what: str, call: Callable) -> object:
        try:
            made = call()
        except error:
            return None
        except NotImplementedError as exc:
            if str(exc).startswith("TODO"):
                raise
            problems.append(f"{what}: raised NotImplementedError: {exc}; expected {error.__name__}")
            return None
        except Exception as exc:  # noqa: BLE001 - reported
            problems.append(f"{what}: raised {type(exc).__name__}: {exc}; expected {error.__name__}")
            return None
        problems.append(f"{what}: accepted; expected {error.__name__}")
        return made

    if stage == 3:
        for dtype in (torch.int64, "bfloat16"):
            expect(ValueError, f"ZeroStage3(model, compute_dtype={dtype!r}), not a floating-point torch.dtype",
                   lambda dtype=dtype: mod.ZeroStage3(_mlp(), compute_dtype=dtype))
        root = nn.Linear(4, 5)  # parameters on the root module itself: no child to make a unit of
        expect(ValueError, "ZeroStage3 of a model with parameters on its root module", lambda: mod.ZeroStage3(root))
        frozen = _mlp().requires_grad_(False)
        expect(ValueError, "ZeroStage3 of a model without a trainable parameter", lambda: mod.ZeroStage3(frozen))
        expect(ValueError, "ZeroStage3(a model whose last unit has a frozen fp32 bias, compute_dtype=torch.bfloat16)",
               lambda: mod.ZeroStage3(_frozen_mlp(), compute_dtype=torch.bfloat16))
        mixed = _mlp()
        mixed[0].bias.data = mixed[0].bias.data.double()
        expect(ValueError, "ZeroStage3 of a model whose first unit has an fp32 weight and an fp64 bias",
               lambda: mod.ZeroStage3(mixed))
        for what, build in (("compute_dtype=torch.bfloat16", lambda: mod.ZeroStage3(_mlp(), compute_dtype=torch.bfloat16)),
                            ("compute_dtype=torch.float16", lambda: mod.ZeroStage3(_mlp(), compute_dtype=torch.float16)),
                            ("replicate_below=10**9 (every unit replicated)",
                             lambda: mod.ZeroStage3(_mlp(), replicate_below=10**9)),
                            ("compute_dtype=torch.bfloat16 with the frozen parameters in bf16 already",
                             lambda: mod.ZeroStage3(_frozen_mlp_in(torch.bfloat16), compute_dtype=torch.bfloat16))):
            try:
                build()
            except ValueError as exc:
                problems.append(f"ZeroStage3(model, {what}) refused ({exc}); the docstring allows it")
        return problems
    cls = getattr(mod, _CLASSES[stage])
    name = _CLASSES[stage]
    expect(TypeError, f"{name}(params, an optimizer instance instead of a class)",
           lambda: cls(_mlp().parameters(), torch.optim.SGD(_mlp().parameters(), lr=0.1)))
    expect(ValueError, f"{name} of parameters none of which requires a gradient",
           lambda: cls(_mlp().requires_grad_(False).parameters(), torch.optim.SGD, lr=0.1))
    if stage == 2:
        expect(ValueError, "ZeroStage2(params, SignSGD), an optimizer class that is not a subclass of one of "
                           "ZeroStage2.ELEMENTWISE", lambda: cls(_mlp().parameters(), SignSGD, lr=0.1))
        try:
            cls(_mlp().parameters(), NesterovSGD, lr=0.1)
        except ValueError as exc:
            problems.append(f"ZeroStage2(params, a subclass of torch.optim.SGD) refused ({exc}); a subclass of one of "
                            "ZeroStage2.ELEMENTWISE is element-wise too")
    model = _mlp()
    optimizer = cls(model.parameters(), torch.optim.Adam, lr=1e-3)
    expect(NotImplementedError, f"{name}.add_param_group after construction",
           lambda: optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(3))]}))
    saved = optimizer.state_dict()
    world, rank = dist.get_world_size(), dist.get_rank()
    for other_rank, other_world, what in (((rank + 1) % world, world, "another rank's share"),
                                          (rank, world + 1, "a share saved in a world of another size")):
        forged = dict(saved, rank=other_rank, world_size=other_world)
        expect(ValueError, f"{name}.load_state_dict of {what}",
               lambda forged=forged: cls(_mlp().parameters(), torch.optim.Adam, lr=1e-3).load_state_dict(forged))
    return problems


def _frozen_mlp_in(dtype: torch.dtype) -> nn.Module:
    """_frozen_mlp with its frozen parameters already in `dtype` (what a compute dtype asks of them)."""
    model = _frozen_mlp()
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(dtype)
    return model


# ---------------------------------------------------------------- stage 3 as CS336's FSDP tests ask (2 ranks)


class Norm(nn.Module):
    """RMSNorm computed in fp32 whatever comes in, returned in the input's dtype (as CS336's and LLaMA's are)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(width))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight).to(x.dtype)


class TinyLM(nn.Module):
    """Token ids (batch, 6) -> logits (batch, 6, 40), shaped like CS336's toy FSDP model: an embedding, two norms
    (32 and 48 elements: under the adapter's REPLICATE_BELOW, so they stay whole, replicated) and three Linear
    layers, each unit of at least 1280 elements (sharded)."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(4)
            self.embed, self.norm1 = nn.Embedding(_VOCAB, 32), Norm(32)
            self.up, self.norm2 = nn.Linear(32, 48), Norm(48)
            self.down, self.head = nn.Linear(48, 32), nn.Linear(32, _VOCAB)

    def forward(self, ids):
        x = self.norm1(self.embed(ids))
        x = self.norm2(F.relu(self.up(x)))
        return self.head(self.down(x))


_VOCAB, _PEER_BATCH, _PEER_STEPS, _PEER_LR = 40, 8, 3, 0.05
_PEER_REPLICATED = ("norm1.weight", "norm2.weight")
_PEER_DTYPES = {"peer_fp32": None, "peer_fp16": torch.float16, "peer_bf16": torch.bfloat16}
# Parameters after 3 steps vs one process with the same compute dtype (atol = rtol). fp32: bitwise. fp16: CS336's
# 1e-4. bf16 keeps 8 bits of mantissa where fp16 keeps 11: 8 x 1e-4. Reducing the gradients in the compute dtype
# then upcasting (FSDP2's default reduce_dtype) is accepted: measured 0.05 (fp16) and 0.10 (bf16) of these; a
# master copy kept in the compute dtype is not: 5.4x and 3.2x them (torch 2.14.1, this model and batch).
_PEER_TOLERANCE = {None: 0.0, torch.float16: 1e-4, torch.bfloat16: 8e-4}


def _peer_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step: (token ids (_PEER_BATCH, 6), next-token labels (_PEER_BATCH,)), the whole batch of both ranks."""
    gen = torch.Generator().manual_seed(7)
    return [(torch.randint(0, _VOCAB, (_PEER_BATCH, 6), generator=gen),
             torch.randint(0, _VOCAB, (_PEER_BATCH,), generator=gen)) for _ in range(_PEER_STEPS)]


def _peer_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """CS336's: cross-entropy of the last position's logits, in fp32."""
    return F.cross_entropy(logits[:, -1].float(), labels)


def _run_peer(mod, dtype: torch.dtype | None) -> dict:
    """CS336's FSDP test loop, through the adapter (tests/peer_adapters/cs336_fsdp.py) bound to the code under
    test: SGD over the wrapper's parameters, each rank on its half of each batch; what their asserts look at."""
    from peer_adapters import cs336_fsdp as adapter
    adapter.zero = mod
    rank, world = dist.get_rank(), dist.get_world_size()
    part = slice(rank * _PEER_BATCH // world, (rank + 1) * _PEER_BATCH // world)
    model = TinyLM()
    net = adapter.get_fsdp(model, compute_dtype=dtype)
    optimizer = torch.optim.SGD(net.parameters(), lr=_PEER_LR)
    states, grads, replicated, output = [], None, {}, None
    for ids, labels in _peer_batches():
        optimizer.zero_grad(set_to_none=True)
        logits = net(ids[part])
        output = str(logits.dtype)
        _peer_loss(logits, labels[part]).backward()
        adapter.fsdp_on_after_backward(net, optimizer)
        if grads is None:  # after the first backward: what the optimizer is about to step
            grads = [(name, tuple(p.shape), str(p.dtype), None if p.grad is None else (tuple(p.grad.shape),
                      str(p.grad.dtype))) for name, p in net.module.named_parameters() if p.requires_grad]
            registered = dict(net.module.named_parameters())
            replicated = {name: registered[name].grad.clone() if name in registered and
                          registered[name].grad is not None else None for name in _PEER_REPLICATED}
        optimizer.step()
        states.append(adapter.fsdp_gather_full_params(net))
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    return {"states": states, "grads": grads, "replicated": replicated, "output": output, "trainable": trainable}


@contextmanager
def _one_thread():
    """The ranks compute with one thread (common.launch); so does the reference, for the same float sums."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_peer_truths: dict = {}


def _peer_ground_truth(dtype: torch.dtype | None) -> list[dict]:
    """One process, per step: each rank's half of the batch forward and backward in turn, the sharded layers'
    parameters in `dtype` (inputs cast to it; the norms in fp32, inputs cast to fp32), the gradients upcast to fp32,
    summed and halved, then torch.optim.SGD on fp32 parameters. The full state after each step."""
    if dtype not in _peer_truths:
        with _one_thread():
            model = TinyLM()
            optimizer = torch.optim.SGD(model.parameters(), lr=_PEER_LR)
            states = []
            for ids, labels in _peer_batches():
                optimizer.zero_grad(set_to_none=True)
                for part in (slice(0, _PEER_BATCH // 2), slice(_PEER_BATCH // 2, _PEER_BATCH)):
                    low = copy.deepcopy(model)
                    for child in low.children():
                        own = dtype if dtype is not None and not isinstance(child, Norm) else torch.float32
                        child.to(own)
                        child.register_forward_pre_hook(
                            lambda module, args, own=own: tuple(a.to(own) if a.is_floating_point() else a for a in args))
                    _peer_loss(low(ids[part]), labels[part]).backward()
                    for p, q in zip(model.parameters(), low.parameters()):
                        p.grad = q.grad.float() if p.grad is None else p.grad + q.grad.float()
                for p in model.parameters():
                    p.grad.div_(2)
                optimizer.step()
                states.append(_state(model))
        _peer_truths[dtype] = states
    return _peer_truths[dtype]


# ---------------------------------------------------------------- stage 3 next to torch's fully_shard (2 ranks)


def _run_against_fully_shard(mod) -> dict:
    """The same model and batches, AdamW over each one's parameters: the learner's ZeroStage3, and torch's
    fully_shard (FSDP2) on each child with parameters, then the root. Bytes per kind after every step (DTensors
    counted by their local shards), and the full weights at the end."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    rank, world = dist.get_rank(), dist.get_world_size()
    part = slice(rank * _BATCH // world, (rank + 1) * _BATCH // world)
    ours = mod.ZeroStage3(_mlp())
    theirs = _mlp()
    mesh = init_device_mesh("cpu", (world,))
    for child in theirs.children():
        if any(p.requires_grad for p in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    runs = {"ours": (ours, torch.optim.AdamW(ours.parameters(), **_ADAM)),
            "fully_shard": (theirs, torch.optim.AdamW(theirs.parameters(), **_ADAM))}
    memory = {key: [] for key in runs}
    for (inputs, targets), in _batches(_SCENARIOS["adam"]):
        for key, (net, optimizer) in runs.items():
            optimizer.zero_grad()
            F.cross_entropy(net(inputs[part]), targets[part]).backward()
            optimizer.step()
            memory[key].append(training_memory(net, optimizer))
    return {"memory": memory, "ours": ours.full_state_dict(),
            "fully_shard": {name: p.full_tensor() for name, p in theirs.named_parameters()}}


def _zero_stage_rank(ref: grading.ModuleRef, stage: int) -> dict:
    """Every scenario, in turn, agreeing after each (tests/scenarios.py): if one rank raised
    while the others wait inside a collective it left, they never arrive, and this rank
    ends the world with its error (a clear failure now, not a deadlock later)."""
    mod = ref.load()
    names = _NAMES[stage] if dist.get_world_size() == _WORLD else _SMALL_NAMES[stage]
    special = {"refusals": partial(_refusals, mod, stage), "fully_shard": partial(_run_against_fully_shard, mod),
               "differential": partial(_run_differential, mod, stage), "modes": partial(_run_modes, mod),
               **{name: partial(_run_peer, mod, dtype) for name, dtype in _PEER_DTYPES.items()}}
    return run_scenarios({name: special.get(name, partial(_run_scenario, mod, stage, name)) for name in names},
                         _AGREE_S)


# ---------------------------------------------------------------- stages 1-2 against torch.optim, options drawn


_DRAWS = 12  # configurations per stage (+ _FIXED_CASES), in the one world of 2 ranks (about 1.5 s a rank, 2 s here)


@functools.lru_cache(maxsize=1)
def _differential_configs() -> list[dict]:
    """_FIXED_CASES, then _DRAWS configurations, the same list in every process (derandomized: Hypothesis's fixed
    seed)."""
    from hypothesis import HealthCheck, Phase, given, settings, strategies as st  # here: only this world needs it

    found = []
    @st.composite
    def _optimizer_cases(draw) -> dict:
        """A wrapped torch.optim optimizer with options drawn across what its docstring allows, alone and together:
        SGD with or without momentum (dampening, nesterov), weight decay with momentum 0, Adam/AdamW with weight decay,
        amsgrad, betas, maximize, a tensor lr; float32, float64 or bfloat16 parameters, fewer than the ranks or more,
        a frozen one, given as a generator, a list, a list naming one twice, or two param groups; a parameter without
        gradient in step 2; zero_grad(set_to_none=True/False/left out)."""
        name = draw(st.sampled_from(["SGD", "Adam", "AdamW"]))
        kwargs = {"lr": draw(st.sampled_from([0.1, 0.01]))}
        if name == "SGD":
            momentum = draw(st.sampled_from([0.0, 0.9]))
            if momentum or draw(st.booleans()):  # momentum 0 spelled out, or left to its default
                kwargs["momentum"] = momentum
            if momentum and draw(st.booleans()):
                kwargs["nesterov"] = True
            elif momentum:
                kwargs["dampening"] = draw(st.sampled_from([0.0, 0.5]))
            kwargs["weight_decay"] = draw(st.sampled_from([0.0, 0.01]))
        else:
            kwargs["weight_decay"] = draw(st.sampled_from([0.0, 0.1]))
            kwargs["amsgrad"] = draw(st.booleans())
            if draw(st.booleans()):
                kwargs["betas"] = (0.8, 0.99)
        if draw(st.booleans()):
            kwargs["maximize"] = True
        return {"optimizer": name, "kwargs": kwargs,
                "lr_tensor": name != "SGD" and draw(st.booleans()),
                "dtype": draw(st.sampled_from(["float32", "float64", "bfloat16"])),
                "shapes": draw(st.lists(st.sampled_from([(3,), (2, 3), (5,), (1,), (4, 2)]), min_size=1, max_size=4)),
                "frozen": draw(st.booleans()),
                "params": draw(st.sampled_from(["generator", "list", "list naming one twice", "groups"])),
                "unused_in_step_2": draw(st.booleans()),
                "set_to_none": draw(st.sampled_from([True, False, None])),  # None: zero_grad() with its default
                "seed": draw(st.integers(0, 2**16))}

    @settings(max_examples=_DRAWS, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(_optimizer_cases())
    def collect(case):
        found.append(case)
    collect()
    return [*_FIXED_CASES, *found[:_DRAWS]]


def _fixed(optimizer: str, kwargs: dict, **rest) -> dict:
    case = {"optimizer": optimizer, "kwargs": kwargs, "lr_tensor": False, "dtype": "float32", "shapes": [(3,), (2, 3)],
            "frozen": False, "params": "list", "unused_in_step_2": False, "set_to_none": True, "seed": 1}
    return {**case, **rest}


# combinations every run covers, whatever Hypothesis draws: dampening; weight decay with momentum 0 and maximize; a
# subclass of an element-wise optimizer (accepted by both stages)
_FIXED_CASES = [
    _fixed("SGD", dict(lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.01), set_to_none=False),
    _fixed("SGD", dict(lr=0.1, weight_decay=0.01, maximize=True), params="generator", unused_in_step_2=True),
    _fixed("SubclassedAdamW", dict(lr=0.01, weight_decay=0.1, amsgrad=True), dtype="float64", frozen=True),
]


class SubclassedAdamW(torch.optim.AdamW):
    """A user's subclass of torch.optim.AdamW (one of ZeroStage2.ELEMENTWISE): accepted, steps as AdamW."""


def _optimizer_class(name: str):
    return SubclassedAdamW if name == "SubclassedAdamW" else getattr(torch.optim, name)


def _differential_setup(case: dict):
    """(parameters, their per-step per-rank gradients, the params argument for the wrapper, the deduplicated one for
    torch.optim). Gradients are multiples of 1/4 in [-2, 2]: their mean over 2 ranks is exact in every dtype, so the
    wrapper and torch.optim step on the same numbers."""
    gen = torch.Generator().manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    params = [nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for shape in case["shapes"]]
    if case["frozen"]:
        params.append(nn.Parameter(torch.randn(3, generator=gen).to(dtype), requires_grad=False))
    grads = [[[torch.randint(-8, 9, p.shape, generator=gen).to(dtype) / 4 for _ in range(_SMALL_WORLD)]
              for p in params] for _ in range(3)]
    return params, grads


def _differential_params(case: dict, params: list, dedup: bool):
    kind = case["params"]
    if kind == "generator":
        return (p for p in params)
    if kind == "list naming one twice":
        return list(params) if dedup else [*params, params[0]]
    if kind == "groups":
        half = max(1, len(params) // 2)
        groups = [{"params": params[:half]}, {"params": params[half:], "lr": 0.05, "weight_decay": 0.02}]
        return [g for g in groups if g["params"]]
    return list(params)


def _differential_step(optimizer, case: dict, params: list, grads: list, step: int, average: bool, rank: int) -> None:
    if case["set_to_none"] is None:
        optimizer.zero_grad()
    else:
        optimizer.zero_grad(set_to_none=case["set_to_none"])
    terms = []
    for i, p in enumerate(params):
        if not p.requires_grad or (step == 1 and case["unused_in_step_2"] and i == 0):
            continue  # no gradient this step: torch.optim skips a .grad of None
        g = (grads[step][i][0] + grads[step][i][1]) / 2 if average else grads[step][i][rank]
        terms.append((p * g).sum())
    if terms:  # else no parameter has a gradient this step: step() must skip them all
        sum(terms).backward()
    optimizer.step()


def _differential_options(case: dict) -> dict:
    kwargs = dict(case["kwargs"])
    if case["lr_tensor"]:
        kwargs["lr"] = torch.tensor(kwargs["lr"])
    return kwargs


def _run_differential(mod, stage: int) -> dict:
    """In a rank: each drawn configuration, 3 steps of the stage's wrapper on this rank's gradients."""
    configs = _differential_configs()
    out = []
    for case in configs:
        params, grads = _differential_setup(case)
        cls = _optimizer_class(case["optimizer"])
        optimizer = getattr(mod, _CLASSES[stage])(_differential_params(case, params, dedup=False), cls,
                                                  **_differential_options(case))
        for step in range(3):
            _differential_step(optimizer, case, params, grads, step, average=False, rank=dist.get_rank())
        out.append([p.detach().double().clone() for p in params])
    return {"configs": configs, "params": out}


_differential_truths: dict = {}


def _differential_truth(index: int) -> list[torch.Tensor]:
    """One process: torch.optim over the same parameters, stepping on the mean of the ranks' gradients."""
    if index in _differential_truths:
        return _differential_truths[index]
    case = _differential_configs()[index]
    params, grads = _differential_setup(case)
    optimizer = _optimizer_class(case["optimizer"])(_differential_params(case, params, dedup=True),
                                                        **_differential_options(case))
    for step in range(3):
        _differential_step(optimizer, case, params, grads, step, average=True, rank=0)
    _differential_truths[index] = [p.detach().double() for p in params]
    return _differential_truths[index]


# ---------------------------------------------------------------- stage 3: modes, a keyword, spelled-out defaults


class KeywordNet(nn.Module):
    """Three units, the last a Linear(1, 1) of 2 elements (fewer than the 3 ranks: a shard of padding); forward takes
    a keyword argument."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 2), nn.Linear(1, 1)

    def forward(self, x, *, scale: float = 1.0):
        h = self.b(torch.tanh(self.a(x)))
        return self.c(h[:, :1]) * scale + h[:, 1:]


_MODES_STEPS = 2
_MODES_INPUTS = torch.randn(_BATCH, 4, generator=torch.Generator().manual_seed(21))
_MODES_TARGETS = torch.randn(_BATCH, 1, generator=torch.Generator().manual_seed(22))


def _modes_evaluate(net: nn.Module, inputs: torch.Tensor) -> dict:
    """What an evaluation reads: eval mode under torch.no_grad(), plain and under bf16 autocast; back to train mode."""
    net.eval()
    with torch.no_grad():
        plain = net(inputs, scale=0.5).float().clone()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = net(inputs, scale=0.5).float().clone()
    net.train()
    return {"plain": plain, "autocast": autocast}


def _modes_train(net: nn.Module, optimizer, inputs, targets, evaluate) -> list[dict]:
    """Per step: an evaluation first (its no-grad forwards leave nothing behind), then a training step whose forward
    passes a keyword argument."""
    evaluations = []
    for _ in range(_MODES_STEPS):
        evaluations.append(evaluate(net))
        optimizer.zero_grad()
        F.mse_loss(net(inputs, scale=2.0), targets).backward()
        optimizer.step()
    evaluations.append(evaluate(net))
    return evaluations


def _run_modes(mod) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    part = slice(rank * _BATCH // world, (rank + 1) * _BATCH // world)
    net = mod.ZeroStage3(KeywordNet(), compute_dtype=torch.float32, replicate_below=0)
    before = net.full_state_dict()  # before any forward or step
    optimizer = torch.optim.Adam(net.parameters(), **_ADAM)
    evaluations = _modes_train(net, optimizer, _MODES_INPUTS[part], _MODES_TARGETS[part],
                               lambda n: _modes_evaluate(n, _MODES_INPUTS[part]))
    return {"before": before, "after": net.full_state_dict(), "evaluations": evaluations}


# ---------------------------------------------------------------- in the parent

_worlds = {size: SharedWorld(_zero_stage_rank, size) for size in (_WORLD, _SMALL_WORLD)}


def _results(ref: grading.ModuleRef, stage: int, name: str, world: int = _WORLD) -> list[dict]:
    """Per rank, the results of one scenario of one stage; one world per stage and size, shared by its tests."""
    return _worlds[world].results(name, ref, stage, world=f"{_CLASSES[stage]}: the world of {world} ranks",
                                  what=f"{_CLASSES[stage]} on {world} ranks during "
                                       f"{_SCENARIOS[name].what if name in _SCENARIOS else _OTHER_WHAT[name]}")


_truths: dict = {}


def _ground_truths(name: str) -> list[dict]:
    """One process, the scenario's torch.optim class over model.parameters() (or its groups), the whole batch.

    A trainable parameter without gradient in a step is skipped, as torch.optim skips a .grad of None; where
    the scenario has one, the second truth gives it a zero gradient instead (the convention of a stage 3 that
    reduces whole units, and of DDP): either is accepted."""
    if name not in _truths:
        scenario = _SCENARIOS[name]
        _truths[name] = []
        for zeros in (False, True):
            model = scenario.model()
            optimizer = getattr(torch.optim, scenario.optimizer)(
                scenario.groups(model) if scenario.groups else model.parameters(), **scenario.kwargs)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, scenario.lr_decay) if scenario.lr_decay else None
            missing = False
            for step, micro_batches in enumerate(_batches(scenario)):
                if scenario.use_scale:
                    _set_use_scale(model, scenario, step)
                optimizer.zero_grad(set_to_none=scenario.set_to_none)
                for inputs, targets in micro_batches:
                    F.cross_entropy(model(inputs), targets).backward()
                for p in model.parameters():
                    if p.requires_grad and p.grad is None:
                        missing = True
                        if zeros:
                            p.grad = torch.zeros_like(p)
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
            if zeros and not missing:
                break
            _truths[name].append(_state(model))
    return _truths[name]


def _parameters_problems(results: list[dict], name: str, stage: int) -> list[str]:
    """Rank 0 against the closer ground truth, every other rank against rank 0 exactly."""
    cls = _CLASSES[stage]
    candidates = [state_dict_problems(results[0]["state"], truth, f"{cls}, rank 0:", rtol=1e-4, atol=1e-5)
                  for truth in _ground_truths(name)]
    problems = min(candidates, key=len)
    for rank, r in enumerate(results[1:], start=1):
        problems += state_dict_problems(r["state"], results[0]["state"], f"{cls}, rank {rank} vs rank 0:", 0, 0)
    return problems


def _frozen_problems(results: list[dict], name: str, stage: int) -> list[str]:
    """Every frozen parameter (requires_grad=False), on every rank, exactly as built."""
    model = _SCENARIOS[name].model()
    frozen = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}
    problems = []
    for rank, r in enumerate(results):
        for key, want in frozen.items():
            problem = diff_report(r["state"][key], want, f"{_CLASSES[stage]}, rank {rank}: frozen {key} (must never "
                                  "change: it has no gradient, so no optimizer step, no weight decay)", rtol=0, atol=0)
            if problem:
                problems.append(problem)
    return problems


def _header(name: str, stage: int, worlds: tuple = (_WORLD,)) -> str:
    scenario = _SCENARIOS[name]
    cls = f"torch.optim.{scenario.optimizer}"
    ranks, samples = (" and ".join(str(x) for x in values) for values in (worlds, [_BATCH // w for w in worlds]))
    return (f"{_CLASSES[stage]} on {ranks} ranks ({samples} samples each), {scenario.what}, must end with the "
            f"parameters of one process on all {_BATCH} samples with {cls}, on every rank:")


def _psi(name: str) -> tuple[int, int, int]:
    """(trainable parameters, trainable parameter tensors, the largest one's elements) of the scenario's model."""
    params = [p for p in _SCENARIOS[name].model().parameters() if p.requires_grad]
    return sum(p.numel() for p in params), len(params), max(p.numel() for p in params)


def _largest_unit(name: str) -> int:
    """Trainable elements of the scenario model's largest child (a unit of stage 3)."""
    return max(sum(p.numel() for p in child.parameters() if p.requires_grad)
               for child in _SCENARIOS[name].model().children())


def _memory_expected(stage: int, name: str) -> tuple[dict, dict, dict]:
    """(bytes between steps by kind, the same in units of Psi as text, tolerance by kind in bytes) for fp32 Adam.

    Kinds as common.measure.training_memory: the parameters of the model (stage 3: of the
    wrapper, the shards, plus any full parameter its modules hold), their .grad, and what
    the optimizer keeps besides (stage 2's slices, Adam state). The tolerances: padding, up to
    N-1 elements per parameter tensor in each of 4 arrays (params, grads, exp_avg,
    exp_avg_sq); Adam's `step` (a scalar per tensor it steps); and for stages 1 and 2
    shares balanced to within the largest parameter (whole parameters per rank, as torch's
    ZeroRedundancyOptimizer, hold up to Psi/N + the largest one).
    """
    psi, tensors, largest = _psi(name)
    n = _WORLD
    per_psi = {1: (4, 4, 8 / n), 2: (4, 0, 12 / n), 3: (4 / n, 4 / n, 8 / n)}[stage]
    freed = "0: each p.grad freed once reduced"
    text = {1: ("4 Psi", "4 Psi", "8 Psi/N (Adam's state of my share)"),
            2: ("4 Psi", freed, "12 Psi/N (grad shard + Adam)"),
            3: ("4 Psi/N: my shards, every unit's full parameters freed after use",
                "4 Psi/N: my shards' .grad, every full .grad freed once reduced",
                "8 Psi/N (Adam's state of my shards)")}[stage]
    kinds = ("params", "grads", "optimizer")
    padding = 16 * (n - 1) * tensors
    tol = {"params": padding, "grads": padding,
           "optimizer": padding + 8 * tensors + (12 * largest if stage in (1, 2) else 0)}
    return {k: round(f * psi) for k, f in zip(kinds, per_psi)}, dict(zip(kinds, text)), tol


_KIND_WORDS = {"params": "parameters (the model's; stage 3: shards and any gathered unit)",
               "grads": "gradients (their .grad)", "optimizer": "optimizer-held tensors (shards, optimizer state)"}


def _memory_problems(results: list[dict], name: str, stage: int) -> list[str]:
    expected, text, tol = _memory_expected(stage, name)
    problems = []
    for rank, r in enumerate(results):
        for step, got in enumerate(r["between_steps"], start=1):
            for kind, value in expected.items():
                if got[kind] > value + tol[kind]:
                    problems.append(f"{_CLASSES[stage]}, rank {rank}, after step {step}: holds {got[kind]} bytes of "
                                    f"{_KIND_WORDS[kind]}, expected {value} ({text[kind]}) + at most {tol[kind]} of "
                                    "padding and imbalance")
    return problems


# ---------------------------------------------------------------- the tests


def _check_trains_like_data_parallel_adam(grade, stage):
    """3 Adam steps on 3 ranks end where one process with torch.optim.Adam ends, on every rank; then a forward under
    torch.no_grad() (an evaluation) gives that process's output."""
    results = _results(grade("2.4"), stage, "adam")
    problems = _parameters_problems(results, "adam", stage)
    reference = _SCENARIOS["adam"].model()
    reference.load_state_dict(_ground_truths("adam")[0])
    with torch.no_grad():
        expected = reference(_EVAL_INPUTS)
    share = _BATCH // _WORLD
    for rank, r in enumerate(results):
        problem = diff_report(r["eval"], expected[rank * share:(rank + 1) * share], f"{_CLASSES[stage]}, rank {rank}: "
                              "model(inputs) under torch.no_grad() after the steps", rtol=1e-4, atol=1e-5)
        if problem:
            problems.append(problem)
    assert_no_problems(problems, _header("adam", stage) + " An evaluation forward under torch.no_grad() after the "
                                 "steps (no backward follows: nothing to hook) must give that process's outputs:")


def _check_gradient_is_averaged_over_ranks(grade, stage):
    """With a step proportional to the gradient (SGD with momentum): the gradient is the mean over ranks, not the
    sum."""
    name = "sgd"
    results = _results(grade("2.4"), stage, name)
    problems = _parameters_problems(results, name, stage)
    if problems:
        start, expected = _SCENARIOS[name].model().state_dict(), _ground_truths(name)[0]
        moved = sum((results[0]["state"][k] - start[k]).norm() ** 2 for k in start) ** 0.5
        should = sum((expected[k] - start[k]).norm() ** 2 for k in start) ** 0.5
        problems.insert(0, f"rank 0's parameters moved {moved / should:.2f}x as far as they should (the step is "
                           f"proportional to the gradient: ~{_WORLD}x means summed over the {_WORLD} ranks instead of "
                           "averaged)")
    assert_no_problems(problems, _header(name, stage))


def _check_gradients_accumulate_over_backward_passes(grade, stage):
    """Two backward passes then step() is one step on the sum of both passes' gradients; zero_grad() starts over."""
    name = "accumulate"
    results = _results(grade("2.4"), stage, name)
    assert_no_problems(_parameters_problems(results, name, stage),
                       _header(name, stage) + " (two backward passes add their gradients, as .grad does, until "
                                              "zero_grad(); the reference's loss is the sum of the two micro-batches' "
                                              "losses)")


def _check_parameter_without_gradient(grade, stage):
    """A parameter the forward skipped: no hang, skipped (or a zero gradient) alike on every rank, and everything
    freed after the step."""
    results = _results(grade("2.4"), stage, "unused")
    problems = _parameters_problems(results, "unused", stage) + _memory_problems(results, "unused", stage)
    assert_no_problems(problems, _header("unused", stage) + " (a parameter without gradient in a step is skipped, as "
                                                          "torch.optim skips a .grad of None, or counts as a zero "
                                                          "gradient: either, the same on every rank), and free what "
                                                          "it frees after every step:")


def _check_memory_between_steps(grade, stage):
    """Bytes held after every step, by kind, within padding (and, stages 1-2, imbalance) of the stage's formula."""
    results = _results(grade("2.4"), stage, "adam")
    psi, _, largest = _psi("adam")
    assert_no_problems(_memory_problems(results, "adam", stage),
                       f"bytes each rank holds after each step (common.measure.training_memory), Psi = {psi} fp32 "
                       f"parameters (the largest tensor {largest}), N = {_WORLD}, Adam:")


def _check_peak_memory(grade, stage):
    """Bytes held at every collective and at the end of every backward: the full gradient (stage 3: the full
    parameters) never exists at once."""
    results = _results(grade("2.4"), stage, "adam")
    expected, text, tol = _memory_expected(stage, "adam")
    psi, _, _ = _psi("adam")
    half = 4 * psi // 2  # the full gradient must never exist at once
    bounds = {kind: (value + tol[kind], f"{value} ({text[kind]}) + {tol[kind]} of padding and imbalance")
              for kind, value in expected.items()}
    if stage == 2:
        bounds["grads"] = (half, f"{half}, half the model's gradient: reduce-scatter gradients as soon as backward "
                                 "has produced them, and free them")
    if stage == 3:
        two_units = 2 * 4 * _largest_unit("adam")  # the running unit and, FSDP's prefetch, the next one
        for kind, what in (("params", "parameters: gather a unit just before it runs, free it right after "
                                      "(forward) or once its gradients are reduced (backward)"),
                           ("grads", "gradients: reduce-scatter a unit's gradients as soon as backward has "
                                     "produced them all, and free them")):
            value = expected[kind] + tol[kind] + two_units
            bounds[kind] = (value, f"{value}: my shards ({text[kind]}) + {tol[kind]} of padding + {two_units}, two "
                                   f"units' full {what}")
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
    psi, tensors, _ = _psi("adam")
    n = _WORLD
    factor, how = {
        1: (2 * (n - 1) / n + 1, "an all-reduce of the gradient (2(N-1)/N) and the parameters once more: a broadcast "
                                 "from each owner sends the whole tensor (1), an all-gather (N-1)/N"),
        2: (2 * (n - 1) / n, "a reduce-scatter of the gradient ((N-1)/N) and an all-gather of the parameters "
                             "((N-1)/N): DP's volume"),
        3: (3 * (n - 1) / n, "an all-gather in forward, one in backward, a reduce-scatter: 3 (N-1)/N")}[stage]
    bound = factor * psi + 3 * (n - 1) * tensors  # + padding
    problems = []
    for rank, r in enumerate(results):
        for step, per_name in enumerate(r["sent"], start=1):
            total = sum(per_name.values())
            if total > bound:
                calls = ", ".join(f"{k} {v / psi:.2f}" for k, v in sorted(per_name.items()))
                problems.append(f"{_CLASSES[stage]}, rank {rank}, step {step}: sends {total / psi:.2f} x Psi "
                                f"({calls}), at most {bound / psi:.2f}")
    hint = (" An all-reduce then a slice moves twice a reduce-scatter's bytes (2(N-1)/N vs (N-1)/N): use "
            "dist.reduce_scatter_single." if stage == 2 else "")
    assert_no_problems(problems, f"elements each rank sends per step (forward, backward, step), counted from the "
                                 f"collectives it calls with the ring model, in units of Psi = {psi}, N = {n}; "
                                 f"expected at most ~{factor:.2f}: {how}.{hint}")


def _check_param_groups_and_lr_scheduler(grade, stage):
    """Param groups keep their own lr and weight decay, and an LR scheduler's changes reach the step (3 and 2 ranks)."""
    problems = []
    for world in (_WORLD, _SMALL_WORLD):
        results = _results(grade("2.4"), stage, "groups", world)
        problems += [f"{world} ranks: {p}" for p in _parameters_problems(results, "groups", stage)]
    assert_no_problems(problems, _header("groups", stage, worlds=(_WORLD, _SMALL_WORLD)) +
                       " (each group's settings, as the wrapped optimizer's groups, and what the scheduler writes "
                       "into optimizer.param_groups before each step)")


def _check_tied_and_frozen_parameters(grade, stage):
    """A weight used by two layers is updated once, with the sum of both uses' gradients; a frozen parameter never
    changes and does not break the sharding (3 and 2 ranks; stage 3: frozen, and tied weights right or refused)."""
    problems = []
    if stage == 3:
        results = _results(grade("2.4"), stage, "frozen")
        problems += _parameters_problems(results, "frozen", stage) + _frozen_problems(results, "frozen", stage)
        tied = _results(grade("2.4"), stage, "tied_adam")
        refused = [r["refused"] for r in tied if "refused" in r]
        if refused and len(refused) != len(tied):
            problems.append(f"tied weights: {len(refused)} of {len(tied)} ranks refused the model; all or none must")
        elif not refused:
            problems += [f"tied weights: {p}" for p in _parameters_problems(tied, "tied_adam", stage)]
        assert_no_problems(problems, _header("frozen", stage) + " A weight tied between two units must either train "
                                     "right too or be refused at construction with a ValueError (FSDP asks for both "
                                     "users under one unit), never train wrong or crash later:")
        return
    for world in (_WORLD, _SMALL_WORLD):
        results = _results(grade("2.4"), stage, "tied_frozen", world)
        problems += [f"{world} ranks: {p}" for p in
                     _parameters_problems(results, "tied_frozen", stage) + _frozen_problems(results, "tied_frozen", stage)]
    assert_no_problems(problems, _header("tied_frozen", stage, worlds=(_WORLD, _SMALL_WORLD)) +
                       " (the tied weight stepped once, on the sum of its two uses' gradients; the frozen parameters "
                       "untouched, as torch.optim leaves a parameter without .grad)")


def _check_optimizer_needing_whole_parameters(grade, stage):
    """torch.optim.Adafactor (factored moments of each matrix, per-tensor clipping): stage 1 wraps any optimizer,
    so it must train as in one process; stage 2 may refuse it (a ValueError at construction) but not train wrong."""
    results = _results(grade("2.4"), stage, "adafactor")
    refused = [r["refused"] for r in results if "refused" in r]
    if refused and len(refused) == len(results):
        return
    problems = _parameters_problems(results, "adafactor", stage) if not refused else \
        [f"{len(refused)} of {len(results)} ranks refused Adafactor; all or none must"]
    how = ("Stage 1 hands the wrapped optimizer whole parameters, so any torch.optim class works" if stage == 1 else
           "An optimizer stepped on slices of parameters must be element-wise; refuse one that is not, at "
           "construction, with a ValueError")
    assert_no_problems(problems, _header("adafactor", stage) + f" {how}:")


def _check_state_dict_round_trip(grade, stage):
    """state_dict() after 2 steps, loaded into a fresh model and optimizer on the same ranks, continues the run."""
    results = _results(grade("2.4"), stage, "resume")
    assert_no_problems(_parameters_problems(results, "resume", stage),
                       _header("resume", stage) + " (each rank's state_dict() holds what its load_state_dict() needs "
                                                  "to continue: the optimizer state of its share, the step counts)")


def _check_documented_errors(grade, stage):
    """Every error the docstrings promise, on every rank: stage 1 and 2 (ShardedOptimizer): an optimizer instance
    instead of a class (TypeError), no trainable parameter (ValueError), add_param_group after construction
    (NotImplementedError), a state_dict of another rank or world size (ValueError); stage 2: an optimizer class
    that is not a subclass of one of ELEMENTWISE (ValueError; a subclass is accepted); stage 3 (ValueError): a
    compute_dtype that is not a floating-point torch.dtype, parameters on the root module, no trainable parameter,
    a frozen parameter of a sharded unit not in the compute dtype, a unit whose trainable parameters differ in
    dtype; bf16 and fp16 compute, every unit replicated, and frozen parameters already in the compute dtype are
    accepted."""
    results = _results(grade("2.4"), stage, "refusals")
    problems = [f"{_CLASSES[stage]}, rank {rank}: {problem}" for rank, r in enumerate(results) for problem in r]
    assert_no_problems(problems, f"{_CLASSES[stage]} must refuse, with the error its docstring names:")


# as common.measure.CollectiveLog records them: all_gather_single (torch 2.14.1's name) as all_gather_into_tensor
_GATHERS = ("all_gather_into_tensor", "all_gather")


def _gather_allowance(name: str, world: int = _WORLD) -> int:
    """Parameter elements that gathering every unit of the scenario's model once takes: each trainable
    parameter whole, plus the padding either layout adds (a flat buffer per unit: under N elements; dim-0
    shards as fully_shard cuts them: under N rows of each parameter)."""
    params = [p for p in _SCENARIOS[name].model().parameters() if p.requires_grad]
    return sum(p.numel() + (world - 1) * (p.numel() // p.shape[0]) for p in params)


def _gathered_once_problems(results: list[dict], name: str) -> list[str]:
    """Each unit all-gathered at most once per backward pass: the elements all-gathered during one
    backward, summed, within what gathering every unit once takes (a unit gathered twice is over it)."""
    allowance, psi = _gather_allowance(name), _psi(name)[0]
    units = sum(1 for child in _SCENARIOS[name].model().children() if any(p.requires_grad for p in child.parameters()))
    problems = []
    for rank, r in enumerate(results):
        for k, (step, got) in enumerate(r.get("gathered", []), start=1):
            if got > allowance:
                problems.append(f"_pre_backward gathers a unit that is whole already: ZeroStage3, rank {rank}, backward "
                                f"pass {k} (step {step}) all-gathered {got} parameter elements, {got / psi:.2f} x Psi, "
                                f"where gathering each of the {units} units once takes at most {allowance} (Psi = "
                                f"{psi} + padding). It runs once per output of the unit that requires grad (a tuple: "
                                "twice; two forwards: twice): gather only if the unit is not whole")
                break  # the first backward that gathers twice says it
    return problems


def _check_unit_returning_a_tuple(grade, stage):
    """A unit whose forward returns a tuple of two tensors (both used next): each output's gradient brings the unit
    back before its backward (once), and training matches one process."""
    results = _results(grade("2.4"), stage, "tuple")
    assert_no_problems(_parameters_problems(results, "tuple", stage) + _memory_problems(results, "tuple", stage)
                       + _gathered_once_problems(results, "tuple"),
                       _header("tuple", stage) + " (a unit's output may be a tuple or list of tensors: hook each one "
                                                 "that requires grad, and gather the unit once before its backward: "
                                                 "the all-gathers of each backward pass are counted)")


def _check_two_forwards_then_one_backward(grade, stage):
    """Every unit runs twice (two micro-batches forwarded) before one backward of the summed loss: each unit is
    gathered for each forward and for its backward, reduced once when all its gradients are in, and training
    matches one process."""
    results = _results(grade("2.4"), stage, "two_forwards")
    assert_no_problems(_parameters_problems(results, "two_forwards", stage) +
                       _memory_problems(results, "two_forwards", stage) +
                       _gathered_once_problems(results, "two_forwards"),
                       _header("two_forwards", stage) + " (a unit's parameters must stay usable until ALL its uses in "
                                                        "this backward pass are done: its gradients all accumulated; "
                                                        "and it is gathered once in that backward, not once per use)")


def _check_step_with_closure(grade, stage):
    """optimizer.step(closure), as torch.optim takes it: the closure (zero_grad, forward, backward) runs once, before
    the step, and step returns what it returned."""
    results = _results(grade("2.4"), stage, "closure")
    assert_no_problems(_parameters_problems(results, "closure", stage),
                       _header("closure", stage) + " (step(closure) runs the closure once, with autograd on, and steps "
                                                   "on the gradients it left)")


def _peer_header(dtype: torch.dtype | None) -> str:
    how = "bitwise" if dtype is None else f"within atol = rtol = {_PEER_TOLERANCE[dtype]:g}"
    return (f"ZeroStage3 on {_SMALL_WORLD} ranks ({_PEER_BATCH // _SMALL_WORLD} sequences each), {_PEER_STEPS} "
            f"torch.optim.SGD steps (lr {_PEER_LR}) of a small language model (CS336's FSDP test, through "
            f"tests/peer_adapters/cs336_fsdp.py), compute dtype {str(dtype).replace('torch.', '') if dtype else 'none'}, "
            f"must end {how} where one process ends: each rank's half of the batch forward and backward in turn"
            + ("" if dtype is None else f" with the Linear and Embedding weights in {str(dtype).replace('torch.', '')}"
               " (the norms, replicated, in fp32)")
            + ", the gradients summed in fp32 and halved, SGD on fp32 parameters; after every step, on every rank:")


def _peer_problems(grade, name: str) -> tuple[list[dict], list[str]]:
    """(the per-rank results of a peer scenario, the parameters after each step against the ground truth)."""
    dtype = _PEER_DTYPES[name]
    tol = _PEER_TOLERANCE[dtype]
    results = _results(grade("2.4"), 3, name, _SMALL_WORLD)
    problems = []
    for rank, r in enumerate(results):
        for step, (got, want) in enumerate(zip(r["states"], _peer_ground_truth(dtype)), start=1):
            found = state_dict_problems(got, want, f"rank {rank}, after step {step}:", rtol=tol, atol=tol)
            if found:
                problems += found
                break  # the first step that differs says the most
    return results, problems


def _check_two_ranks_match_one_process_bitwise(grade, stage):
    """3 SGD steps on 2 ranks, fp32, end bitwise where one process ends on the same halves of each batch (the
    gradient of each half, summed and halved): sharding changes no bit of the arithmetic (CS336's correctness test,
    fp32, with no tolerance)."""
    _, problems = _peer_problems(grade, "peer_fp32")
    assert_no_problems(problems, _peer_header(None))


def _check_compute_dtype_with_fp32_master_shards(grade, stage):
    """With compute_dtype fp16 or bf16: the units run in it (the logits come out in it), the parameters the
    optimizer steps stay fp32 (the master shards), and 3 SGD steps end within 1e-4 (fp16) / 8e-4 (bf16) of one
    process computing the same layers in that dtype and stepping fp32 weights (CS336's fp16 test)."""
    problems = []
    for name in ("peer_fp16", "peer_bf16"):
        dtype = _PEER_DTYPES[name]
        results, found = _peer_problems(grade, name)
        if found:
            problems.append(_peer_header(dtype))
            problems += found
        for rank, r in enumerate(results):
            if r["output"] != str(dtype):
                problems.append(f"compute dtype {dtype}, rank {rank}: the logits came out in {r['output']}: the units "
                                f"must gather their parameters in {dtype} and run in it (inputs cast to it)")
            low = [f"{n} ({d})" for n, _, d, _ in r["grads"] if d != "torch.float32"]
            if low:
                problems.append(f"compute dtype {dtype}, rank {rank}: the parameters the optimizer steps must stay "
                                f"fp32 (master shards; only the gathered copies are {dtype}); these are not: "
                                f"{', '.join(low)}")
    assert_no_problems(problems, "ZeroStage3 with a compute dtype, on 2 ranks, CS336's small language model:")


def _check_shard_gradients(grade, stage):
    """After backward, every parameter the optimizer is given (wrapper.module.named_parameters(), trainable) has a
    .grad shaped and typed like itself, fp32 even under a compute dtype; they are this rank's shards (about Psi/N
    elements, not the model); and a replicated parameter's gradient is the same on every rank (CS336's
    gradient-sync test), in fp32, fp16 and bf16."""
    params = dict(TinyLM().named_parameters())
    whole = sum(params[name].numel() for name in _PEER_REPLICATED)
    sharded = sum(p.numel() for p in params.values()) - whole
    rows = sum(p.numel() // p.shape[0] for name, p in params.items() if name not in _PEER_REPLICATED)
    most = whole + -(-sharded // _SMALL_WORLD) + rows  # + padding: under a row per parameter (dim-0 shards)
    problems = []
    for name, dtype in _PEER_DTYPES.items():
        results = _results(grade("2.4"), 3, name, _SMALL_WORLD)
        where = f"compute dtype {str(dtype).replace('torch.', '') if dtype else 'none'}"
        for rank, r in enumerate(results):
            for pname, shape, ptype, grad in r["grads"]:
                if grad is None:
                    problems.append(f"{where}, rank {rank}: {pname} {shape} has no .grad after backward (every "
                                    "parameter the optimizer steps needs its shard of the averaged gradient)")
                elif grad != (shape, ptype):
                    problems.append(f"{where}, rank {rank}: {pname} is {shape} {ptype}, its .grad {grad[0]} "
                                    f"{grad[1]}: the gradient must be shaped and typed like the parameter")
            if r["trainable"] > most:
                problems.append(f"{where}, rank {rank}: the trainable parameters the wrapper gives the optimizer hold "
                                f"{r['trainable']} elements; this rank's shards hold at most {most} ({whole} of the "
                                f"replicated norms + {-(-sharded // _SMALL_WORLD)} = {sharded}/{_SMALL_WORLD} + "
                                f"{rows} of padding): the optimizer must be given shards, not full parameters")
        for pname in _PEER_REPLICATED:
            got = [r["replicated"][pname] for r in results]
            if any(g is None for g in got):
                problems.append(f"{where}: {pname} ({params[pname].numel()} elements, under the adapter's "
                                f"replicate_below) must stay a whole, registered parameter with a .grad on every rank; "
                                f"got .grad None on ranks {[i for i, g in enumerate(got) if g is None]}")
                continue
            for rank, g in enumerate(got[1:], start=1):
                problem = diff_report(g, got[0], f"{where}: replicated {pname}.grad, rank {rank} vs rank 0 (each rank "
                                      "computed it on its own half: it must be averaged over the ranks)", 0, 0)
                if problem:
                    problems.append(problem)
    assert_no_problems(problems, "ZeroStage3 on 2 ranks, after the first backward of CS336's gradient-sync test "
                                 "(before the optimizer's step):")


def _fully_shard_bounds() -> dict[str, int]:
    """How far apart two correct layouts' bytes per rank may be, by kind: both hold Psi/N elements of each kind
    plus their padding. A flat buffer per unit pads each unit to a multiple of N elements; fully_shard pads each
    parameter on dim 0 to a multiple of N rows (a rank holds under one row more than Psi/N per parameter, and its
    Adam state follows its unpadded rows). So the difference is under one row per parameter per kind (x 2 for
    Adam's two moments), plus Adam's 4-byte `step`, which each optimizer keeps per tensor it steps (a flat shard
    per unit, or each parameter)."""
    params = [p for p in _mlp().parameters() if p.requires_grad]
    rows = 4 * sum(p.numel() // p.shape[0] for p in params)
    return {"params": rows, "grads": rows, "optimizer": 2 * rows + 4 * len(params)}


def _check_matches_fully_shard(grade, stage):
    """The learner's ZeroStage3 and torch's fully_shard (FSDP2: each child with parameters, then the root) train the
    same model with torch.optim.AdamW on 2 ranks: the same weights (within float reduction order: rtol 1e-5) and,
    after every step, the same bytes per rank of parameters, gradients and optimizer state, within the padding
    either layout adds (_fully_shard_bounds)."""
    results = _results(grade("2.4"), 3, "fully_shard", _SMALL_WORLD)
    bounds = _fully_shard_bounds()
    problems = []
    for rank, r in enumerate(results):
        problems += state_dict_problems(r["ours"], r["fully_shard"], f"rank {rank}, ZeroStage3 vs fully_shard:",
                                        rtol=1e-5, atol=1e-6)
        for step, (ours, theirs) in enumerate(zip(r["memory"]["ours"], r["memory"]["fully_shard"]), start=1):
            for kind, bound in bounds.items():
                if abs(ours[kind] - theirs[kind]) > bound:
                    problems.append(f"rank {rank}, after step {step}: {ours[kind]} bytes of {_KIND_WORDS[kind]}, "
                                    f"fully_shard {theirs[kind]}: {abs(ours[kind] - theirs[kind])} apart, more than "
                                    f"the {bound} the two layouts' padding allows")
    psi, tensors, _ = _psi("adam")
    assert_no_problems(problems, f"ZeroStage3 next to torch.distributed.fsdp.fully_shard, 3 AdamW steps (lr 1e-2, "
                                 f"weight decay 0.1) of the same 7-layer MLP (Psi = {psi} in {tensors} tensors) on "
                                 f"{_SMALL_WORLD} ranks, bytes by common.measure.training_memory (a DTensor counted "
                                 "by its local shard):")


def _check_matches_torch_optim_for_drawn_options(grade, stage):
    """Differential test against torch.optim (one world of 2 ranks, _DRAWS configurations drawn by Hypothesis,
    derandomized): SGD (momentum 0 or 0.9, dampening, nesterov, weight decay with or without momentum), Adam and
    AdamW (weight decay, amsgrad, betas, a tensor lr), maximize; float32/float64/bfloat16 parameters, fewer or more
    than the ranks, a frozen one, a generator, a list, a list naming one twice, two param groups; a parameter
    without gradient in step 2; zero_grad(set_to_none=True/False/default). After 3 steps every rank's parameters
    equal torch.optim's in one process stepping on the mean of the ranks' gradients."""
    results = _results(grade("2.4"), stage, "differential", _SMALL_WORLD)
    configs = _differential_configs()
    problems = []
    for rank, r in enumerate(results):
        if r["configs"] != configs:
            problems.append(f"rank {rank} drew other configurations than this process (Hypothesis not derandomized?)")
            continue
        for index, (case, got) in enumerate(zip(configs, r["params"])):
            expected = _differential_truth(index)
            tol = dict(rtol=2e-2, atol=2e-2) if case["dtype"] == "bfloat16" else \
                dict(rtol=1e-5, atol=1e-6) if case["dtype"] == "float32" else dict(rtol=1e-10, atol=1e-12)
            options = ", ".join(f"{k}={v}" for k, v in case["kwargs"].items())
            what = (f"{_CLASSES[stage]}(<{case['params']} of {len(case['shapes'])} {case['dtype']} parameters"
                    f"{' + a frozen one' if case['frozen'] else ''}>, torch.optim.{case['optimizer']}, {options}"
                    f"{', lr a tensor' if case['lr_tensor'] else ''}), zero_grad(set_to_none={case['set_to_none']}), "
                    f"{'parameter 0 without gradient in step 2, ' if case['unused_in_step_2'] else ''}rank {rank}")
            for i, (a, b) in enumerate(zip(got, expected)):
                problem = diff_report(a, b, f"{what}: parameter {i} after 3 steps", **tol)
                if problem:
                    problems.append(problem)
                    break
    assert_no_problems(problems, f"{_CLASSES[stage]} against torch.optim in one process on the mean gradient, "
                                 f"{_DRAWS} drawn configurations on {_SMALL_WORLD} ranks:")


def _check_modes_and_spelled_defaults(grade, stage):
    """ZeroStage3(model, compute_dtype=torch.float32, replicate_below=0), the defaults spelled out, on a model whose
    last unit (2 elements) is smaller than the world: full_state_dict() before any step is the model's weights; an
    evaluation (eval mode, torch.no_grad(), plain and under bf16 autocast) before and after every step gives the
    unwrapped model's outputs and leaves nothing behind: the training steps, whose forward passes a keyword
    argument, end where one process with torch.optim.Adam ends."""
    results = _results(grade("2.4"), stage, "modes")
    model = KeywordNet()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.Adam(model.parameters(), **_ADAM)
    expected = _modes_train(model, optimizer, _MODES_INPUTS, _MODES_TARGETS, lambda n: _modes_evaluate(n, _MODES_INPUTS))
    problems = []
    share = _BATCH // _WORLD
    for rank, r in enumerate(results):
        what = f"ZeroStage3(KeywordNet(), compute_dtype=torch.float32, replicate_below=0), rank {rank}"
        problems += state_dict_problems(r["before"], start, f"{what}: full_state_dict() before any step:", 0, 0)
        for i, (got, want) in enumerate(zip(r["evaluations"], expected)):
            when = "before step 1" if i == 0 else f"after step {i}"
            for kind, tol in (("plain", dict(rtol=1e-4, atol=1e-5)), ("autocast", dict(rtol=2e-2, atol=2e-2))):
                problem = diff_report(got[kind], want[kind][rank * share:(rank + 1) * share],
                                      f"{what}: eval-mode forward under torch.no_grad(){' and autocast' if kind == 'autocast' else ''} "
                                      f"{when}", **tol)
                if problem:
                    problems.append(problem)
        problems += state_dict_problems(r["after"], dict(model.named_parameters()),
                                        f"{what}: after {_MODES_STEPS} steps:", rtol=1e-4, atol=1e-5)
    assert_no_problems(problems, f"ZeroStage3 on {_WORLD} ranks: evaluations between training steps, a keyword "
                                 "argument, the defaults spelled out, a unit smaller than the world:")


def _one_test_per_stage(check, stages=tuple(_CLASSES)) -> None:
    """test_2_4_<what>_stage1..3 from `check(grade, stage)`: each stage is its own test (and world), so a
    negative control, or a learner's bug, in one stage fails only that stage's tests; each is marked with
    its part, `stage N`, so the exercise table shows the stages one by one (tests/grading.py)."""
    for stage in stages:
        def test(grade, stage=stage):
            check(grade, stage)
        test.__name__ = test.__qualname__ = f"test_2_4_{check.__name__.removeprefix('_check_')}_stage{stage}"
        test.__doc__ = f"{_CLASSES[stage]}: {check.__doc__}"
        globals()[test.__name__] = pytest.mark.part(f"stage {stage}")(test)


for _check in (_check_trains_like_data_parallel_adam, _check_gradient_is_averaged_over_ranks,
               _check_gradients_accumulate_over_backward_passes, _check_parameter_without_gradient,
               _check_memory_between_steps, _check_peak_memory, _check_communication_per_step,
               _check_tied_and_frozen_parameters):
    _one_test_per_stage(_check)
for _check in (_check_param_groups_and_lr_scheduler, _check_optimizer_needing_whole_parameters,
               _check_state_dict_round_trip):
    _one_test_per_stage(_check, stages=(1, 2))
_one_test_per_stage(_check_step_with_closure, stages=(1, 2))
_one_test_per_stage(_check_matches_torch_optim_for_drawn_options, stages=(1, 2))
_one_test_per_stage(_check_modes_and_spelled_defaults, stages=(3,))
_one_test_per_stage(_check_documented_errors)
for _check in (_check_unit_returning_a_tuple, _check_two_forwards_then_one_backward,
               _check_two_ranks_match_one_process_bitwise, _check_compute_dtype_with_fp32_master_shards,
               _check_shard_gradients, _check_matches_fully_shard):
    _one_test_per_stage(_check, stages=(3,))
