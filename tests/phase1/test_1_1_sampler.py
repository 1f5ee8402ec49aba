"""Graded tests of exercise 1.1, sharding sampler (phase1_data_parallel/guidelines.md, section 1.1).

Run them with `python tests/test_phase1.py -k 1_1` (your code) or
`pytest tests/test_phase1.py -k 1_1` (the reference); tests/test_phase1.py collects them.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils.data import Dataset, DistributedSampler, TensorDataset

import grading

# Property tests draw their cases from a fixed seed: a grading run is reproducible.
PROPERTY_SETTINGS = dict(derandomize=True, database=None, deadline=None)


SAMPLER_CASES = [  # (dataset size, world size, shuffle, drop_last, seed, epoch)
    (10, 3, True, False, 0, 0), (10, 3, True, True, 0, 0), (12, 4, True, False, 7, 3),
    (2, 5, True, False, 1, 0), (17, 1, True, False, 0, 2), (9, 2, False, False, 0, 0),
    (9, 2, False, True, 0, 0), (101, 6, True, False, 42, 5), (101, 6, True, True, 42, 5),
    (10, 3, True, False, 2**40 + 7, 1),  # a seed past 32 bits: torch.Generator takes 64
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


class _Items(Dataset):
    """A map-style Dataset that is not a range: the sampler needs only its len()."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([i])


@st.composite
def _sampler_cases(draw):
    n = draw(st.integers(1, 60))
    world = draw(st.integers(1, 9))
    return dict(n=n, world=world, shuffle=draw(st.booleans()), drop_last=draw(st.booleans()),
                seed=draw(st.one_of(st.integers(0, 3), st.integers(0, 2**32))),
                epochs=draw(st.lists(st.integers(0, 1000), min_size=0, max_size=3)),
                dataset=draw(st.sampled_from(["range", "list", "Dataset"])),
                # arguments left out, for their defaults (shuffle=True, seed=0, drop_last=False)
                omitted=draw(st.sets(st.sampled_from(["shuffle", "seed", "drop_last"]))))


def test_1_1_any_arguments_give_torch_shards_stable_across_calls(grade):
    """For any dataset size, world size, shuffle, drop_last, seed and epochs (set_epoch called
    0 to 3 times, in any order): every rank's indices are DistributedSampler's; len(sampler)
    is their number; iterating again gives the same indices (only set_epoch changes them);
    and the shards are equal, disjoint (but for the padding) and cover the dataset."""
    mod = grade("1.1").load()

    @settings(max_examples=250, **PROPERTY_SETTINGS)
    @given(_sampler_cases())
    def check(case):
        n, world = case["n"], case["world"]
        given = {k: case[k] for k in ("shuffle", "seed", "drop_last") if k not in case["omitted"]}
        shuffle, seed, drop_last = given.get("shuffle", True), given.get("seed", 0), given.get("drop_last", False)
        dataset = {"range": range(n), "list": [f"item {i}" for i in range(n)], "Dataset": _Items(n)}[case["dataset"]]
        what = (f"ShardSampler(<{case['dataset']} of {n}>, num_replicas={world}, rank=r"
                + "".join(f", {k}={v}" for k, v in given.items()) + ")")
        samplers = [mod.ShardSampler(dataset, world, rank, **given) for rank in range(world)]
        for epoch in [None, *case["epochs"]]:  # None: before any set_epoch, i.e. epoch 0
            when = f"epoch {0 if epoch is None else epoch}{' (set_epoch never called)' if epoch is None else ''}"
            shards = []
            for rank, sampler in enumerate(samplers):
                if epoch is not None:
                    sampler.set_epoch(epoch)
                expected = DistributedSampler(range(n), world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
                expected.set_epoch(0 if epoch is None else epoch)
                expected = list(expected)
                shard = list(sampler)
                assert shard == expected, f"{what}, {when}: rank {rank} yielded {shard}, DistributedSampler yields {expected}"
                again = list(sampler)
                assert again == shard, (f"{what}, {when}: rank {rank} yielded {shard}, then {again} when iterated again "
                                        "without set_epoch; the order depends only on (seed, epoch)")
                assert len(sampler) == len(shard), f"{what}, {when}: rank {rank}: len(sampler) = {len(sampler)}, " \
                                                   f"but it yielded {len(shard)} indices"
                shards.append(shard)
            flat = [i for shard in shards for i in shard]
            if drop_last:
                assert len(set(flat)) == len(flat) and len(flat) == n - n % world, \
                    f"{what}, {when}: the shards {shards} must be disjoint and leave out only n mod p = {n % world} indices"
            else:
                assert set(flat) == set(range(n)) and len(flat) - n < world, \
                    f"{what}, {when}: the shards {shards} must cover range({n}), repeating fewer than p = {world} indices"

    grading.stop_hypothesis_at_todo(check)()  # a TODO is reported at once, not shrunk


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


@pytest.mark.parametrize("dataset,world,rank,names", [
    (range(10), 2, 2, "rank"), (range(10), 2, -1, "rank"), (range(10), 3, 7, "rank"), (range(10), 0, 0, "world|replica"),
    (range(10), -2, 0, "world|replica"), (range(10), 2.0, 0, "world|replica"), (range(10), 2.5, 0, "world|replica"),
    (range(10), "2", 0, "world|replica"), (range(10), None, 0, "world|replica"), ([], 2, 0, "empty|dataset"),
    ([], 1, 0, "empty|dataset")])
def test_1_1_bad_arguments_fail_clearly(grade, dataset, world, rank, names):
    """A clear message names what is wrong: a world size of 0 is a bad world size (whatever
    it does to the rank's range), and 2.0, 2.5, "2" and None are not integer world sizes
    (a ValueError, not the TypeError a comparison with a string or None would raise)."""
    mod = grade("1.1").load()
    call = f"ShardSampler({list(dataset)!r}, num_replicas={world!r}, rank={rank!r})"
    try:
        mod.ShardSampler(dataset, world, rank)
    except ValueError as exc:
        message = str(exc)
    except NotImplementedError:
        raise  # a TODO stays a TODO
    except Exception as exc:  # noqa: BLE001 - e.g. the TypeError of comparing "2" with 1
        pytest.fail(f"{call} raised {type(exc).__name__}: {exc}; a bad argument must raise ValueError, with a "
                    f"message that names it ({names})")
    else:
        pytest.fail(f"{call} raised nothing; expected ValueError naming the bad argument ({names})")
    assert re.search(names, message, re.I), \
        f"{call}: the message should name the bad argument ({names}); got {message!r}"


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


# (world size, batch size): batches that cut the shard with a partial last one, of one sample, larger than the
# shard; one rank
LOADER_SHAPES = [(3, 4), (3, 1), (3, 30), (1, 4)]
DEFAULT = object()  # the argument left out (its default: shuffle=True, seed=0, drop_last=False)


def test_1_1_make_loader_honours_shuffle_seed_and_drop_last(grade):
    mod = grade("1.1").load()
    n = 23
    dataset = TensorDataset(torch.arange(n))
    for world, batch in LOADER_SHAPES:
        for shuffle, drop_last, seed in [(s, d, e) for s in (True, False) for d in (False, True) for e in (0, 5)] + [
                (DEFAULT, DEFAULT, DEFAULT), (True, DEFAULT, 3), (DEFAULT, True, DEFAULT)]:
            given = {k: v for k, v in (("shuffle", shuffle), ("seed", seed), ("drop_last", drop_last)) if v is not DEFAULT}
            shuffle, seed, drop_last = given.get("shuffle", True), given.get("seed", 0), given.get("drop_last", False)
            case = f"make_loader(n={n}, batch_size={batch}, world={world}, {', '.join(f'{k}={v}' for k, v in given.items()) or 'defaults'})"
            for rank in range(world):
                loader = mod.make_loader(dataset, batch, rank, world, **given)
                loader.sampler.set_epoch(2)
                got = [b[0].tolist() for b in loader]
                order = DistributedSampler(range(n), world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
                order.set_epoch(2)
                order = list(order)
                expected = [order[i:i + batch] for i in range(0, len(order), batch)]
                assert got == expected, (
                    f"{case}, epoch 2, rank {rank}: batches {got}, expected {expected} (the shard of "
                    "ShardSampler with these shuffle, seed and drop_last, cut into batches; the last "
                    "partial batch is kept)")


def test_1_1_sampler_leaves_the_global_rng_alone(grade):
    mod = grade("1.1").load()
    shards = []
    for global_seed in (1234, 99):
        torch.manual_seed(global_seed)
        state = torch.get_rng_state()
        sampler = mod.ShardSampler(range(50), 2, 1, shuffle=True, seed=3)
        sampler.set_epoch(4)
        shards.append(list(sampler))
        assert torch.equal(torch.get_rng_state(), state), (
            "building and iterating the sampler changed the global RNG (torch.manual_seed / torch.randperm "
            "without a generator): shuffling must use its own torch.Generator, or it silently changes "
            "dropout, augmentation and initialisation elsewhere")
    assert shards[0] == shards[1], "the sampler's order changed with the global seed: it must depend only on (seed, epoch)"
