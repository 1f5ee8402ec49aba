"""Graded tests of exercise 1.4, synchronous data-parallel trainer (phase1_data_parallel/guidelines.md, section 1.4).

Run them with `python tests/test_phase1.py -k 1_4` (your code) or
`pytest tests/test_phase1.py -k 1_4` (the reference); tests/test_phase1.py collects them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import grading
from compare import assert_no_problems, diff_report, state_dict_problems
from common.data import load_digits
from common.launch import run_world
from common.measure import CollectiveLog
from common.models import build_model


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


class _Desync(Exception):
    pass


_CALL_IDS = {name: i for i, name in enumerate(["<end>", *CollectiveLog().names_watched])}


def _in_lockstep(all_gather):
    """on_call hook: before each collective, every rank shows the others which one it is
    about to make (name, elements); a mismatch raises _Desync on every rank at once,
    instead of the hang or the silent mix-up it would cause."""

    def check(call) -> None:
        mine = torch.tensor([_CALL_IDS.get(getattr(call, "name", "<end>"), -1), getattr(call, "numel", 0)])
        seen = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        all_gather(seen, mine)
        if any(not torch.equal(s, seen[0]) for s in seen):
            names = {i: n for n, i in _CALL_IDS.items()}
            raise _Desync("; ".join(f"rank {r} {names.get(int(s[0]), '?')}({int(s[1])} elements)" for r, s in enumerate(seen)))

    return check


class TwoHeads(nn.Module):
    """An MLP with an auxiliary head that only some ranks use in their forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.aux = nn.Linear(64, 16), nn.Linear(16, 10), nn.Linear(16, 10)

    def forward(self, x, use_aux: bool):
        h = torch.relu(self.body(x.flatten(1)))
        return self.head(h) + self.aux(h) if use_aux else self.head(h)


UNUSED_SPLITS = [4, 3]  # rank 0 uses the auxiliary head on 4 samples, rank 1 does not on 3


def _unused_rank(ref: grading.ModuleRef):
    mod = ref.load()
    rank = dist.get_rank()
    inputs, targets = _batch()
    start, n = sum(UNUSED_SPLITS[:rank]), UNUSED_SPLITS[rank]
    model = TwoHeads()
    F.cross_entropy(model(inputs[start:start + n], use_aux=rank == 0), targets[start:start + n]).backward()
    check = _in_lockstep(dist.all_gather)
    try:
        with CollectiveLog(on_call=check, also_in=(mod,)):
            mod.sync_gradients(model, n)
        check(None)  # "<end>": a rank that made fewer collectives meets the others here
    except _Desync as exc:
        return str(exc)
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def test_1_4_sync_gradients_with_a_parameter_unused_on_one_rank(grade):
    results = run_world(_unused_rank, 2, args=(grade("1.4"),))
    for rank, result in enumerate(results):
        assert not isinstance(result, str), (
            f"the ranks' collectives went out of step inside sync_gradients: {result}. The auxiliary head is "
            "unused on rank 1 (its .grad is None there): a parameter without a gradient must still take part, "
            "as zeros, or the ranks pair up different tensors (or hang)")
    model, (inputs, targets) = TwoHeads(), _batch()
    n0, n1 = UNUSED_SPLITS
    loss0 = F.cross_entropy(model(inputs[:n0], use_aux=True), targets[:n0])
    loss1 = F.cross_entropy(model(inputs[n0:n0 + n1], use_aux=False), targets[n0:n0 + n1])
    ((n0 * loss0 + n1 * loss1) / (n0 + n1)).backward()  # rank 1 contributes zero to aux
    problems = []
    for rank, grads in enumerate(results):
        for name, p in model.named_parameters():
            if grads[name] is None:
                problems.append(f"rank {rank}: {name} has no gradient after sync_gradients (rank 0 used it)")
            else:
                problem = diff_report(grads[name], p.grad, f"rank {rank} gradient of {name}")
                if problem:
                    problems.append(problem)
    assert_no_problems(problems, "with aux unused on rank 1, every rank must end with sum_r n_r g_r / N, rank 1's g_r = 0:")


GROUP_SPLITS = [4, 2, 1, 3]  # groups {0, 1} and {2, 3}: 6 and 4 samples


def _group_rank(ref: grading.ModuleRef):
    mod = ref.load()
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    inputs, targets = _batch()
    start, n = sum(GROUP_SPLITS[:rank]), GROUP_SPLITS[rank]
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    F.cross_entropy(model(inputs[start:start + n]), targets[start:start + n]).backward()
    mod.sync_gradients(model, n, group=groups[rank // 2])
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_1_4_sync_gradients_averages_within_its_group(grade):
    results = run_world(_group_rank, 4, args=(grade("1.4"),))
    inputs, targets = _batch()
    problems = []
    for first, last in ((0, 6), (6, 10)):
        model = build_model("mlp", (1, 8, 8), 10, seed=0)
        F.cross_entropy(model(inputs[first:last]), targets[first:last]).backward()
        expected = {name: p.grad for name, p in model.named_parameters()}
        for rank in (0, 1) if first == 0 else (2, 3):
            problems += state_dict_problems(results[rank], expected, f"rank {rank} (group of samples {first}..{last - 1})")
    assert_no_problems(problems, f"sync_gradients(model, n, group=g) with groups {{0, 1}}, {{2, 3}} and local batches "
                                 f"{GROUP_SPLITS}: each rank must hold the mean-loss gradient over its group's samples only "
                                 "(pass group= to every collective)")


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


def _uneven_evaluate_rank(ref: grading.ModuleRef):
    mod = ref.load()
    rank = dist.get_rank()
    test = load_digits("test")
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    bounds = [0, 200, 300, len(test)]  # shards of 200, 100 and 60 samples
    shard = torch.utils.data.Subset(test, range(bounds[rank], bounds[rank + 1]))
    return mod.evaluate(model, torch.utils.data.DataLoader(shard, batch_size=32), torch.device("cpu"))


def test_1_4_evaluate_weights_shards_by_their_size(grade):
    results = run_world(_uneven_evaluate_rank, 3, args=(grade("1.4"),))
    test = load_digits("test")
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    with torch.no_grad():
        correct = (model(test.tensors[0]).argmax(1) == test.tensors[1]).double()
    expected = correct.mean().item()
    mean_of_shards = sum(correct[a:b].mean().item() for a, b in ((0, 200), (200, 300), (300, 360))) / 3
    assert abs(mean_of_shards - expected) > 1e-3  # the test distinguishes the two
    for rank, accuracy in enumerate(results):
        assert accuracy == pytest.approx(expected, abs=1e-9), (
            f"rank {rank} reported accuracy {accuracy:.4f}; with shards of 200, 100 and 60 samples the accuracy over "
            f"all 360 is {expected:.4f} (the mean of the three shards' accuracies would be {mean_of_shards:.4f}): "
            "sum the correct and total counts over ranks, then divide")


def _regularised_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10))


def _eval_mode_rank(ref: grading.ModuleRef):
    mod = ref.load()
    rank, world = dist.get_rank(), dist.get_world_size()
    test = load_digits("test")
    model = _regularised_model()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shard = torch.utils.data.Subset(test, range(rank, len(test), world))
    accuracy = mod.evaluate(model, torch.utils.data.DataLoader(shard, batch_size=32), torch.device("cpu"))
    return accuracy, model.training, before, {k: v.clone() for k, v in model.state_dict().items()}


def test_1_4_evaluate_runs_the_model_in_eval_mode(grade):
    results = run_world(_eval_mode_rank, 2, args=(grade("1.4"),))
    test = load_digits("test")
    model = _regularised_model().eval()
    with torch.no_grad():
        expected = (model(test.tensors[0]).argmax(1) == test.tensors[1]).double().mean().item()
    for rank, (accuracy, training, before, after) in enumerate(results):
        assert accuracy == pytest.approx(expected, abs=1e-9), (
            f"rank {rank}: accuracy {accuracy:.4f} of a model with BatchNorm and dropout; in eval mode it is "
            f"{expected:.4f}: call model.eval() before predicting (train mode drops units at random and "
            "normalises with the batch's statistics)")
        assert_no_problems(state_dict_problems(after, before, f"rank {rank}: after evaluate,", 0, 0),
                           "evaluate changed the model's state (BatchNorm running statistics are updated in train mode)")
        assert training, f"rank {rank}: evaluate left the model in eval mode; restore the mode it found (training went on)"


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

