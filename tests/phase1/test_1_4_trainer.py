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
from torch.overrides import TorchFunctionMode

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


class ManyKinds(nn.Module):
    """Every kind of state a model may hold: a frozen parameter, a weight tied between two
    layers (one Parameter), a buffer left out of the state_dict (persistent=False), an
    integer buffer, and a submodule reached through a ModuleDict. Forward takes a keyword."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(64, 16)
        self.layers = nn.ModuleDict({"mid": nn.Linear(16, 16), "frozen": nn.Linear(16, 16)})
        self.layers["frozen"].requires_grad_(False)
        self.head = nn.Linear(16, 16, bias=False)
        self.tied = nn.Linear(16, 16, bias=False)
        self.tied.weight = self.head.weight  # one Parameter used by two layers
        self.out = nn.Linear(16, 10)
        self.register_buffer("scale", torch.rand(16) + 0.5, persistent=False)
        self.register_buffer("steps", torch.randint(0, 100, (3,)))

    def forward(self, x, *, extra: bool = True):
        h = torch.tanh(self.embed(x.flatten(1))) * self.scale
        h = torch.tanh(self.layers["mid"](h)) + self.layers["frozen"](h)
        h = torch.tanh(self.head(h)) + (self.tied(h) if extra else 0)
        return self.out(h)


def _tensors(model: nn.Module) -> dict:
    """Every parameter and buffer by name, persistent or not (what state_dict() leaves out included)."""
    return {**dict(model.named_parameters()), **{f"buffer {k}": v for k, v in model.named_buffers()}}


def _broadcast_kinds_rank(ref: grading.ModuleRef):
    mod = ref.load()
    rank = dist.get_rank()
    out = {}
    for src in (1, 0):
        model = ManyKinds(seed=10 * rank + src)
        before = {k: v.detach().clone() for k, v in _tensors(model).items()}
        where = {k: (id(v), v.data_ptr()) for k, v in _tensors(model).items()}
        mod.broadcast_parameters(model, src=src)
        after = _tensors(model)
        moved = [k for k, v in after.items() if (id(v), v.data_ptr()) != where.get(k)]
        untied = model.tied.weight is not model.head.weight
        out[src] = (before, {k: v.detach().clone() for k, v in after.items()}, moved, untied,
                    model.layers["frozen"].weight.requires_grad)
    return out


def test_1_4_broadcast_reaches_every_kind_of_state_in_place(grade):
    results = run_world(_broadcast_kinds_rank, 3, args=(grade("1.4"),))
    problems = []
    for src in (1, 0):
        expected = results[src][src][0]
        for rank in range(3):
            _, after, moved, untied, frozen_requires_grad = results[rank][src]
            what = f"broadcast_parameters(src={src}) on rank {rank}:"
            problems += state_dict_problems(after, expected, what, 0, 0)
            if moved:
                problems.append(f"{what} {', '.join(moved)} now live in other tensors or storage: broadcast into the "
                                "model's own tensors, in place (an optimizer, a tied layer or a flat buffer holds them)")
            if untied:
                problems.append(f"{what} the tied weight (one Parameter of two layers) became two tensors")
            if frozen_requires_grad:
                problems.append(f"{what} the frozen parameter now requires grad")
    assert_no_problems(problems, "every parameter (frozen and tied ones too) and every buffer (the non-persistent and "
                                 "integer ones too) must end equal to rank src's, written in place:")


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


KINDS_SPLITS = [6, 1, 3]  # 10 samples


def _kinds_loss(model, inputs, targets, first, n):
    return F.cross_entropy(model(inputs[first:first + n], extra=True), targets[first:first + n])


def _sync_kinds_rank(ref: grading.ModuleRef):
    mod = ref.load()
    rank = dist.get_rank()
    inputs, targets = _batch()
    model = ManyKinds()
    _kinds_loss(model, inputs, targets, sum(KINDS_SPLITS[:rank]), KINDS_SPLITS[rank]).backward()
    with CollectiveLog(also_in=(mod,)) as log:
        mod.sync_gradients(model, KINDS_SPLITS[rank])
    calls = [(c.name, c.numel) for c in log.calls]
    single = _OneWeight()
    _kinds_loss(single, inputs, targets, sum(KINDS_SPLITS[:rank]), KINDS_SPLITS[rank]).backward()
    mod.sync_gradients(single, KINDS_SPLITS[rank])
    double = _OneWeight().double()  # float64 parameters: the weights and sums in their dtype
    _kinds_loss(double, inputs.double(), targets, sum(KINDS_SPLITS[:rank]), KINDS_SPLITS[rank]).backward()
    mod.sync_gradients(double, KINDS_SPLITS[rank])
    return ({name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}, calls,
            single.linear.weight.grad.clone(), double.linear.weight.grad.clone())


class _OneWeight(nn.Module):
    """The smallest model: a single trainable tensor (a Linear without bias)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.linear = nn.Linear(64, 10, bias=False)

    def forward(self, x, *, extra: bool = True):
        return self.linear(x.flatten(1))


def test_1_4_sync_gradients_with_frozen_and_tied_parameters(grade):
    """A frozen parameter keeps .grad None (a zero gradient would let weight decay or momentum
    move it); a weight shared by two layers is one parameter, synced once."""
    results = run_world(_sync_kinds_rank, 3, args=(grade("1.4"),))
    model, (inputs, targets) = ManyKinds(), _batch()
    _kinds_loss(model, inputs, targets, 0, GLOBAL_BATCH).backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    single, double = _OneWeight(), _OneWeight().double()
    _kinds_loss(single, inputs, targets, 0, GLOBAL_BATCH).backward()
    _kinds_loss(double, inputs.double(), targets, 0, GLOBAL_BATCH).backward()
    problems = []
    for rank, (grads, calls, single_grad, double_grad) in enumerate(results):
        problems += state_dict_problems({"weight": single_grad}, {"weight": single.linear.weight.grad},
                                        f"rank {rank}, a model whose only parameter is one Linear weight:")
        if double_grad.dtype != torch.float64:
            problems.append(f"rank {rank}: a float64 parameter's gradient became {double_grad.dtype} in sync_gradients")
        problems += state_dict_problems({"weight": double_grad}, {"weight": double.linear.weight.grad},
                                        f"rank {rank}, one float64 Linear weight:", rtol=1e-10, atol=1e-12)
        what = f"rank {rank} (local batch {KINDS_SPLITS[rank]})"
        for name, grad in grads.items():
            if expected[name] is None and grad is not None:
                problems.append(f"{what}: {name} is frozen (requires_grad=False), but has a .grad after sync_gradients; "
                                "leave frozen parameters alone")
            elif expected[name] is not None:
                problems += state_dict_problems({name: grad}, {name: expected[name]}, f"{what} gradient of") \
                    if grad is not None else [f"{what}: {name} has no gradient after sync_gradients"]
        if calls != results[0][1]:
            problems.append(f"{what} made the collectives {calls}, rank 0 made {results[0][1]}")
    assert_no_problems(problems, f"with local batches {KINDS_SPLITS}, a frozen layer and a weight tied between two "
                                 "layers, the synced gradients must equal the gradient of the mean loss over all 10 "
                                 "samples:")


class _HostReads(TorchFunctionMode):
    """Records every call that copies a tensor's value to the host (the CPU then waits for the device)."""

    NAMES = {"item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__", "__complex__"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES or name == "to" and any(str(a) == "cpu" for a in [*args[1:], *(kwargs or {}).values()]):
            self.seen.append(f"Tensor.{name}")
        return func(*args, **(kwargs or {}))


def _host_sync_rank(ref: grading.ModuleRef):
    mod = ref.load()
    rank = dist.get_rank()
    inputs, targets = _batch()
    n, start = (6, 0) if rank == 0 else (4, 6)
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    F.cross_entropy(model(inputs[start:start + n]), targets[start:start + n]).backward()
    with _HostReads() as reads:
        mod.sync_gradients(model, n)
    return reads.seen


def test_1_4_sync_gradients_never_waits_for_the_device(grade):
    results = run_world(_host_sync_rank, 2, args=(grade("1.4"),))
    for rank, seen in enumerate(results):
        assert not seen, (
            f"rank {rank}: sync_gradients read tensor values on the host ({', '.join(sorted(set(seen)))}): on a GPU the "
            "CPU waits there for all queued work, at every call. Keep the weight n_r / N a tensor on the device "
            "(weight = n / count[0]) and multiply by it; no .item(), float(), int() or comparison of a tensor in an if")


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
    whole = build_model("mlp", (1, 8, 8), 10, seed=0)  # the world's group spelled out: what group=None stands for
    F.cross_entropy(whole(inputs[start:start + n]), targets[start:start + n]).backward()
    mod.sync_gradients(whole, n, group=dist.group.WORLD)
    return {name: p.grad.clone() for name, p in model.named_parameters()}, \
        {name: p.grad.clone() for name, p in whole.named_parameters()}


def test_1_4_sync_gradients_averages_within_its_group(grade):
    results = run_world(_group_rank, 4, args=(grade("1.4"),))
    inputs, targets = _batch()
    problems = []
    for first, last in ((0, 6), (6, 10)):
        model = build_model("mlp", (1, 8, 8), 10, seed=0)
        F.cross_entropy(model(inputs[first:last]), targets[first:last]).backward()
        expected = {name: p.grad for name, p in model.named_parameters()}
        for rank in (0, 1) if first == 0 else (2, 3):
            problems += state_dict_problems(results[rank][0], expected, f"rank {rank} (group of samples {first}..{last - 1})")
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    F.cross_entropy(model(inputs[:sum(GROUP_SPLITS)]), targets[:sum(GROUP_SPLITS)]).backward()
    for rank in range(4):
        problems += state_dict_problems(results[rank][1], {name: p.grad for name, p in model.named_parameters()},
                                        f"rank {rank}, group=dist.group.WORLD (all 10 samples)")
    assert_no_problems(problems, f"sync_gradients(model, n, group=g) with groups {{0, 1}}, {{2, 3}} and local batches "
                                 f"{GROUP_SPLITS}: each rank must hold the mean-loss gradient over its group's samples only "
                                 "(pass group= to every collective)")


STEPS, LR = 4, 0.1


def _steps_batches():
    gen = torch.Generator().manual_seed(11)
    return [(torch.randn(7, 1, 8, 8, generator=gen), torch.randint(0, 10, (7,), generator=gen)) for _ in range(STEPS)]


TRAIN_STEP_PARTS = [slice(0, 3), slice(3, 5), slice(5, 7)]  # uneven: 3 + 2 + 2 samples of 7
TRAIN_STEP_OPTIMIZERS = {  # a stateful SGD, and an adaptive optimizer (its update is not linear in the gradient)
    "SGD(momentum=0.9)": lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9),
    "AdamW(weight_decay=0.1)": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
}


def _train_step_rank(ref: grading.ModuleRef):
    mod = ref.load()
    rank = dist.get_rank()
    out = {}
    for name, make in TRAIN_STEP_OPTIMIZERS.items():
        model = build_model("mlp", (1, 8, 8), 10, seed=100 + rank)  # replicas start different on purpose
        mod.broadcast_parameters(model)
        optimizer = make(model.parameters())
        for param in model.parameters():  # stale gradients (an earlier backward, say): the step must not add them in
            param.grad = torch.full_like(param, 1.0 + rank)
        losses = []
        for inputs, targets in _steps_batches():
            part = TRAIN_STEP_PARTS[rank]
            losses.append(mod.train_step(model, optimizer, inputs[part], targets[part]))
        out[name] = (losses, {k: v.clone() for k, v in model.state_dict().items()})
    return out


def test_1_4_train_step_matches_single_process(grade):
    results = run_world(_train_step_rank, len(TRAIN_STEP_PARTS), args=(grade("1.4"),))
    problems = []
    for name, make in TRAIN_STEP_OPTIMIZERS.items():
        model = build_model("mlp", (1, 8, 8), 10, seed=100)
        optimizer = make(model.parameters())
        expected_losses = []
        for inputs, targets in _steps_batches():
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            expected_losses.append(loss.item())
        for rank, result in enumerate(results):
            losses, params = result[name]
            problems += state_dict_problems(params, model.state_dict(), f"{name}, after {STEPS} steps, rank {rank}",
                                            rtol=1e-4, atol=1e-5)
            if losses != pytest.approx(expected_losses, rel=1e-4):
                problems.append(f"{name}, rank {rank}: train_step returned losses {losses}, expected the global mean "
                                f"losses {expected_losses}")
    assert_no_problems(problems, "3 ranks (3 + 2 + 2 samples per step) must take exactly the steps of one process on "
                                 "all 7 samples, with torch.optim.SGD(momentum) and torch.optim.AdamW")


class _OnAnotherDevice(torch.Tensor):
    """A batch the loader made on another device than the model's, as host batches are when the
    model is on a GPU: CPU data that says it lives on cuda:0. An op that mixes it with a tensor
    of the model's device fails, as on real hardware; `.to(device)` (or `.cpu()`) brings it over."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name, owner = getattr(func, "__name__", ""), getattr(func, "__self__", None)
        if name == "__get__" and owner is torch.Tensor.device:
            return torch.device("cuda", 0)
        if name == "__get__" and owner is torch.Tensor.is_cuda:
            return True
        moves = func is torch.Tensor.cpu or func is torch.Tensor.to and (
            "device" in kwargs or any(isinstance(a, (torch.device, str, int)) for a in args[1:]))
        if moves:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs).as_subclass(torch.Tensor).clone()
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(type(t) is not cls for t in tensors):
            raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices, "
                               f"cuda:0 and cpu! ({name or func}: a batch still on the loader's device met the model's)")
        return super().__torch_function__(func, types, args, kwargs)


def _evaluate_rank(ref: grading.ModuleRef):
    mod = ref.load()
    rank, world = dist.get_rank(), dist.get_world_size()
    test = load_digits("test")
    model = build_model("mlp", (1, 8, 8), 10, seed=0)  # untrained: its accuracy differs shard to shard
    shard = torch.utils.data.Subset(test, range(rank, len(test), world))
    loader = torch.utils.data.DataLoader(shard, batch_size=16)
    accuracy = mod.evaluate(model, loader, torch.device("cpu"))
    # The same shard, batched on "another device": evaluate must bring each batch to `device`.
    x, y = (t[list(shard.indices)] for t in test.tensors)
    elsewhere = torch.utils.data.TensorDataset(x.as_subclass(_OnAnotherDevice), y.as_subclass(_OnAnotherDevice))
    try:
        moved = mod.evaluate(model, torch.utils.data.DataLoader(elsewhere, batch_size=16), torch.device("cpu"))
    except RuntimeError as exc:
        if "same device" not in str(exc):
            raise
        moved = str(exc)
    return accuracy, moved


def test_1_4_evaluate_counts_every_rank(grade):
    world = 3
    results = run_world(_evaluate_rank, world, args=(grade("1.4"),))
    test = load_digits("test")
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    with torch.no_grad():
        x, y = test.tensors
        expected = (model(x).argmax(1) == y).double().mean().item()
    for rank, (accuracy, moved) in enumerate(results):
        assert accuracy == pytest.approx(expected, abs=1e-9), (
            f"rank {rank} reported accuracy {accuracy:.4f}; over all {len(test)} test samples "
            f"(split across {world} ranks) it is {expected:.4f}: sum correct and total counts over ranks")
        assert not isinstance(moved, str), (
            f"rank {rank}: the loader's batches live on another device than the model (as host batches do when the "
            f"model is on a GPU), and evaluate used them there: {moved}. Move each batch to `device` first "
            "(inputs.to(device), targets.to(device))")
        assert moved == pytest.approx(expected, abs=1e-9), \
            f"rank {rank}: with the batches brought from another device, accuracy {moved:.4f}, expected {expected:.4f}"


UNEVEN_SHARDS = [[0, 200, 300, 360], [0, 250, 360, 360]]  # 200 + 100 + 60, then 250 + 110 + none at all


def _uneven_evaluate_rank(ref: grading.ModuleRef):
    mod = ref.load()
    rank = dist.get_rank()
    test = load_digits("test")
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    out = []
    for bounds in UNEVEN_SHARDS:  # the same model and the same function, twice
        shard = torch.utils.data.Subset(test, range(bounds[rank], bounds[rank + 1]))
        out.append(mod.evaluate(model, torch.utils.data.DataLoader(shard, batch_size=32), torch.device("cpu")))
    return out


def test_1_4_evaluate_weights_shards_by_their_size(grade):
    results = run_world(_uneven_evaluate_rank, 3, args=(grade("1.4"),))
    test = load_digits("test")
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    with torch.no_grad():
        correct = (model(test.tensors[0]).argmax(1) == test.tensors[1]).double()
    expected = correct.mean().item()
    for call, bounds in enumerate(UNEVEN_SHARDS):
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        for rank, accuracies in enumerate(results):
            accuracy = accuracies[call]
            assert accuracy == pytest.approx(expected, abs=1e-9), (
                f"shards of {sizes} samples (evaluate call {call + 1} on the same model), rank {rank} reported accuracy "
                f"{accuracy:.4f}; the accuracy over all 360 is {expected:.4f}: sum the correct and total counts over "
                "ranks, then divide (a rank with no sample adds 0 to both, and still joins the all-reduce)")
    mean_of_shards = sum(correct[a:b].mean().item() for a, b in ((0, 200), (200, 300), (300, 360))) / 3
    assert abs(mean_of_shards - expected) > 1e-3  # the test distinguishes the two


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
    training = model.training
    model.eval()  # handed over in eval mode, it must come back in eval mode
    again = mod.evaluate(model, torch.utils.data.DataLoader(shard, batch_size=32), torch.device("cpu"))
    return accuracy, training, before, {k: v.clone() for k, v in model.state_dict().items()}, again, model.training


def test_1_4_evaluate_runs_the_model_in_eval_mode(grade):
    results = run_world(_eval_mode_rank, 2, args=(grade("1.4"),))
    test = load_digits("test")
    model = _regularised_model().eval()
    with torch.no_grad():
        expected = (model(test.tensors[0]).argmax(1) == test.tensors[1]).double().mean().item()
    for rank, (accuracy, training, before, after, again, still_training) in enumerate(results):
        assert accuracy == pytest.approx(expected, abs=1e-9), (
            f"rank {rank}: accuracy {accuracy:.4f} of a model with BatchNorm and dropout; in eval mode it is "
            f"{expected:.4f}: call model.eval() before predicting (train mode drops units at random and "
            "normalises with the batch's statistics)")
        assert_no_problems(state_dict_problems(after, before, f"rank {rank}: after evaluate,", 0, 0),
                           "evaluate changed the model's state (BatchNorm running statistics are updated in train mode)")
        assert training, f"rank {rank}: evaluate left the model in eval mode; restore the mode it found (training went on)"
        assert again == pytest.approx(expected, abs=1e-9), \
            f"rank {rank}: a second evaluate of the same model, handed over in eval mode, gave {again:.4f}, not {expected:.4f}"
        assert not still_training, (f"rank {rank}: evaluate of a model handed over in eval mode left it in train mode; "
                                    "restore the mode it found (model.train(was_training)), not always train mode")


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

