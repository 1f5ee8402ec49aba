"""Graded tests of phase 1: data parallelism on one node.

    python tests/test_phase1.py            grade your code in phase1_data_parallel/
    pytest tests/test_phase1.py            check the reference solutions

A test named test_1_2_... grades exercise 1.2 (see phase1_data_parallel/guidelines.md).
Multi-rank checks run in a world of processes (common.launch.run_world); the ranks
return plain data and every assertion happens here, in the parent.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, TensorDataset

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # `python tests/test_phase1.py` works from anywhere
from compare import assert_close, assert_no_problems, diff_report, state_dict_problems  # noqa: E402

import grading  # noqa: E402
from common.data import load_digits  # noqa: E402
from common.launch import run_world  # noqa: E402
from common.models import build_model  # noqa: E402

# ---------------------------------------------------------------- 1.1 sampler

SAMPLER_CASES = [  # (dataset size, world size, shuffle, drop_last, seed, epoch)
    (10, 3, True, False, 0, 0), (10, 3, True, True, 0, 0), (12, 4, True, False, 7, 3),
    (2, 5, True, False, 1, 0), (17, 1, True, False, 0, 2), (9, 2, False, False, 0, 0),
    (9, 2, False, True, 0, 0), (101, 6, True, False, 42, 5), (101, 6, True, True, 42, 5),
]


def _shards(mod, n, world, shuffle, drop_last, seed, epoch):
    shards = []
    for rank in range(world):
        sampler = mod.ShardSampler(range(n), world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


def test_1_1_matches_torch_distributed_sampler(grade):
    mod = grade("1.1").load()
    for n, world, shuffle, drop_last, seed, epoch in SAMPLER_CASES:
        case = f"n={n}, world={world}, shuffle={shuffle}, drop_last={drop_last}, seed={seed}, epoch={epoch}"
        for rank, shard in enumerate(_shards(mod, n, world, shuffle, drop_last, seed, epoch)):
            expected = DistributedSampler(range(n), world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
            expected.set_epoch(epoch)
            assert shard == list(expected), f"{case}: rank {rank} yielded {shard}, torch's DistributedSampler yields {list(expected)}"


def test_1_1_shards_are_equal_disjoint_and_cover(grade):
    mod = grade("1.1").load()
    for n, world, shuffle, drop_last, seed, epoch in SAMPLER_CASES:
        case = f"n={n}, world={world}, drop_last={drop_last}"
        shards = _shards(mod, n, world, shuffle, drop_last, seed, epoch)
        lengths = [len(s) for s in shards]
        assert len(set(lengths)) == 1, f"{case}: shard lengths differ across ranks {lengths}: ranks would fall out of step"
        expected_len = n // world if drop_last else -(-n // world)
        assert lengths[0] == expected_len, f"{case}: each shard has {lengths[0]} indices, expected {expected_len}"
        sampler = mod.ShardSampler(range(n), world, 0, shuffle=shuffle, seed=seed, drop_last=drop_last)
        assert len(sampler) == expected_len, f"{case}: len(sampler) is {len(sampler)}, expected {expected_len}"
        flat = [i for s in shards for i in s]
        assert all(0 <= i < n for i in flat), f"{case}: index out of range in {shards}"
        if drop_last:
            assert len(set(flat)) == len(flat), f"{case}: shards overlap: {shards}"
        else:
            assert set(flat) == set(range(n)), f"{case}: indices {sorted(set(range(n)) - set(flat))} are in no shard"
            repeats = len(flat) - len(set(flat))
            assert repeats == world * expected_len - n, f"{case}: {repeats} repeated indices, only the padding may repeat: {shards}"


def test_1_1_same_order_on_every_rank_and_new_order_each_epoch(grade):
    mod = grade("1.1").load()
    n, world = 40, 4

    def global_order(epoch, seed=0):
        shards = _shards(mod, n, world, True, False, seed, epoch)
        return [shards[r][i] for i in range(len(shards[0])) for r in range(world)]

    e0, e1 = global_order(0), global_order(1)
    assert sorted(e0) == list(range(n)), "with n divisible by world, the interleaved shards must be a permutation of the dataset"
    assert e0 != list(range(n)), "shuffle=True must shuffle"
    assert e0 == global_order(0), "the same (seed, epoch) must give the same order (all ranks must agree)"
    assert e0 != e1, "set_epoch(1) must give a different order than epoch 0 (seed the permutation with seed + epoch)"
    assert global_order(0, seed=1) != e0, "a different seed must give a different order"


@pytest.mark.parametrize("dataset,world,rank", [(range(10), 2, 2), (range(10), 2, -1), (range(10), 0, 0), ([], 2, 0)])
def test_1_1_bad_arguments_fail_clearly(grade, dataset, world, rank):
    mod = grade("1.1").load()
    with pytest.raises(ValueError):
        mod.ShardSampler(dataset, world, rank)


def test_1_1_make_loader_gives_each_rank_its_shard(grade):
    mod = grade("1.1").load()
    n, world, batch = 23, 3, 4
    dataset = TensorDataset(torch.arange(n))
    seen, first_epoch = [], []
    for rank in range(world):
        loader = mod.make_loader(dataset, batch, rank, world, seed=5)
        assert hasattr(loader.sampler, "set_epoch"), "the loader's sampler must be this rank's ShardSampler (DataLoader(sampler=...))"
        batches = [b[0].tolist() for b in loader]
        assert all(len(b) <= batch for b in batches), f"rank {rank}: batch_size is per rank, got batches of {[len(b) for b in batches]}"
        first_epoch.append([i for b in batches for i in b])
        loader.sampler.set_epoch(1)
        seen.append([i for b in loader for i in b[0].tolist()])
    assert set(i for s in first_epoch for i in s) == set(range(n)), "the ranks' loaders together must cover the dataset"
    assert seen != first_epoch, "loader.sampler.set_epoch(1) must change the order"


# ------------------------------------------------------------ 1.2 all-reduce

ALLREDUCE_CASES = [  # (dtype, shape)
    (torch.float32, (1000,)), (torch.float32, (3, 5, 2)), (torch.float32, ()), (torch.float64, (17,)),
    (torch.int64, (4, 4)), (torch.int32, (9,)), (torch.float16, (33,)),
]


def _forbidden_all_reduce(*args, **kwargs):
    raise AssertionError("build the all-reduce from primitives (send/recv, broadcast, all_gather), not dist.all_reduce")


def _allreduce_rank(ref: grading.ModuleRef):
    mod = ref.load()
    rank, world = dist.get_rank(), dist.get_world_size()
    problems, outputs = [], {}
    for name, fn in mod.STRATEGIES.items():
        for dtype, shape in ALLREDUCE_CASES:
            for op in ("sum", "avg"):
                if op == "avg" and not dtype.is_floating_point:
                    continue
                gen = torch.Generator().manual_seed(1000 * rank + len(shape))
                x = (torch.randn(shape, generator=gen) * 10).to(dtype) if dtype.is_floating_point else \
                    torch.randint(-100, 100, shape, generator=gen).to(dtype)
                expected = x.clone()
                dist.all_reduce(expected)
                if op == "avg":
                    expected /= world
                actual = x.clone()
                real, dist.all_reduce = dist.all_reduce, _forbidden_all_reduce
                try:
                    returned = fn(actual, op=op)
                finally:
                    dist.all_reduce = real
                what = f"{name}(op={op!r}, {dtype}, shape {tuple(shape)}) on rank {rank} of {world}"
                if returned is not actual:
                    problems.append(f"{what}: must reduce the given tensor in place and return it")
                tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)
                problem = diff_report(actual, expected, what, **tol)
                if problem:
                    problems.append(problem)
                outputs[what.split(" on rank")[0]] = actual
    return problems, outputs


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6])
def test_1_2_strategies_equal_dist_all_reduce(grade, world_size):
    results = run_world(_allreduce_rank, world_size, args=(grade("1.2"),))
    problems = [p for rank_problems, _ in results for p in rank_problems]
    assert_no_problems(problems, f"all-reduce strategies differ from dist.all_reduce in a world of {world_size}:")
    for what, tensor in results[0][1].items():
        for rank in range(1, world_size):
            other = results[rank][1][what]
            assert torch.equal(other, tensor), (
                f"{what}: rank {rank} and rank 0 hold different results (max diff "
                f"{(other.double() - tensor.double()).abs().max().item():.3g}); every rank must end with "
                "bitwise the same tensor, or replicas drift apart (sum in the same order everywhere)")


# ---------------------------------------------------- 1.3 communication cost


def test_1_3_fit_alpha_beta_recovers_the_model(grade):
    mod = grade("1.3").load()
    sizes = [1024.0 * 4**k for k in range(8)]
    alpha, beta = mod.fit_alpha_beta(sizes, [50e-6 + 1e-9 * n for n in sizes])
    assert alpha == pytest.approx(50e-6, rel=1e-6) and beta == pytest.approx(1e-9, rel=1e-6), \
        f"exact data t = 50us + 1ns/byte * n gave alpha={alpha:.6g}, beta={beta:.6g}"
    gen = torch.Generator().manual_seed(0)
    noisy = [50e-6 + 1e-9 * n + 1e-6 * torch.randn((), generator=gen).item() for n in sizes]
    a = torch.tensor([[1.0, n] for n in sizes], dtype=torch.float64)
    best = torch.linalg.lstsq(a, torch.tensor(noisy, dtype=torch.float64).unsqueeze(1)).solution.squeeze(1)
    alpha, beta = mod.fit_alpha_beta(sizes, noisy)
    assert alpha == pytest.approx(best[0].item(), rel=1e-6) and beta == pytest.approx(best[1].item(), rel=1e-6), \
        f"noisy data: got alpha={alpha:.6g}, beta={beta:.6g}; least squares gives {best[0].item():.6g}, {best[1].item():.6g}"


def test_1_3_bandwidths_follow_nccl_tests(grade):
    mod = grade("1.3").load()
    algbw, busbw = mod.bandwidths(8e6, 2e-3, 4)
    assert algbw == pytest.approx(4e9), f"algbw = size / time = 4e9 B/s, got {algbw:.6g}"
    assert busbw == pytest.approx(6e9), f"busbw = algbw * 2(p-1)/p = 6e9 B/s for p=4, got {busbw:.6g}"
    assert mod.bandwidths(8e6, 2e-3, 1)[1] == 0, "a world of one rank moves no bytes: busbw must be 0"


class FakeClock:
    """A clock that only moves when the timed function runs: deterministic timings."""

    def __init__(self, step: float):
        self.now, self.step, self.calls = 0.0, step, 0

    def __call__(self) -> float:
        return self.now

    def work(self, tensor) -> None:
        self.calls += 1
        self.now += self.step


def _timing_rank(ref: grading.ModuleRef):
    mod = ref.load()
    clock = FakeClock(step=1e-3 * (dist.get_rank() + 1))  # rank r takes (r+1) ms per call
    seconds = mod.time_collective(clock.work, torch.zeros(4), iters=5, warmup=3, clock=clock)
    return seconds, clock.calls


def test_1_3_time_collective_reports_the_slowest_rank(grade):
    results = run_world(_timing_rank, 3, args=(grade("1.3"),))
    for rank, (seconds, calls) in enumerate(results):
        assert calls == 8, f"rank {rank}: fn ran {calls} times, expected warmup + iters = 3 + 5"
        assert seconds == pytest.approx(3e-3), (
            f"rank {rank} reported {seconds * 1e3:.4g} ms per call; the slowest rank takes 3 ms per timed "
            "call (warmup excluded), and every rank must report that maximum")


# ------------------------------------------------------------- 1.4 trainer


def _broadcast_rank(ref: grading.ModuleRef):
    mod = ref.load()
    rank = dist.get_rank()
    out = {}
    for src in (0, 2):
        model = build_model("cnn", (1, 8, 8), 10, seed=rank)
        for buf in model.buffers():
            buf.fill_(rank + 1)  # BatchNorm statistics differ across ranks too
        before = {k: v.clone() for k, v in model.state_dict().items()}
        mod.broadcast_parameters(model, src=src)
        out[src] = (before, {k: v.clone() for k, v in model.state_dict().items()})
    return out


def test_1_4_broadcast_parameters_and_buffers(grade):
    results = run_world(_broadcast_rank, 3, args=(grade("1.4"),))
    problems = []
    for src in (0, 2):
        expected = results[src][src][0]  # what rank `src` had before the broadcast
        for rank in range(3):
            problems += state_dict_problems(results[rank][src][1], expected,
                                            f"broadcast_parameters(src={src}) on rank {rank}:", 0, 0)
    assert_no_problems(problems, "after broadcast_parameters every rank must hold rank src's parameters and buffers")


GLOBAL_BATCH = 10


def _batch():
    gen = torch.Generator().manual_seed(3)
    return torch.randn(GLOBAL_BATCH, 1, 8, 8, generator=gen), torch.randint(0, 10, (GLOBAL_BATCH,), generator=gen)


def _sync_rank(ref: grading.ModuleRef, splits: list[int]):
    mod = ref.load()
    rank = dist.get_rank()
    inputs, targets = _batch()
    start = sum(splits[:rank])
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    loss = F.cross_entropy(model(inputs[start:start + splits[rank]]), targets[start:start + splits[rank]])
    loss.backward()
    mod.sync_gradients(model, splits[rank])
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("splits", [[4, 3, 3], [6, 3, 1]], ids=["nearly-even", "uneven"])
def test_1_4_sync_gradients_equals_full_batch_gradient(grade, splits):
    results = run_world(_sync_rank, 3, args=(grade("1.4"), splits))
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    inputs, targets = _batch()
    F.cross_entropy(model(inputs), targets).backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    problems = []
    for rank, grads in enumerate(results):
        problems += state_dict_problems(grads, expected, f"rank {rank} (local batch {splits[rank]}) gradient of")
    assert_no_problems(problems, f"with local batches {splits}, synced gradients must equal the gradient of the mean loss "
                                 "over all 10 samples (weight each rank by its sample count)")


STEPS, LR = 4, 0.1


def _steps_batches():
    gen = torch.Generator().manual_seed(11)
    return [(torch.randn(7, 1, 8, 8, generator=gen), torch.randint(0, 10, (7,), generator=gen)) for _ in range(STEPS)]


def _train_step_rank(ref: grading.ModuleRef):
    mod = ref.load()
    rank = dist.get_rank()
    model = build_model("mlp", (1, 8, 8), 10, seed=100 + rank)  # replicas start different on purpose
    mod.broadcast_parameters(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for inputs, targets in _steps_batches():
        part = slice(0, 4) if rank == 0 else slice(4, 7)  # uneven: 4 + 3 samples
        losses.append(mod.train_step(model, optimizer, inputs[part], targets[part]))
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def test_1_4_train_step_matches_single_process(grade):
    results = run_world(_train_step_rank, 2, args=(grade("1.4"),))
    model = build_model("mlp", (1, 8, 8), 10, seed=100)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    expected_losses = []
    for inputs, targets in _steps_batches():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        expected_losses.append(loss.item())
    problems = []
    for rank, (losses, params) in enumerate(results):
        problems += state_dict_problems(params, model.state_dict(), f"after {STEPS} steps, rank {rank}", rtol=1e-4, atol=1e-5)
        if losses != pytest.approx(expected_losses, rel=1e-4):
            problems.append(f"rank {rank}: train_step returned losses {losses}, expected the global mean losses {expected_losses}")
    assert_no_problems(problems, "2 ranks (4 + 3 samples per step) must take exactly the steps of one process on all 7 samples")


def _evaluate_rank(ref: grading.ModuleRef):
    mod = ref.load()
    rank, world = dist.get_rank(), dist.get_world_size()
    test = load_digits("test")
    model = build_model("mlp", (1, 8, 8), 10, seed=0)  # untrained: its accuracy differs shard to shard
    shard = torch.utils.data.Subset(test, range(rank, len(test), world))
    loader = torch.utils.data.DataLoader(shard, batch_size=16)
    return mod.evaluate(model, loader, torch.device("cpu"))


def test_1_4_evaluate_counts_every_rank(grade):
    world = 3
    results = run_world(_evaluate_rank, world, args=(grade("1.4"),))
    test = load_digits("test")
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    with torch.no_grad():
        x, y = test.tensors
        expected = (model(x).argmax(1) == y).double().mean().item()
    for rank, accuracy in enumerate(results):
        assert accuracy == pytest.approx(expected, abs=1e-9), (
            f"rank {rank} reported accuracy {accuracy:.4f}; over all {len(test)} test samples "
            f"(split across {world} ranks) it is {expected:.4f}: sum correct and total counts over ranks")


def _end_to_end_rank(ref: grading.ModuleRef):
    mod = ref.load()
    summary = mod.train(mod.TrainConfig(epochs=3, progress=False))
    return summary["test_accuracy"], summary["state_dict"]


def test_1_4_trains_digits_end_to_end(grade):
    results = run_world(_end_to_end_rank, 2, args=(grade("1.4"),), timeout=120)
    (acc0, state0), (acc1, state1) = results
    assert acc0 == acc1, f"ranks disagree on test accuracy: {acc0} vs {acc1}"
    assert acc0 >= 0.85, f"3 epochs on the digits should reach >= 85% test accuracy, got {acc0:.2%}"
    assert_no_problems(state_dict_problems(state1, state0, "final weights of rank 1 vs rank 0:", 0, 0),
                       "replicas drifted apart during training")


if __name__ == "__main__":
    sys.exit(grading.learner_main(__file__))
