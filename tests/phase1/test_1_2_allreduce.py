"""Graded tests of exercise 1.2, all-reduce strategies from primitives (phase1_data_parallel/guidelines.md, section 1.2).

Run them with `python tests/test_phase1.py -k 1_2` (your code) or
`pytest tests/test_phase1.py -k 1_2` (the reference); tests/test_phase1.py collects them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import grading
from compare import assert_no_problems, diff_report
from common.launch import run_world
from common.measure import CollectiveLog


ALLREDUCE_CASES = [  # (dtype, shape)
    (torch.float32, (1000,)), (torch.float32, (3, 5, 2)), (torch.float32, ()), (torch.float64, (17,)),
    (torch.int64, (4, 4)), (torch.int32, (9,)), (torch.float16, (33,)),
]


# torch's collectives that reduce: a strategy built on one of them builds nothing.
FORBIDDEN = [name for name in ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                               "reduce_scatter_single", "_reduce_scatter_base") if hasattr(dist, name)]


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
                with CollectiveLog(names=FORBIDDEN, also_in=(mod,)) as forbidden:  # records, forwards unchanged
                    returned = fn(actual, op=op)
                what = f"{name}(op={op!r}, {dtype}, shape {tuple(shape)}) on rank {rank} of {world}"
                if forbidden.calls:
                    problems.append(f"{what}: called torch.distributed.{', '.join(sorted(set(forbidden.names())))}; build "
                                    "the all-reduce from send/recv, broadcast and all_gather, not from a reducing collective")
                if returned is not actual:
                    problems.append(f"{what}: must reduce the given tensor in place and return it")
                tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)
                problem = diff_report(actual, expected, what, **tol)
                if problem:
                    problems.append(problem)
                outputs[what.split(" on rank")[0]] = actual
        # A view into a larger buffer (a gradient bucket, a flat parameter): the sum must land in the buffer,
        # and nothing of the buffer outside the view may change.
        gen = torch.Generator().manual_seed(77 + rank)
        bucket = torch.randn(40, generator=gen)
        untouched = bucket.clone()
        view = bucket[5:22]
        expected = view.clone()
        dist.all_reduce(expected)
        returned = fn(view)
        what = f"{name}(a view of elements 5..21 of a 40-element buffer) on rank {rank} of {world}"
        if returned is not view:
            problems.append(f"{what}: must reduce the given tensor in place and return it")
        problem = diff_report(bucket[5:22], expected, f"{what}: the buffer's elements 5..21")
        if problem:
            problems.append(f"{problem}; write the result into the tensor's own storage (copy_, add_), never "
                            "rebind it (tensor.data = ..., tensor.set_(...)): views of it must see the sum")
        outside = torch.cat([bucket[:5], bucket[22:]])
        if not torch.equal(outside, torch.cat([untouched[:5], untouched[22:]])):
            problems.append(f"{what}: elements of the buffer outside the view changed")
        outputs[what.split(" on rank")[0]] = bucket[5:22].clone()
    return problems, outputs


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6, 8])
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


def _root_rank(ref: grading.ModuleRef):
    mod = ref.load()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for root in range(world):
        x = torch.arange(6, dtype=torch.float32) + 10.0 * rank
        expected = x.clone()
        dist.all_reduce(expected)
        with CollectiveLog() as log:
            mod.allreduce_reduce_broadcast(x, root=root)
        out[root] = ([(c.name, c.peer) for c in log.calls], torch.equal(x, expected))
    return out


def test_1_2_reduce_broadcast_honours_the_root(grade):
    world = 3
    results = run_world(_root_rank, world, args=(grade("1.2"),))
    problems = []
    for root in range(world):
        for rank in range(world):
            calls, correct = results[rank][root]
            if not correct:
                problems.append(f"root={root}, rank {rank}: the result differs from dist.all_reduce")
            for name, peer in calls:
                rooted = name in ("broadcast", "gather", "scatter", "reduce")
                if peer is not None and peer != root and (rooted or rank != root):
                    problems.append(f"allreduce_reduce_broadcast(root={root}) on rank {rank}: {name} with "
                                    f"{'root' if rooted else 'peer'} {peer}; every message goes to or from the root")
    assert_no_problems(problems, "reduce+broadcast must reduce to the `root` it is given (not always rank 0):")


def test_allreduce_rejects_bad_op():
    """Not graded (the checks are given code, outside the exercises): the errors 1.2 promises,
    raised before any message is sent (no process group needed)."""
    mod = grading.reference("1.2")
    for name, fn in mod.STRATEGIES.items():
        with pytest.raises(ValueError, match="op"):
            fn(torch.ones(3), op="max")
        for dtype in (torch.int64, torch.int32):
            with pytest.raises(TypeError, match="avg"):
                fn(torch.ones(3, dtype=dtype), op="avg")
