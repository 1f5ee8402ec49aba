"""Graded tests of exercise 2.5, naive model split (phase2_advanced/guidelines.md, section 2.5).

Run them with `python tests/test_phase2.py -k 2_5` (your code) or
`pytest tests/test_phase2.py -k 2_5` (the reference); tests/test_phase2.py collects them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import grading
from compare import assert_no_problems, diff_report
from common.launch import run_world
from common.models import MLP
from common.distributed import current_device


def _pp_layers(hidden: tuple[int, ...]) -> nn.Sequential:
    """The same MLP in every process: Flatten, [Linear, ReLU] per hidden width, Linear (1 + 2h + 1 layers)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MLP(64, 10, hidden=hidden).net


def _pp_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 1, 8, 8, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def _pp_expected(hidden: tuple[int, ...], batch: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Ground truth: the unsplit model, one process, the whole batch, mean cross-entropy."""
    layers = _pp_layers(hidden)
    x, y = _pp_batch(batch)
    loss = F.cross_entropy(layers(x), y)
    loss.backward()
    return loss.item(), {f"layer {i} {n}": p.grad for i, layer in enumerate(layers) for n, p in layer.named_parameters()}


def _pp_stage_grads(stage) -> dict[str, torch.Tensor | None]:
    """This stage's gradients, named by the layer's index in the unsplit model."""
    return {f"layer {i} {n}": None if p.grad is None else p.grad.detach().cpu().clone()
            for j, i in enumerate(stage.layer_range) for n, p in stage.layers[j].named_parameters()}


def _pp_problems(results: list[dict], expected_loss: float, expected_grads: dict, num_layers: int, what: str) -> list[str]:
    """Compare every rank's part with the unsplit model: layers held once, loss on the last rank, each gradient."""
    world, problems = len(results), []
    holders = {i: [r for r, res in enumerate(results) if i in res["layers"]] for i in range(num_layers)}
    for i, ranks in holders.items():
        if len(ranks) != 1:
            problems.append(f"{what}: layer {i} of {num_layers} is held by ranks {ranks}, expected exactly one "
                            f"(stages hold {[res['layers'] for res in results]})")
    for rank, res in enumerate(results):
        if rank < world - 1 and res["loss"] is not None:
            problems.append(f"{what}: rank {rank} returned a loss; only the last stage (rank {world - 1}) computes it")
    last = results[-1]["loss"]
    if last is None:
        problems.append(f"{what}: the last stage (rank {world - 1}) returned no loss")
    elif abs(last - expected_loss) > 1e-5 * max(1.0, abs(expected_loss)):
        problems.append(f"{what}: loss {last:.6g} on rank {world - 1}, the unsplit model gives {expected_loss:.6g}")
    for rank, res in enumerate(results):
        for key, grad in res["grads"].items():
            if grad is None:
                problems.append(f"{what}: rank {rank} has no gradient for {key}: did the gradient of its output come "
                                f"back from rank {rank + 1}, and did the receiving rank set requires_grad on its input?")
            elif key in expected_grads:
                problem = diff_report(grad, expected_grads[key], f"{what}: rank {rank} {key} gradient", rtol=1e-4, atol=1e-6)
                if problem:
                    problems.append(problem)
    return problems


PARTITION_CASES = [(8, 3), (8, 2), (8, 8), (10, 4), (7, 3), (1, 1), (5, 1), (9, 4), (100, 7), (13, 5)]


def test_2_5_partition_is_contiguous_balanced_and_complete(grade):
    mod = grade("2.5").load()
    for num_layers, num_stages in PARTITION_CASES:
        case = f"partition({num_layers}, {num_stages})"
        parts = mod.partition(num_layers, num_stages)
        assert len(parts) == num_stages, f"{case} returned {len(parts)} ranges, expected one per stage: {parts}"
        flat = [i for part in parts for i in part]
        assert flat == list(range(num_layers)), (
            f"{case} = {[list(p) for p in parts]}: concatenated, the stages must hold layers 0..{num_layers - 1} "
            "once each and in order (a layer skipped or duplicated at a cut?)")
        sizes = [len(part) for part in parts]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1, (
            f"{case} has stage sizes {sizes}: every stage needs a layer, and sizes may differ by at most one")


@pytest.mark.parametrize("num_layers,num_stages", [(2, 3), (0, 1), (5, 0), (5, -1)])
def test_2_5_partition_rejects_impossible_splits(grade, num_layers, num_stages):
    mod = grade("2.5").load()
    with pytest.raises(ValueError):
        mod.partition(num_layers, num_stages)


SPLIT_HIDDEN, SPLIT_BATCH = (32, 32, 16), 12  # 8 layers; the cuts carry (B, 32) and (B, 16) activations


def _split_rank(ref: grading.ModuleRef, hidden: tuple[int, ...], batch: int) -> dict:
    """In one world of 3 ranks: the model split over 3 stages, then over 2 (rank 2 sits that one out)."""
    mod = ref.load()
    dist.barrier()  # NCCL: the group's first collective must involve every rank (see Mailbox)
    rank, results = dist.get_rank(), {}
    x, y = _pp_batch(batch)
    for num_stages in (3, 2):
        if rank >= num_stages:
            continue
        stage = mod.PipelineStage(_pp_layers(hidden), rank, num_stages, device=current_device())
        first, last = rank == 0, rank == num_stages - 1
        loss = mod.forward_backward(stage, x if first else None, y if last else None, F.cross_entropy)
        results[num_stages] = {"layers": list(stage.layer_range), "loss": None if loss is None else float(loss),
                               "grads": _pp_stage_grads(stage)}
    return results


_split_worlds: dict = {}  # ModuleRef -> results or exception: one world serves every split test


def _pp_shared_world(cache: dict, ref: grading.ModuleRef, worker, world_size: int, args: tuple):
    if ref not in cache:
        try:
            cache[ref] = run_world(worker, world_size, args=(ref, *args))
        except Exception as exc:  # noqa: BLE001 - re-raised by every test that shares the world
            cache[ref] = exc
    if isinstance(cache[ref], Exception):
        raise cache[ref]
    return cache[ref]


@pytest.mark.parametrize("num_stages", [2, 3])
def test_2_5_split_model_matches_one_process(grade, num_stages):
    results = _pp_shared_world(_split_worlds, grade("2.5"), _split_rank, 3, (SPLIT_HIDDEN, SPLIT_BATCH))
    loss, grads = _pp_expected(SPLIT_HIDDEN, SPLIT_BATCH)
    per_rank = [results[rank][num_stages] for rank in range(num_stages)]
    problems = _pp_problems(per_rank, loss, grads, 2 * len(SPLIT_HIDDEN) + 2, f"{num_stages} stages")
    assert_no_problems(problems, f"the model split over {num_stages} ranks differs from the unsplit model in one process:")
