"""Graded tests of exercise 2.4, ZeRO-style sharding (phase2_advanced/guidelines.md, section 2.4).

Run them with `python tests/test_phase2.py -k 2_4` (your code) or
`pytest tests/test_phase2.py -k 2_4` (the reference); tests/test_phase2.py collects them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import grading
from compare import assert_no_problems, state_dict_problems
from common.launch import run_world


_ZERO_WORLD, _ZERO_STEPS, _ZERO_BATCH = 3, 3, 12
_ZERO_ADAM = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
_ZERO_CLASSES = {0: "DataParallelAdam", 1: "ZeroStage1", 2: "ZeroStage2", 3: "ZeroStage3"}


def _zero_model() -> nn.Module:
    """Three Linear layers of 176, 272 and 85 parameters (533 in all): padding needed for N = 2 and 3."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 5))


def _zero_batches():
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(_ZERO_BATCH, 10, generator=gen), torch.randint(0, 5, (_ZERO_BATCH,), generator=gen))
            for _ in range(_ZERO_STEPS)]


def _zero_rank(ref: grading.ModuleRef):
    mod = ref.load()
    rank, world = dist.get_rank(), dist.get_world_size()
    local = _ZERO_BATCH // world
    results = {}
    for stage, name in _ZERO_CLASSES.items():
        try:
            model = _zero_model()
            optimizer = getattr(mod, name)(model, **_ZERO_ADAM)
            held = []
            for inputs, targets in _zero_batches():
                part = slice(rank * local, (rank + 1) * local)
                F.cross_entropy(model(inputs[part]), targets[part]).backward()
                optimizer.step()
                held.append(optimizer.state_bytes())
            results[stage] = ("done", optimizer.full_state_dict(), held)
        except NotImplementedError as exc:  # every rank stops at the same TODO: safe to go on
            if not str(exc).startswith("TODO"):
                raise
            results[stage] = ("todo", str(exc), None)
    return results


_zero_worlds: dict = {}  # ModuleRef -> per-rank results


def _zero_results(ref: grading.ModuleRef, stage: int) -> list:
    """[(full_state_dict, [state_bytes after each step]) per rank] for one stage; one world for all tests."""
    if ref not in _zero_worlds:
        _zero_worlds[ref] = run_world(_zero_rank, _ZERO_WORLD, args=(ref,), timeout=90)
    per_rank = [r[stage] for r in _zero_worlds[ref]]
    if per_rank[0][0] == "todo":
        raise NotImplementedError(per_rank[0][1])
    return [(state, held) for _, state, held in per_rank]


def _zero_ground_truth() -> dict:
    model = _zero_model()
    optimizer = torch.optim.Adam(model.parameters(), **_ZERO_ADAM)
    for inputs, targets in _zero_batches():
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("stage", [0, 1, 2, 3], ids=[f"stage{s}" for s in range(4)])
def test_2_4_trains_like_data_parallel_adam(grade, stage):
    results = _zero_results(grade("2.4"), stage)
    expected = _zero_ground_truth()
    name = _ZERO_CLASSES[stage]
    problems = []
    for rank, (state, _) in enumerate(results):
        problems += state_dict_problems(state, expected, f"{name}, rank {rank}:", rtol=1e-4, atol=1e-5)
        if rank:
            problems += state_dict_problems(state, results[0][0], f"{name}, rank {rank} vs rank 0:", 0, 0)
    assert_no_problems(problems, f"{name} on {_ZERO_WORLD} ranks ({_ZERO_BATCH // _ZERO_WORLD} samples each), "
                                 f"{_ZERO_STEPS} Adam steps {_ZERO_ADAM}, must end with the parameters of one "
                                 f"process on all {_ZERO_BATCH} samples with torch.optim.Adam, on every rank:")


def _zero_expected_bytes(stage: int, world: int) -> tuple[dict, str]:
    """The formulas, computed here from the layer sizes: (bytes by kind, how they were computed)."""
    units = [176, 272, 85]
    psi = sum(units)
    shard = -(-psi // world)  # ceil: the flat vector is padded to world * shard
    s3 = sum(-(-u // world) for u in units)
    if stage == 0:
        return dict(params=4 * psi, grads=4 * psi, optimizer=8 * psi), f"16 Psi, Psi = {psi}"
    if stage == 1:
        return (dict(params=4 * shard * world, grads=4 * shard * world, optimizer=8 * shard),
                f"4P + 4P + 8P/N with the padded P = {shard * world}, N = {world}")
    if stage == 2:
        return (dict(params=4 * shard * world, grads=4 * shard, optimizer=8 * shard),
                f"4P + 12P/N with the padded P = {shard * world}, N = {world}")
    return (dict(params=4 * s3, grads=4 * s3, optimizer=8 * s3),
            f"16 S with S = sum over layers of ceil(Psi_layer / N) = {s3}, N = {world}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3], ids=[f"stage{s}" for s in range(4)])
def test_2_4_state_bytes_match_formula(grade, stage):
    results = _zero_results(grade("2.4"), stage)
    expected, how = _zero_expected_bytes(stage, _ZERO_WORLD)
    name = _ZERO_CLASSES[stage]
    problems = []
    for rank, (_, held) in enumerate(results):
        for step, got in enumerate(held, start=1):
            for kind, value in expected.items():
                if got.get(kind) != value:
                    problems.append(f"{name}, rank {rank}, after step {step}: holds {got.get(kind)} bytes of {kind}, "
                                    f"expected {value}")
    assert_no_problems(problems, f"bytes of parameters, gradients and Adam state each rank holds between steps "
                                 f"(measured by state_bytes), expected {how}:")
