"""Graded tests of exercise 2.1, gradient accumulation (phase2_advanced/guidelines.md, section 2.1).

Run them with `python tests/test_phase2.py -k 2_1` (your code) or
`pytest tests/test_phase2.py -k 2_1` (the reference); tests/test_phase2.py collects them.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import grading
from compare import assert_no_problems, state_dict_problems
from common.launch import run_world
from common.measure import CollectiveLog, saved_activation_bytes
from common.models import build_model


ACCUM_STEPS, ACCUM_LR = 2, 0.1
# Property tests draw their cases from a fixed seed: a grading run is reproducible.
PROPERTY_SETTINGS = dict(derandomize=True, database=None, deadline=None)
# (local batch of rank 0, of rank 1, micro-batch size). Rank 1 always has fewer samples, so
# the n_r weighting matters; the last micro-batch is smaller in most cases.
ACCUM_CASES = [
    (8, 7, 3),  # 3+3+2 | 3+3+1   neither divides
    (8, 7, 4),  # 4+4   | 4+3     divides on rank 0 only
    (8, 7, 2),  # 2+2+2+2 | 2+2+2+1
    (8, 7, 8),  # one micro-batch each: a plain data-parallel step
    (8, 4, 3),  # 3+3+2 | 3+1     different numbers of micro-batches per rank
]
_ACCUM_EQUAL_COUNTS = 4  # the first 4 cases give both ranks the same number of micro-batches


def _accum_batch(n: int, step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 1, 8, 8, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def _accum_ground_truth(total: int):
    """One process, one plain step per optimizer step on all `total` samples."""
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=ACCUM_LR, momentum=0.9)
    losses = []
    for step in range(ACCUM_STEPS):
        inputs, targets = _accum_batch(total, step)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _accum_rank(ref: grading.ModuleRef, cases):
    mod = ref.load()
    rank = dist.get_rank()

    # What ONE sync of the model all-reduces (GradSync.sync is given code, not an exercise).
    probe = build_model("mlp", (1, 8, 8), 10, seed=0)
    F.cross_entropy(probe(torch.zeros(1, 1, 8, 8)), torch.zeros(1, dtype=torch.long)).backward()
    with CollectiveLog(["all_reduce"]) as log:
        mod.GradSync(probe).sync(1)
    sync_bytes = log.bytes()
    grad_bytes = sum(p.numel() * p.element_size() for p in probe.parameters())

    out = {"sync_bytes": sync_bytes, "grad_bytes": grad_bytes, "cases": []}
    for index, (n0, n1, micro) in enumerate(cases):
        if index >= _ACCUM_EQUAL_COUNTS and any(
                b >= sync_bytes + grad_bytes for case in out["cases"] for b in case["bytes"]):
            # Gradients all-reduced on every micro-step: with different numbers of micro-batches
            # per rank the ranks would call different numbers of collectives (a deadlock).
            out["cases"].append(None)
            continue
        model = build_model("mlp", (1, 8, 8), 10, seed=0)
        sync = mod.GradSync(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=ACCUM_LR, momentum=0.9)
        losses, all_reduced = [], []
        for step in range(ACCUM_STEPS):
            inputs, targets = _accum_batch(n0 + n1, step)
            part = slice(0, n0) if rank == 0 else slice(n0, n0 + n1)
            with CollectiveLog(["all_reduce"]) as log:
                losses.append(mod.accumulation_step(sync, optimizer, inputs[part], targets[part], micro))
            all_reduced.append(log.bytes())
        out["cases"].append({"losses": losses, "bytes": all_reduced,
                             "state": {k: v.clone() for k, v in model.state_dict().items()}})
    return out


_accum_worlds: dict = {}  # one world serves both multi-rank tests of 2.1


def _accum_world(ref: grading.ModuleRef):
    if ref not in _accum_worlds:
        try:
            _accum_worlds[ref] = run_world(_accum_rank, 2, args=(ref, ACCUM_CASES))
        except Exception as exc:  # noqa: BLE001 - re-raised by every test that needs the world
            _accum_worlds[ref] = exc
    result = _accum_worlds[ref]
    if isinstance(result, BaseException):
        raise result
    return result


def _recording_sync(mod):
    """A GradSync around the MLP whose `sync` records its calls instead of all-reducing."""
    sync = mod.GradSync(build_model("mlp", (1, 8, 8), 10, seed=0))
    synced: list[int] = []
    sync.sync = synced.append
    return sync, synced


def test_2_1_no_sync_suspends_sync_and_restores_it(grade):
    mod = grade("2.1").load()
    sync, synced = _recording_sync(mod)
    inputs, targets = _accum_batch(4, 0)

    def backward():
        sync.backward(F.cross_entropy(sync(inputs), targets), 4)
        return len(synced)

    assert backward() == 1, "forward and backward outside no_sync(): GradSync.backward must sync (self.sync)"
    with sync.no_sync():
        assert backward() == 1, "forward and backward inside no_sync(): backward must not sync"
        with sync.no_sync():
            pass
        assert backward() == 1, "after a nested no_sync() block, the outer block must still suspend the sync " \
                                "(restore the PREVIOUS value of require_sync, not True)"
    assert backward() == 2, "after the no_sync() block, backward must sync again (restore require_sync)"
    with pytest.raises(ZeroDivisionError):
        with sync.no_sync():
            1 / 0
    assert backward() == 3, "an exception inside no_sync() must still restore the sync (use try/finally)"


def test_2_1_sync_is_decided_at_forward_like_ddp(grade):
    mod = grade("2.1").load()
    sync, synced = _recording_sync(mod)
    inputs, targets = _accum_batch(4, 0)
    loss = F.cross_entropy(sync(inputs), targets)
    with sync.no_sync():
        sync.backward(loss, 4)
    assert synced == [4], (f"forward OUTSIDE no_sync(), backward inside: synced {len(synced)} times, DDP syncs once: "
                           "its forward reads require_backward_grad_sync and prepares the all-reduce, so the "
                           "decision must be taken (recorded) in forward, not read again in backward")
    with sync.no_sync():
        loss = F.cross_entropy(sync(inputs), targets)
    sync.backward(loss, 4)
    assert synced == [4], ("forward INSIDE no_sync(), backward outside: DDP does not sync (its forward prepared no "
                           f"all-reduce), but sync() was called {len(synced) - 1} time(s)")
    sync.backward(F.cross_entropy(sync(inputs), targets), 4)
    assert synced == [4, 4], "forward and backward outside no_sync() again: backward must sync"

    with sync.no_sync():
        quiet = F.cross_entropy(sync(inputs), targets)  # decided: no sync
    loud = F.cross_entropy(sync(inputs), targets)  # decided: sync
    sync.backward(loud, 4)
    sync.backward(quiet, 4)
    assert synced == [4, 4, 4], (
        f"two forwards, the first inside no_sync(), the second outside; backward of the second, then of the first: "
        f"synced {len(synced) - 2} time(s), expected once (the second's). A backward uses up the decision of its "
        "forward (as DDP's reducer, prepared by a forward, is done after one backward): the first loss's backward "
        "must not sync again on the second forward's decision")

    loss = F.cross_entropy(sync(inputs), targets)  # decided: sync
    with sync.no_sync(), torch.no_grad():
        sync(inputs)  # an evaluation forward: it builds no graph, so it decides nothing (DDP ignores it too)
    sync.backward(loss, 4)
    assert synced == [4, 4, 4, 4], (
        "forward outside no_sync(), then a forward under torch.no_grad() inside no_sync(), then the first loss's "
        f"backward: synced {len(synced) - 3} time(s), expected once. A forward that builds no graph has no backward "
        "to prepare: it must leave the decision of the last forward with grad alone (DDP checks torch.is_grad_enabled())")


class _WithKeywords(nn.Module):
    """A module whose forward takes positional and keyword arguments."""

    def __init__(self):
        super().__init__()
        self.mlp = build_model("mlp", (1, 8, 8), 10, seed=0)

    def forward(self, x, bias, *, scale=1.0, shift=None):
        out = self.mlp(x) * scale + bias
        return out if shift is None else out + shift


def test_2_1_grad_sync_forwards_every_argument(grade):
    mod = grade("2.1").load()
    module = _WithKeywords()
    sync = mod.GradSync(module)
    inputs, _ = _accum_batch(3, 0)
    bias = torch.arange(10.0)
    for args, kwargs in (((inputs, bias), {}), ((inputs, bias), {"scale": 2.0}), ((inputs,), {"bias": bias}),
                         ((inputs, bias), {"shift": torch.ones(10), "scale": -1.0})):
        shown = ", ".join([*(f"<{tuple(a.shape)}>" for a in args), *(f"{k}=..." for k in kwargs)])
        got, expected = sync(*args, **kwargs), module(*args, **kwargs)
        assert torch.equal(got, expected), f"GradSync(module)({shown}) must return module({shown}): every positional " \
                                           "and keyword argument passed on"


ACCUM_MEMORY_N, ACCUM_MEMORY_MICRO = 11, 3  # 3 + 3 + 3 + 2: all micro-batches at once would be ~3.7 times one


def test_2_1_one_micro_batch_of_activations_at_a_time(grade):
    mod = grade("2.1").load()
    inputs, targets = _accum_batch(ACCUM_MEMORY_N, 0)
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    params = list(model.parameters())
    # Bound: what one micro-batch of m samples saves, its input copied (a learner may index
    # the batch with a copy; slicing gives views of `inputs`, which is excluded below).
    m = ACCUM_MEMORY_MICRO
    one = saved_activation_bytes(
        lambda: F.cross_entropy(model(inputs[:m].clone()), targets[:m]).mul(m / ACCUM_MEMORY_N).backward(),
        exclude=params, count_if=torch.is_floating_point)
    model.zero_grad(set_to_none=True)
    sync = mod.GradSync(model)
    optimizer = torch.optim.SGD(params, lr=ACCUM_LR)
    peak = saved_activation_bytes(lambda: mod.accumulation_step(sync, optimizer, inputs, targets, m),
                                  exclude=params + [inputs], count_if=torch.is_floating_point)
    assert 0 < peak <= 1.25 * one, (
        f"{ACCUM_MEMORY_N} samples in micro-batches of {m}: autograd held up to {peak} bytes for backward at once, "
        f"{peak / one:.2f} times what one micro-batch saves ({one} bytes, measured with saved_tensors_hooks). "
        "Backward each micro-batch before the next forward (no list of losses, no sum of losses), so that its "
        "graph is freed: activation memory must be that of ONE micro-batch")


def test_2_1_single_process_matches_one_large_batch(grade):
    mod = grade("2.1").load()
    total = 10
    expected_losses, expected = _accum_ground_truth(total)
    problems = []
    for micro in (3, 5, 1, 10, 16):  # 3+3+3+1, divides, one sample each, whole batch, larger than the batch
        model = build_model("mlp", (1, 8, 8), 10, seed=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=ACCUM_LR, momentum=0.9)
        sync = mod.GradSync(model)
        losses = [mod.accumulation_step(sync, optimizer, *_accum_batch(total, step), micro)
                  for step in range(ACCUM_STEPS)]
        problems += state_dict_problems(model.state_dict(), expected,
                                        f"micro_batch_size={micro}, after {ACCUM_STEPS} steps:", rtol=1e-4, atol=1e-5)
        if losses != pytest.approx(expected_losses, rel=1e-5):
            problems.append(f"micro_batch_size={micro}: returned losses {losses}, expected the batch mean losses {expected_losses}")
    assert_no_problems(problems, f"one process, {total} samples per step: k micro-batches must take the step of one "
                                 "batch of 10 (weight each micro-batch's mean loss by n_i / n)")


def test_2_1_any_batch_and_micro_batch_size_take_one_step(grade):
    """One process, any local batch n and micro-batch size m, with stale gradients left in .grad or not:
    2 accumulation steps move the weights as 2 plain steps on the n samples do, return the batch's
    mean loss, sync once per step with local_samples=n, and run ceil(n/m) forwards of at most m
    samples that together see every sample once."""
    mod = grade("2.1").load()
    truths = {}

    @settings(max_examples=80, **PROPERTY_SETTINGS)
    @given(n=st.integers(1, 13), m=st.integers(1, 15), stale=st.booleans())
    def check(n, m, stale):
        if n not in truths:
            truths[n] = _accum_ground_truth(n)
        expected_losses, expected = truths[n]
        model = build_model("mlp", (1, 8, 8), 10, seed=0)
        sync = mod.GradSync(model)
        synced: list = []
        sync.sync = synced.append  # one process: record the syncs instead
        sizes: list = []
        model.register_forward_pre_hook(lambda module, args: sizes.append(len(args[0])))
        optimizer = torch.optim.SGD(model.parameters(), lr=ACCUM_LR, momentum=0.9)
        if stale:  # left over from, say, an evaluation backward: the step must not add them in
            for param in model.parameters():
                param.grad = torch.full_like(param, 0.5)
        case = f"local batch n={n}, micro_batch_size={m}{', stale .grad before the first step' if stale else ''}"
        for step in range(ACCUM_STEPS):
            synced.clear()
            sizes.clear()
            loss = mod.accumulation_step(sync, optimizer, *_accum_batch(n, step), m)
            assert loss == pytest.approx(expected_losses[step], rel=1e-5), \
                f"{case}, step {step}: returned loss {loss!r}, the mean loss over the {n} samples is {expected_losses[step]!r}"
            assert synced == [n], (f"{case}, step {step}: GradSync.sync was called with {synced}; expected once, with "
                                   f"local_samples={n} (this rank's samples in the whole step)")
            assert sum(sizes) == n and max(sizes) <= m and len(sizes) == math.ceil(n / m), (
                f"{case}, step {step}: forwards on micro-batches of {sizes} samples; expected ceil(n/m) = "
                f"{math.ceil(n / m)} micro-batches of at most {m} samples, each sample in one of them")
        assert_no_problems(state_dict_problems(model.state_dict(), expected, f"{case}, after {ACCUM_STEPS} steps:",
                                               rtol=1e-4, atol=1e-5),
                           "accumulation must take the step of one batch of n samples (weight micro-batch i by n_i/n, "
                           "zero the gradients first, one optimizer.step()):")

    grading.stop_hypothesis_at_todo(check)()  # a TODO is reported at once, not shrunk


def test_2_1_two_ranks_match_one_large_batch(grade):
    results = _accum_world(grade("2.1"))
    problems = []
    for index, (n0, n1, micro) in enumerate(ACCUM_CASES):
        case = f"local batches {n0} + {n1}, micro_batch_size={micro}"
        if results[0]["cases"][index] is None:
            problems.append(f"{case}: not run, since gradients were all-reduced on every micro-step (see "
                            "test_2_1_one_gradient_all_reduce_per_optimizer_step): with different numbers of "
                            "micro-batches per rank that deadlocks")
            continue
        expected_losses, expected = _accum_ground_truth(n0 + n1)
        for rank in range(2):
            got = results[rank]["cases"][index]
            problems += state_dict_problems(got["state"], expected, f"{case}, rank {rank}, after {ACCUM_STEPS} steps:",
                                            rtol=1e-4, atol=1e-5)
            if got["losses"] != pytest.approx(expected_losses, rel=1e-5):
                problems.append(f"{case}, rank {rank}: returned losses {got['losses']}, expected the global mean "
                                f"losses {expected_losses}")
    assert_no_problems(problems, "2 ranks accumulating micro-batches must take exactly the steps of one process on all "
                                 "samples (one plain step per optimizer step)")


def test_2_1_one_gradient_all_reduce_per_optimizer_step(grade):
    results = _accum_world(grade("2.1"))
    problems = []
    for rank in range(2):
        sync_bytes, grad_bytes = results[rank]["sync_bytes"], results[rank]["grad_bytes"]
        for index, (n0, n1, micro) in enumerate(ACCUM_CASES):
            got = results[rank]["cases"][index]
            if got is None:
                continue
            case = f"rank {rank}, local batch {(n0, n1)[rank]}, micro_batch_size={micro}"
            for step, sent in enumerate(got["bytes"]):
                if not sync_bytes <= sent < sync_bytes + grad_bytes:
                    problems.append(f"{case}, optimizer step {step}: dist.all_reduce got {sent} bytes = "
                                    f"{sent / sync_bytes:.2f} syncs (one sync all-reduces "
                                    f"{sync_bytes} bytes, the loss a few more)")
    assert_no_problems(problems, "gradient accumulation must all-reduce the gradients once per optimizer step, "
                                 "not once per micro-batch: run the forward AND backward of all micro-batches but the "
                                 "last inside sync.no_sync():")
