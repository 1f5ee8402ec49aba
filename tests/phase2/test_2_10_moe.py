"""Graded tests of exercise 2.10, expert parallelism (phase2_advanced/guidelines.md, section 2.10).

Run them with `python tests/test_phase2.py -k 2_10` (your code) or
`pytest tests/test_phase2.py -k 2_10` (the reference); tests/test_phase2.py collects them.
"""

from __future__ import annotations

import dataclasses
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import grading
from compare import assert_no_problems, diff_report
from common.launch import WorldError, run_world

#
# route() is graded in this process against a loop written from the contract (the module
# docstring of moe.py). The layer is graded in worlds of 4 ranks, each answering every case:
# one runs your all_to_all, one your ExpertParallelMoE.forward (gradients averaged by the
# reference's sync_gradients), one your sync_gradients (after the reference's forward), so a
# mistake in one function fails only its own tests. The ground truth is one process running
# the same loop on the whole batch, one group of tokens per rank. The forward world then runs
# _MOE_EXTRAS (two forwards in a row, a rank with no tokens, bf16 and float64), graded against
# the reference MoE of one process in that dtype, then the layer on the default group (None, and
# dist.group.WORLD spelled out) in the world of 4. Ranks return plain data; assertions happen here.

_MOE_WORLD = 4
_MOE_LAYOUTS = (4, 2)  # ep sizes in the world of 4: a (1, 4) and a (2, 2) mesh (rank = i * ep + j)
_MOE_SIZES = dict(hidden=8, ffn=16, experts=8, tokens=8)  # tokens per rank
_MOE_ALPHA = 0.5  # each rank's loss: mse(y, target) + alpha * aux
_MOE_EMPTY = (6, 7)  # the experts no token picks in the cases that say so
# name: (k, capacity_factor, whether experts 6 and 7 get no token at all)
_MOE_CASES = {
    "k=1, no dropping": (1, None, False),
    "k=1, capacity factor 1.0": (1, 1.0, False),
    "k=2, no dropping, experts 6 and 7 unused": (2, None, True),
    "k=2, capacity factor 1.0": (2, 1.0, False),
    "k=2, capacity factor 0.5, experts 6 and 7 unused": (2, 0.5, True),
}
_MOE_TOL = dict(rtol=1e-5, atol=1e-6)
# More cases of the forward world (after the five above, on both meshes), all on the model and tokens of one
# of them: name: (dtype of the layer and its input, the tokens of each forward in turn: "own" = the rank's,
# "negated" = minus the rank's (other routes), "none on 1" = the rank's, none on rank 1). Each rank's loss:
# sum(y * target) + alpha * aux (defined for no token), backward after the last forward only.
_MOE_EXTRA_CASE = "k=2, capacity factor 1.0"
_MOE_EXTRAS = {
    "two forwards, the first on other tokens (-x)": (torch.float32, ("negated", "own")),
    "rank 1 has no tokens": (torch.float32, ("none on 1",)),
    "bfloat16": (torch.bfloat16, ("own",)),
    "float64": (torch.float64, ("own",)),
}
# The layer built with from_full(..., group=G) for the default group spelled both ways, on the world of 4 (ep = 4:
# the same ranks as build_expert_groups(4).ep), one case each, after _MOE_EXTRAS, graded as the explicit group is.
_MOE_DEFAULT_GROUPS = ("group=None (the default group)", "group=dist.group.WORLD spelled out")
_MOE_DEFAULT_CASE = "k=2, capacity factor 1.0"
_MOE_EXTRA_TOL = {torch.float32: _MOE_TOL, torch.float64: dict(rtol=1e-9, atol=1e-12),
                  torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}  # bf16: a few roundings in another order


# ------------------------------------------------------------------ the contract, as a loop


def _naive_route(logits: torch.Tensor, k: int, capacity: int) -> dict:
    """The contract of moe.py, token by token: top-k by float32 probability (ties: lower expert), gates
    (renormalised for k >= 2), slots in (choice, token) order, aux = E * sum_i f_i * P_i with f_i
    the share of FIRST choices (dropped or not), 0 for no token. Differentiable through weights and aux."""
    tokens, experts_n = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)
    p = probs.tolist()
    experts = [sorted(range(experts_n), key=lambda e: (-p[t][e], e))[:k] for t in range(tokens)]
    weights = []
    for t in range(tokens):
        chosen = torch.stack([probs[t, e] for e in experts[t]])
        weights.append(chosen / chosen.sum() if k > 1 else chosen)
    kept, used = [[False] * k for _ in range(tokens)], [0] * experts_n
    for j in range(k):
        for t in range(tokens):
            e = experts[t][j]
            kept[t][j] = used[e] < capacity
            used[e] += 1
    first = [sum(experts[t][0] == i for t in range(tokens)) / max(tokens, 1) for i in range(experts_n)]
    aux = experts_n * sum(first[i] * probs[:, i].mean() for i in range(experts_n)) if tokens else probs.sum()
    return {"experts": torch.tensor(experts, dtype=torch.int64).view(tokens, k),
            "weights": torch.stack(weights) if weights else torch.zeros(0, k),
            "kept": torch.tensor(kept, dtype=torch.bool).view(tokens, k), "aux": aux}


def _capacity(tokens: int, k: int, factor) -> int:
    return grading.reference("2.10").expert_capacity(tokens, _MOE_SIZES["experts"], k, factor)


def _moe_full(case_data: dict, k: int, factor):
    c = _MOE_SIZES
    full = grading.reference("2.10").MoE(c["hidden"], c["ffn"], c["experts"], k, factor)
    full.load_state_dict(case_data["moe"])
    return full


def _moe_data() -> dict:
    """Per case: the unsharded MoE's weights, every rank's tokens and targets (seeded; the global RNG untouched).
    Where experts 6 and 7 must stay unused, feature 0 of every token is 1 and only those two experts'
    router rows weigh it, by -30: their logits stay far below the others'."""
    c, ref = _MOE_SIZES, grading.reference("2.10")
    data = {}
    with torch.random.fork_rng():
        torch.manual_seed(10)
        for name, (k, factor, empty) in _MOE_CASES.items():
            moe = ref.MoE(c["hidden"], c["ffn"], c["experts"], k, factor)
            x = torch.randn(_MOE_WORLD, c["tokens"], c["hidden"])
            if empty:
                with torch.no_grad():
                    x[..., 0] = 1.0
                    moe.router.weight[:, 0] = 0.0
                    moe.router.weight[list(_MOE_EMPTY), 0] = -30.0
            data[name] = {"moe": moe.state_dict(), "x": x, "target": torch.randn(_MOE_WORLD, c["tokens"], c["hidden"])}
    return data


def _moe_truth(case_data: dict, k: int, factor) -> dict:
    """One process, token by token: each rank's tokens routed as one group; the gradients of the mean of the
    ranks' losses (the input gradient: of each rank's own loss, which is what that rank's backward gives)."""
    full = _moe_full(case_data, k, factor)
    x = case_data["x"].clone().requires_grad_(True)
    capacity = _capacity(x.shape[1], k, factor)
    ys, auxes, routes, total = [], [], [], 0.0
    for g in range(x.shape[0]):
        r = _naive_route(full.router(x[g]), k, capacity)
        rows = []
        for t in range(x.shape[1]):
            row = torch.zeros(x.shape[2])
            for j in range(k):
                if r["kept"][t, j]:
                    row = row + r["weights"][t, j] * full.experts[int(r["experts"][t, j])](x[g, t])
            rows.append(row)
        y = torch.stack(rows)
        total = total + F.mse_loss(y, case_data["target"][g]) + _MOE_ALPHA * r["aux"]
        ys.append(y.detach())
        auxes.append(r["aux"].detach())
        routes.append({key: value for key, value in r.items() if key in ("experts", "kept")})
    total.backward()
    world = x.shape[0]
    return {"y": ys, "aux": auxes, "x_grad": x.grad, "routes": routes,
            "grads": {n: torch.zeros_like(p) if p.grad is None else p.grad / world  # an unused expert: zeros
                      for n, p in full.named_parameters()}}


def _moe_counts(truth: dict, ranks: list[int]) -> torch.Tensor:
    """Kept rows per expert sent by the ranks of `ranks`, (E,)."""
    counts = torch.zeros(_MOE_SIZES["experts"], dtype=torch.int64)
    for r in ranks:
        route = truth["routes"][r]
        counts += torch.bincount(route["experts"][route["kept"]], minlength=_MOE_SIZES["experts"])
    return counts


def _moe_row(rank: int, ep: int) -> list[int]:
    i = rank // ep
    return [i * ep + j for j in range(ep)]


_moe_truths: dict = {}


def _moe_truth_of(name: str) -> dict:
    if name not in _moe_truths:
        k, factor, _ = _MOE_CASES[name]
        _moe_truths[name] = _moe_truth(_moe_data()[name], k, factor)
    return _moe_truths[name]


def _moe_extra_tokens(case_data: dict, how: str, rank: int) -> torch.Tensor:
    x = case_data["x"]
    if how == "negated":
        return -x[rank]
    return x[rank][:0] if how == "none on 1" and rank == 1 else x[rank]


def _moe_extra_loss(y: torch.Tensor, aux: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (y.double() * target[:len(y)].double()).sum() + _MOE_ALPHA * aux


_moe_extra_truths: dict = {}


def _moe_extra_truth(name: str) -> dict:
    """The reference MoE of one process in the case's dtype, one group per rank: the kept rows per expert of
    every group in each forward, and (a case of one forward) each group's y, aux, input gradient, and the
    gradients of the mean of the ranks' losses."""
    if name in _moe_extra_truths:
        return _moe_extra_truths[name]
    dtype, forwards = _MOE_EXTRAS[name]
    k, factor, _ = _MOE_CASES[_MOE_EXTRA_CASE]
    case_data = _moe_data()[_MOE_EXTRA_CASE]
    full = _moe_full(case_data, k, factor).to(dtype)
    counts = []
    for how in forwards:
        per_group = []
        for g in range(_MOE_WORLD):
            tokens = _moe_extra_tokens(case_data, how, g).to(dtype)
            with torch.no_grad():
                r = _naive_route(full.router(tokens), k, _capacity(len(tokens), k, factor))
            per_group.append(torch.bincount(r["experts"][r["kept"]], minlength=_MOE_SIZES["experts"]))
        counts.append(per_group)
    if len(forwards) > 1:  # its test reads the counts only
        _moe_extra_truths[name] = {"counts": counts}
        return _moe_extra_truths[name]
    ys, auxes, x_grads, total = [], [], [], 0.0
    for g in range(_MOE_WORLD):
        x = _moe_extra_tokens(case_data, forwards[-1], g).to(dtype).requires_grad_(True)
        y, aux = full(x.unsqueeze(0))
        total = total + _moe_extra_loss(y[0], aux, case_data["target"][g])
        ys.append(y[0].detach())
        auxes.append(aux.detach())
        x_grads.append(x)
    total.backward()
    truth = {"y": ys, "aux": auxes, "x_grad": [x.grad if x.grad is not None else torch.zeros_like(x) for x in x_grads],
             "counts": counts,
             "grads": {n: torch.zeros_like(p) if p.grad is None else p.grad / _MOE_WORLD
                       for n, p in full.named_parameters()}}
    _moe_extra_truths[name] = truth
    return truth


# ------------------------------------------------------------------ in the ranks


class _AllToAllLog(TorchDispatchMode):
    """Every all-to-all this rank issues while active, seen at the dispatcher: dist.all_to_all_single
    (c10d.alltoall_base_) and torch's functional collectives (_c10d_functional.all_to_all_single) alike.
    Each call: (elements of the input, whether it carries hidden vectors: floating point, 2-D, hidden wide (the
    split sizes may travel in any dtype or shape), the input split sizes)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[int, bool, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = {torch.ops.c10d.alltoall_base_.default: "input",
                torch.ops._c10d_functional.all_to_all_single.default: "input"}.get(func)
        if name is not None:
            bound = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
            x = bound["input"]
            rows = x.is_floating_point() and x.dim() == 2 and x.shape[-1] == _MOE_SIZES["hidden"]
            self.calls.append((x.numel(), rows, tuple(int(s) for s in bound["input_split_sizes"])))
        return func(*args, **kwargs)


def _moe_error(exc: BaseException) -> dict:
    return {"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}


def _moe_cpu(t):
    return None if t is None else t.detach().cpu().clone()


def _moe_step(layer_cls, sync, case_data: dict, k: int, factor, groups, unused_to_none: bool) -> dict:
    """Forward this rank's tokens, backward its loss, sync the gradients; what each step produced.
    unused_to_none: the gradients of the experts that got no row here are set to None before the sync,
    on the first rank of each column only (a replica that took no part while its twin did)."""
    rank = dist.get_rank()
    model = layer_cls.from_full(_moe_full(case_data, k, factor), group=groups.ep)
    x = case_data["x"][rank].clone().requires_grad_(True)
    with _AllToAllLog() as fwd:
        y, aux = model(x)
    loss = F.mse_loss(y, case_data["target"][rank]) + _MOE_ALPHA * aux
    with _AllToAllLog() as bwd:
        loss.backward()
    counts = _moe_cpu(model.tokens_per_expert)
    if unused_to_none and rank < dist.get_world_size(groups.ep):
        for i, expert in enumerate(model.experts):
            if counts[i] == 0:
                for p in expert.parameters():
                    p.grad = None
    sync(model, groups)
    return {"y": _moe_cpu(y), "aux": _moe_cpu(aux), "x_grad": _moe_cpu(x.grad), "counts": counts,
            "grads": {n: _moe_cpu(p.grad) for n, p in model.named_parameters()},
            "x_changed": not torch.equal(x.detach(), case_data["x"][rank]), "fwd": fwd.calls, "bwd": bwd.calls}


def _moe_extra_step(layer_cls, sync, case_data: dict, name: str, groups) -> dict:
    """One of _MOE_EXTRAS: the layer in its dtype, its forwards in turn (tokens_per_expert after each), the
    backward of the last one's loss, the reference's sync."""
    rank = dist.get_rank()
    dtype, forwards = _MOE_EXTRAS[name]
    k, factor, _ = _MOE_CASES[_MOE_EXTRA_CASE]
    model = layer_cls.from_full(_moe_full(case_data, k, factor), group=groups.ep).to(dtype)
    counts = []
    for how in forwards:
        x = _moe_extra_tokens(case_data, how, rank).to(dtype).requires_grad_(True)
        y, aux = model(x)
        counts.append(_moe_cpu(model.tokens_per_expert))
    _moe_extra_loss(y, aux, case_data["target"][rank]).backward()
    sync(model, groups)
    return {"y": _moe_cpu(y), "aux": _moe_cpu(aux), "x_grad": _moe_cpu(x.grad), "counts": counts,
            "grads": {n: _moe_cpu(p.grad) for n, p in model.named_parameters()}}


def _moe_layer_rank(ref: grading.ModuleRef, data: dict, which: str) -> dict:
    """which: "forward" (your layer, the reference's sync) or "sync" (the reference's layer, your sync).
    The forward world then runs _MOE_EXTRAS too."""
    mod, reference = ref.load(), grading.reference("2.10")
    groups = {ep: reference.build_expert_groups(ep) for ep in _MOE_LAYOUTS}  # every rank, same order
    layer_cls, sync = ((mod.ExpertParallelMoE, reference.sync_gradients) if which == "forward" else
                       (reference.ExpertParallelMoE, mod.sync_gradients))
    out = {}
    for ep in _MOE_LAYOUTS:
        for name, (k, factor, _) in _MOE_CASES.items():
            try:
                out[ep, name] = _moe_step(layer_cls, sync, data[name], k, factor, groups[ep], which == "sync")
            except Exception as exc:  # noqa: BLE001 - reported by the tests; stop: the others would be out of step
                out[ep, name] = {"error": _moe_error(exc)}
                return out
    for ep in _MOE_LAYOUTS if which == "forward" else ():
        for name in _MOE_EXTRAS:
            try:
                out["extra", ep, name] = _moe_extra_step(layer_cls, sync, data[_MOE_EXTRA_CASE], name, groups[ep])
            except Exception as exc:  # noqa: BLE001 - as above
                out["extra", ep, name] = {"error": _moe_error(exc)}
                return out
    k, factor, _ = _MOE_CASES[_MOE_DEFAULT_CASE]
    for spelling in _MOE_DEFAULT_GROUPS if which == "forward" else ():
        group = None if spelling.startswith("group=None") else dist.group.WORLD
        try:  # the reference's sync reads groups.expert_dp only
            out["group", spelling] = _moe_step(layer_cls, sync, data[_MOE_DEFAULT_CASE], k, factor,
                                               dataclasses.replace(groups[_MOE_WORLD], ep=group), False)
        except Exception as exc:  # noqa: BLE001 - as above
            out["group", spelling] = {"error": _moe_error(exc)}
            return out
    return out


def _moe_forward_rank(ref: grading.ModuleRef, data: dict) -> dict:
    return _moe_layer_rank(ref, data, "forward")


def _moe_sync_rank(ref: grading.ModuleRef, data: dict) -> dict:
    return _moe_layer_rank(ref, data, "sync")


def _a2a_data() -> dict:
    """Rows per (sender, receiver), zeros included: rank 3 sends nothing, rank 0 gets nothing from 1 and 2,
    in the world of 4; in each half {0, 1}, {2, 3}: rank 1 sends nothing to 0, rank 2 nothing at all.
    x3, g3: rows of shape (2, 3) (x of shape (n, 2, 3)) on the world's splits."""
    world = [[2, 3, 0, 1], [0, 1, 4, 2], [0, 2, 1, 3], [0, 0, 0, 0]]
    halves = [[1, 2], [0, 3], [0, 0], [2, 1]]  # rank r's sends to rank 0 and 1 of its half
    with torch.random.fork_rng():
        torch.manual_seed(3)
        return {"world": world, "halves": halves,
                "x": [torch.randn(sum(s), 3) for s in world], "g": [torch.randn(sum(col), 3) for col in zip(*world)],
                "x3": [torch.randn(sum(s), 2, 3) for s in world],
                "g3": [torch.randn(sum(col), 2, 3) for col in zip(*world)],
                "x_half": [torch.randn(sum(s), 3) for s in halves],
                "g_half": [torch.randn(sum(halves[2 * (r // 2) + q][r % 2] for q in range(2)), 3)
                           for r in range(_MOE_WORLD)]}


def _a2a_call(mod, x: torch.Tensor, g: torch.Tensor, send: list[int], recv: list[int], group, how: str) -> dict:
    x_given, g_given = x.clone().requires_grad_(True), g.clone()
    if how == "not contiguous":  # the same values, strided in memory
        x_given = x.t().contiguous().t().requires_grad_(True)
        g_given = g.t().contiguous().t()
    args = (x_given, list(send), list(recv)) + (() if how == "default group" else (group,))
    y = mod.all_to_all(*args)
    out = {"y": _moe_cpu(y), "x_grad": None, "x_changed": not torch.equal(x_given.detach(), x)}
    if tuple(y.shape) == tuple(g.shape):
        y.backward(g_given)
        out["x_grad"] = _moe_cpu(x_given.grad)
        out["g_changed"] = not torch.equal(g_given, g)
    return out


def _a2a_rank(ref: grading.ModuleRef, data: dict) -> dict:
    mod, reference, rank = ref.load(), grading.reference("2.10"), dist.get_rank()
    half = reference.build_expert_groups(2).ep  # {0, 1} or {2, 3}
    world, halves = data["world"], data["halves"]
    me = rank % 2
    peers = [2 * (rank // 2) + q for q in range(2)]
    cases = {
        "world, group=None": (data["x"][rank], data["g"][rank], world[rank], [world[q][rank] for q in range(4)], None),
        "world, no group argument": (data["x"][rank], data["g"][rank], world[rank],
                                     [world[q][rank] for q in range(4)], None),
        "world, group=dist.group.WORLD spelled out": (data["x"][rank], data["g"][rank], world[rank],
                                                      [world[q][rank] for q in range(4)], dist.group.WORLD),
        "world, rows of shape (2, 3): x of shape (n, 2, 3)": (data["x3"][rank], data["g3"][rank], world[rank],
                                                               [world[q][rank] for q in range(4)], None),
        "world, x not contiguous": (data["x"][rank], data["g"][rank], world[rank],
                                    [world[q][rank] for q in range(4)], None),
        "the group of ranks {0, 1} or {2, 3}": (data["x_half"][rank], data["g_half"][rank], halves[rank],
                                               [halves[q][me] for q in peers], half),
    }
    hows = {"world, no group argument": "default group", "world, x not contiguous": "not contiguous"}
    out = {}
    for name, (x, g, send, recv, group) in cases.items():
        try:
            out[name] = _a2a_call(mod, x, g, send, recv, group, hows.get(name, ""))
        except Exception as exc:  # noqa: BLE001 - reported by the test; stop: the others would be out of step
            out[name] = {"error": _moe_error(exc)}
            return out
    return out


# ------------------------------------------------------------------ here: worlds and checks


_moe_worlds: dict = {}  # (ModuleRef, worker name) -> per-rank results, or the exception the world raised


def _moe_results(ref: grading.ModuleRef, worker, *args) -> list:
    key = (ref, worker.__name__)
    if key not in _moe_worlds:
        try:
            _moe_worlds[key] = run_world(worker, _MOE_WORLD, args=(ref, *args))
        except WorldError as exc:
            _moe_worlds[key] = exc
            raise
    results = _moe_worlds[key]
    if isinstance(results, BaseException):
        pytest.fail(f"not run: the world of {_MOE_WORLD} ranks failed (see the first 2.10 test that ran): "
                    f"{str(results).splitlines()[0]}")
    return results


def _moe_raise(rank: int, error: dict, what: str) -> None:
    """A rank's exception, raised again here (a TODO stays TODO)."""
    if error["error"] == "NotImplementedError" and error["message"].startswith("TODO"):
        raise NotImplementedError(error["message"])
    pytest.fail(f"rank {rank} of {_MOE_WORLD} raised {error['error']} in {what}: {error['message']}\n{error['traceback']}")


def _moe_layer(ref: grading.ModuleRef, worker, what: str) -> list:
    results = _moe_results(ref, worker, _moe_data())
    for ep in _MOE_LAYOUTS:
        for name in _MOE_CASES:
            for rank, result in enumerate(results):
                got = result.get((ep, name))
                if got is None:
                    pytest.fail(f"rank {rank}: not run (an earlier case failed on another rank)")
                if "error" in got:
                    _moe_raise(rank, got["error"], f"{what}, ep={ep}, {name}")
    return results


def _moe_expert_name(local_name: str, rank: int, ep: int) -> str:
    """experts.<i>.x on rank (i, j) of the mesh is experts.<j*E/ep + i>.x of the unsharded MoE."""
    if not local_name.startswith("experts."):
        return local_name
    _, i, rest = local_name.split(".", 2)
    return f"experts.{(rank % ep) * (_MOE_SIZES['experts'] // ep) + int(i)}.{rest}"


def _moe_grad_problems(got: dict, truth: dict, rank: int, ep: int, where: str, tol: dict = _MOE_TOL) -> list[str]:
    problems = []
    expected = {n for n in truth["grads"] if not n.startswith("experts.")} | {
        _moe_expert_name(f"experts.{i}.{rest}", rank, ep) for i in range(_MOE_SIZES["experts"] // ep)
        for rest in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")}
    seen = set()
    for local, grad in got["grads"].items():
        name = _moe_expert_name(local, rank, ep)
        seen.add(name)
        if name not in truth["grads"]:
            problems.append(f"{where}: a parameter {local} that the MoE has no counterpart for")
            continue
        problem = (f"{where}: {local} ({name} of the MoE) has no gradient after the sync" if grad is None else
                   diff_report(grad, truth["grads"][name], f"{where}: gradient of {local} ({name} of the MoE)",
                               **tol))
        if problem:
            problems.append(problem)
    problems += [f"{where}: no parameter for {name}" for name in sorted(expected - seen)]
    return problems


def _moe_layer_problems(results: list, check) -> list[str]:
    problems = []
    for ep in _MOE_LAYOUTS:
        for name in _MOE_CASES:
            truth = _moe_truth_of(name)
            for rank, result in enumerate(results):
                problems += check(result[ep, name], truth, rank, ep,
                                  f"ep={ep} (rank {rank} of {_MOE_WORLD}, experts "
                                  f"{(rank % ep) * (_MOE_SIZES['experts'] // ep)}.."
                                  f"{(rank % ep + 1) * (_MOE_SIZES['experts'] // ep) - 1}), {name}")
    return problems


def test_moe_cases_are_what_they_claim():
    """Not graded: the test's own data has drops where it says so, none where it does not, unused experts,
    and uneven all-to-alls with empty splits (a check of this file, not of any solution)."""
    problems = []
    for name, (k, factor, empty) in _MOE_CASES.items():
        truth = _moe_truth_of(name)
        dropped = sum(int((~r["kept"]).sum()) for r in truth["routes"])
        if (factor is None) != (dropped == 0):
            problems.append(f"{name}: {dropped} assignments dropped")
        counts = _moe_counts(truth, list(range(_MOE_WORLD)))
        if empty != bool((counts[list(_MOE_EMPTY)] == 0).all()):
            problems.append(f"{name}: tokens per expert {counts.tolist()}")
    assert not problems, problems


def test_moe_tie_dtype_and_extra_cases_are_what_they_claim():
    """Not graded: the route cases of ties and dtypes and the extra layer cases can tell a wrong solution apart
    (a check of this file, not of any solution)."""
    problems = []

    def order(values: torch.Tensor) -> torch.Tensor:  # the experts by value, best first, ties to the lower index
        return values.sort(dim=-1, descending=True, stable=True).indices

    near, _, _ = next(iter(_route_tie_cases().values()))
    probs = torch.softmax(near, dim=-1)
    if not all(bool((probs[t, :, None] == probs[t, None, :]).logical_and(near[t, :, None] != near[t, None, :]).any())
               for t in range(len(near))):
        problems.append("a row of the 1e-8 cases has no two experts with equal probabilities and different logits")
    if torch.equal(order(probs)[:, :2], order(near)[:, :2]):
        problems.append("ranking the 1e-8 cases by their logits gives the contract's top 2")
    many, _, _ = list(_route_tie_cases().values())[-1]
    p_many = torch.softmax(many, dim=-1)
    for t in (3, 4):
        if not (bool((p_many[t] == p_many[t, 0]).all()) and len(set(many[t].tolist())) == many.shape[1] > 16):
            problems.append(f"40 experts, row {t}: not 40 different logits with equal float32 probabilities")
    told_apart = set()
    for logits, _, _ in _route_dtype_cases().values():
        as_is = torch.softmax(logits, dim=-1)  # in the logits' own dtype
        if not torch.equal(order(as_is)[:, :2], order(torch.softmax(logits.float(), dim=-1))[:, :2]):
            told_apart.add(logits.dtype)
    if told_apart != {torch.bfloat16, torch.float64}:
        problems.append(f"probabilities in the logits' dtype give float32's top 2 in every case but {told_apart}")
    data = _moe_data()[_MOE_EXTRA_CASE]
    counts = _moe_extra_truth("two forwards, the first on other tokens (-x)")["counts"]
    for ep in _MOE_LAYOUTS:
        firsts = [sum(counts[0][q] for q in _moe_row(r, ep)) for r in range(0, _MOE_WORLD, ep)]
        seconds = [sum(counts[1][q] for q in _moe_row(r, ep)) for r in range(0, _MOE_WORLD, ep)]
        if any(torch.equal(a, b) for a, b in zip(firsts, seconds)):
            problems.append(f"ep={ep}: two forwards give the same tokens per expert in a row of the mesh")
        if any(torch.equal(a + b, b) for a, b in zip(firsts, seconds)):
            problems.append(f"ep={ep}: a running total would equal the second forward's counts")
        none = _moe_extra_truth("rank 1 has no tokens")["counts"][0]
        local = _MOE_SIZES["experts"] // ep
        if int(sum(none[q] for q in _moe_row(1, ep))[local:2 * local].sum()) == 0:
            problems.append(f"ep={ep}: the experts of rank 1 (no tokens) receive no row from its peers")
    if len(_moe_extra_tokens(data, "none on 1", 1)) != 0:
        problems.append("rank 1 has tokens in the case that says it has none")
    assert not problems, problems


def test_moe_reference_layer_matches_the_naive_loop():
    """Not graded: the reference's single-process MoE equals the loop written from the contract."""
    problems = []
    for name, (k, factor, _) in _MOE_CASES.items():
        case_data, truth = _moe_data()[name], _moe_truth_of(name)
        full = _moe_full(case_data, k, factor)
        x = case_data["x"].clone().requires_grad_(True)
        y, aux = full(x)
        world = x.shape[0]
        loss = sum(F.mse_loss(y[g], case_data["target"][g]) for g in range(world)) + _MOE_ALPHA * world * aux
        loss.backward()
        problems += [p for p in [diff_report(y, torch.stack(truth["y"]), f"{name}: y", **_MOE_TOL),
                                 diff_report(aux, torch.stack(truth["aux"]).mean(), f"{name}: aux", **_MOE_TOL),
                                 diff_report(x.grad, truth["x_grad"], f"{name}: x.grad", **_MOE_TOL)] if p]
        problems += [p for n, param in full.named_parameters()
                     if (p := diff_report(torch.zeros_like(param) if param.grad is None else param.grad / world,
                                          truth["grads"][n], f"{name}: {n}", **_MOE_TOL))]
    assert_no_problems(problems, "the reference MoE differs from the contract's loop:")


# ------------------------------------------------------------------ route


def _route_cases() -> dict:
    """name: (logits, k, capacity). Random logits; rows with ties (all equal, first place, the k-th place,
    equal values at non-adjacent experts); an expert with probability 0; capacities that drop and not."""
    cases = {}
    with torch.random.fork_rng():
        torch.manual_seed(5)
        random = torch.randn(10, 6)
        ties = torch.tensor([[0.5] * 6,
                             [0.1, 2.0, 0.3, 2.0, -1.0, 0.0],
                             [3.0, 1.0, -0.5, 1.0, 1.0, 0.2],
                             [0.0, 0.7, 0.7, -0.2, 0.7, 0.1],
                             [-1.0, 0.4, 1.5, 0.4, 1.5, 0.4],
                             [2.0, 2.0, 2.0, 0.0, 0.0, 0.0],
                             [0.3, -0.3, 0.3, -0.3, 0.3, -0.3]])
        skewed = torch.randn(12, 6) + torch.tensor([2.0, 1.0, 0.0, 0.0, 0.0, 0.0])
        skewed[:, 5] = -1e4  # expert 5: probability 0, never chosen
    for k in (1, 2):
        for capacity in (10, 3, 1, 0):
            cases[f"random logits (10 tokens, 6 experts), k={k}, capacity {capacity}"] = (random, k, capacity)
        for capacity in (7, 2, 1):
            cases[f"tied logits, k={k}, capacity {capacity}"] = (ties, k, capacity)
        for capacity in (12, 4):
            cases[f"logits skewed to experts 0 and 1, expert 5 never chosen, k={k}, capacity {capacity}"] = \
                (skewed, k, capacity)
    cases["random logits, k=3, capacity 4"] = (random, 3, 4)
    return cases


_ROUTE_TOL = {torch.bfloat16: dict(rtol=1e-2, atol=1e-3)}  # a bf16 logit's gradient: float32's, rounded once


def _route_problems(mod, cases: dict, dtypes: bool = False) -> list[str]:
    """route(logits, k, capacity) against the contract's loop for each case: experts, kept, weights, aux,
    the logits' gradient, the logits unchanged. dtypes: weights and aux_loss must be float32 (else any
    floating dtype passes here)."""
    problems = []
    for name, (logits, k, capacity) in cases.items():
        with torch.random.fork_rng():
            torch.manual_seed(7)
            upstream = torch.randn(logits.shape[0], k)
        truth_logits = logits.clone().requires_grad_(True)
        truth = _naive_route(truth_logits, k, capacity)
        ((truth["weights"] * upstream).sum() + 0.7 * truth["aux"]).backward()
        given = logits.clone().requires_grad_(True)
        r = mod.route(given, k, capacity)
        where = f"route({name})"
        before = len(problems)
        for key, value in (("experts", r.experts), ("kept", r.kept)):
            value = torch.as_tensor(value)
            if tuple(value.shape) != tuple(truth[key].shape):
                problems.append(f"{where}: {key} has shape {tuple(value.shape)}, expected {tuple(truth[key].shape)}")
            elif not torch.equal(value.to(truth[key].dtype), truth[key]):
                bad = (value.to(truth[key].dtype) != truth[key]).nonzero()[0].tolist()
                problems.append(f"{where}: {key}[{bad[0]}] = {value[bad[0]].tolist()}, expected "
                                f"{truth[key][bad[0]].tolist()} (token {bad[0]}, logits "
                                f"{[float(f'{v:.4g}') for v in logits[bad[0]].tolist()]}, float32 probabilities "
                                f"{[round(v, 9) for v in torch.softmax(logits[bad[0]].float(), -1).tolist()]})")
        for key, value in (("weights", r.weights), ("aux_loss", r.aux_loss)):
            expected = truth["weights" if key == "weights" else "aux"].detach()
            value = torch.as_tensor(value).detach()
            if dtypes and value.dtype != torch.float32:
                problems.append(f"{where}: {key} is {value.dtype}, expected torch.float32 (the probabilities are "
                                f"softmax(logits.float()) whatever the logits' dtype)")
                continue
            problem = diff_report(value.float().reshape(expected.shape) if value.numel() == expected.numel()
                                  else value, expected, f"{where}: {key}", **_MOE_TOL)
            if problem:
                problems.append(problem)
        if not torch.equal(given.detach(), logits):
            problems.append(f"{where}: the logits were modified")
        if len(problems) > before:
            continue  # the gradient follows from the values
        try:
            ((r.weights * upstream).sum() + 0.7 * r.aux_loss).backward()
        except RuntimeError as exc:
            problems.append(f"{where}: backward through weights and aux_loss failed: {exc}")
            continue
        if given.grad is None and logits.numel() == 0:
            continue  # no logits, no gradient to check
        problem = (f"{where}: the logits got no gradient through weights and aux_loss" if given.grad is None else
                   diff_report(given.grad, truth_logits.grad, f"{where}: gradient of the logits "
                               "(upstream: random weights' gradient + 0.7 x aux)",
                               **_ROUTE_TOL.get(logits.dtype, _MOE_TOL)))
        if problem:
            problems.append(problem)
    return problems


def test_2_10_route_top_k_capacity_and_balancing_loss(grade):
    problems = _route_problems(grade("2.10").load(), _route_cases())
    assert_no_problems(problems, "route: top-k by probability, ties to the lower expert index; gates = p (k=1) or "
                                 "p renormalised over the k (k>=2); slots claimed in (choice, token) order; aux = "
                                 "E * sum_i f_i P_i with f_i the share of first choices, dropped or not (moe.py's "
                                 "docstring):")


def _route_tie_cases() -> dict:
    """name: (logits, k, capacity). Ties of the float32 probabilities: logits that differ (by 1e-8 or less)
    but give equal probabilities, and many experts (E = 40 > 16, where torch.sort without stable=True
    reorders equal values on CPU, torch 2.14.1)."""
    near = torch.tensor([[0.0, 1e-8, -1.0, -2.0],  # p_0 == p_1, z_1 > z_0: expert 0 first
                         [-2.0, -1.0, 0.0, 1e-8],  # p_2 == p_3: expert 2 first
                         [3.0, 0.0, 2e-9, 1e-9],  # a tie of 1, 2, 3 at the second place, logits in reverse
                         [0.0, 3e-9, 1e-9, 2e-9],  # all four equal
                         [1e-8, 0.0, -1.0, -2.0]])  # here the logits' order is the contract's
    with torch.random.fork_rng():
        torch.manual_seed(11)
        many = torch.randint(0, 3, (12, 40)).float()  # values 0, 1, 2: ~13 experts tied on each
    many[0] = 0.0  # all 40 equal
    many[1] = 0.0
    many[1, 20:] = 1.0  # 20 tied at the top, from index 20 on
    many[2] = 0.0
    many[2, 35] = 2.0  # one best, then 39 tied
    many[3] = 1e-10 * torch.arange(40)  # 40 different logits, 40 equal float32 probabilities
    many[4] = -1e-10 * torch.arange(40)
    cases = {}
    for k in (1, 2):
        for capacity in (5, 1):
            cases[f"logits that differ by 1e-8 or less (equal float32 probabilities), k={k}, capacity {capacity}"] = \
                (near, k, capacity)
    for k in (1, 2, 3):
        for capacity in (12, 1):
            cases[f"40 experts, ties among more than 16 of them, k={k}, capacity {capacity}"] = (many, k, capacity)
    return cases


def test_2_10_route_ties_decided_on_the_float32_probabilities(grade):
    problems = _route_problems(grade("2.10").load(), _route_tie_cases())
    assert_no_problems(problems, "route: equal float32 probabilities go to the LOWER expert index first, for any "
                                 "number of experts and also where the logits differ (0 and 1e-8 give equal "
                                 "probabilities): rank the experts by softmax(logits.float()) with a stable order:")


def _route_dtype_cases() -> dict:
    """name: (logits, k, capacity): bf16 and float64 logits. bf16 probabilities would tie or reorder where the
    float32 ones do not; float64 ones would tell apart logits 1e-12 apart, which float32's do not."""
    with torch.random.fork_rng():
        torch.manual_seed(6)
        wide = torch.randn(64, 6) * 3
    close = torch.tensor([[0.0, 1e-3, -1.0, -3.0, -3.0, -1.0],  # equal bf16 probabilities, p_1 > p_0 in float32
                          [0.0, 5e-4, -1.0, -3.0, -3.0, -1.0],
                          [3.0, 0.0, 1e-3, -1.0, -3.0, -1.0]])
    fine = torch.tensor([[0.0, 1e-12, -1.0, -2.0, -3.0, -4.0],
                         [-1.0, 0.5, 0.5 + 1e-12, 0.5 - 1e-12, -2.0, 0.0]], dtype=torch.float64)
    cases = {}
    for k in (1, 2):
        for capacity in (64, 12):
            cases[f"bfloat16 logits (67 tokens, 6 experts), k={k}, capacity {capacity}"] = \
                (torch.cat([close, wide]).bfloat16(), k, capacity)
            cases[f"float64 logits (64 tokens, 6 experts), k={k}, capacity {capacity}"] = (wide.double(), k, capacity)
        cases[f"float64 logits 1e-12 apart, k={k}, capacity 1"] = (fine, k, 1)
    return cases


def test_2_10_route_is_float32_for_bf16_and_float64_logits(grade):
    problems = _route_problems(grade("2.10").load(), _route_dtype_cases(), dtypes=True)
    assert_no_problems(problems, "route: whatever the logits' dtype, the probabilities are softmax(logits.float()), "
                                 "every decision is made on them, and weights and aux_loss are float32:")


def _route_few_tokens_cases() -> dict:
    with torch.random.fork_rng():
        torch.manual_seed(12)
        one = torch.randn(1, 6)
    cases = {}
    for k in (1, 2):
        cases[f"no tokens (0 x 6 logits), k={k}, capacity 0"] = (torch.zeros(0, 6), k, 0)
        for capacity in (1, 0):
            cases[f"one token, k={k}, capacity {capacity}"] = (one, k, capacity)
    return cases


def test_2_10_route_of_no_tokens_and_of_one_token(grade):
    problems = _route_problems(grade("2.10").load(), _route_few_tokens_cases())
    assert_no_problems(problems, "route of T = 0 tokens: experts, weights and kept of shape (0, k) and aux_loss 0 "
                                 "(not the NaN of a mean over no token, which the gradient sync would spread to every "
                                 "rank); of T = 1: f is that token's first choice:")


# ------------------------------------------------------------------ all_to_all


def test_2_10_all_to_all_uneven_splits_forward_and_backward(grade):
    results = _moe_results(grade("2.10"), _a2a_rank, _a2a_data())
    for rank, result in enumerate(results):
        for name, got in result.items():
            if "error" in got:
                _moe_raise(rank, got["error"], f"all_to_all ({name})")
    data = _a2a_data()
    world, halves = data["world"], data["halves"]
    problems = []

    def block(rows, splits, q):  # the rows of a sender destined to its q-th peer
        start = sum(splits[:q])
        return rows[start:start + splits[q]]

    for rank, result in enumerate(results):
        peers, me = [2 * (rank // 2) + q for q in range(2)], rank % 2
        # output: what each rank sent here; gradient of x: block q of x went to rank q, whose upstream
        # gradient holds it at the block of this rank
        world_y = torch.cat([block(data["x"][q], world[q], rank) for q in range(4)])
        world_grad = torch.cat([block(data["g"][q], [world[s][q] for s in range(4)], rank) for q in range(4)])
        half_y = torch.cat([block(data["x_half"][q], halves[q], me) for q in peers])
        half_grad = torch.cat([block(data["g_half"][q], [halves[s][q % 2] for s in peers], me) for q in peers])
        rows_y = torch.cat([block(data["x3"][q], world[q], rank) for q in range(4)])
        rows_grad = torch.cat([block(data["g3"][q], [world[s][q] for s in range(4)], rank) for q in range(4)])
        for name, got in result.items():
            y, x_grad = ((half_y, half_grad) if "group of ranks" in name else
                         (rows_y, rows_grad) if "rows of shape" in name else (world_y, world_grad))
            where = f"all_to_all, {name}, rank {rank} of {_MOE_WORLD}"
            problem = diff_report(got["y"], y, f"{where}: output", 0, 0) or (
                f"{where}: the input got no gradient" if got["x_grad"] is None else
                diff_report(got["x_grad"], x_grad, f"{where}: gradient of x", 0, 0))
            if problem:
                problems.append(problem)
            if got.get("x_changed"):
                problems.append(f"{where}: x was modified")
            if got.get("g_changed"):
                problems.append(f"{where}: backward modified the upstream gradient it was given")
    assert_no_problems(problems, "all_to_all(x, send_splits, recv_splits, group): rank r's rows send_splits[q] go to "
                                 "rank q of the group (None: the default group, the world); a row is x[i], whatever "
                                 "its shape; the output holds what each rank sent to r, in rank order; backward "
                                 "sends each row's gradient back where the row came from (splits 0 included):")


# ------------------------------------------------------------------ the layer


def _moe_forward_check(got: dict, truth: dict, rank: int, ep: int, where: str) -> list[str]:
    problems = []
    for what, value, expected in (("output y", got["y"], truth["y"][rank]), ("aux loss", got["aux"], truth["aux"][rank]),
                                  ("input gradient", got["x_grad"], truth["x_grad"][rank])):
        if value is None:
            problems.append(f"{where}: the input got no gradient")
            continue
        problem = diff_report(value.reshape(expected.shape) if value.numel() == expected.numel() else value,
                              expected, f"{where}: {what}", **_MOE_TOL)
        if problem:
            problems.append(problem)
            break  # the rest follows from it
    else:
        problems += _moe_grad_problems(got, truth, rank, ep, where + ", after backward and the reference's sync")
    if got["x_changed"]:
        problems.append(f"{where}: forward modified its input x")
    return problems


def test_2_10_expert_parallel_layer_equals_one_process(grade):
    results = _moe_layer(grade("2.10"), _moe_forward_rank, "ExpertParallelMoE.forward")
    problems = _moe_layer_problems(results, _moe_forward_check)
    assert_no_problems(problems, "ExpertParallelMoE on a world of 4 (ep = 4, and ep = 2 twice over) must equal the "
                                 "MoE of one process on each rank's tokens: output, aux loss, input gradient, and "
                                 "every parameter's gradient once the reference's sync_gradients has run:")


def _moe_bytes_check(got: dict, truth: dict, rank: int, ep: int, where: str) -> list[str]:
    h, local = _MOE_SIZES["hidden"], _MOE_SIZES["experts"] // ep
    row, j = _moe_row(rank, ep), rank % ep
    route = truth["routes"][rank]
    sent = torch.bincount(route["experts"][route["kept"]], minlength=_MOE_SIZES["experts"])
    send = tuple(int(n) for n in sent.view(ep, local).sum(1))
    recv = tuple(int(_moe_counts(truth, [q])[j * local:(j + 1) * local].sum()) for q in row)
    want = sorted([(sum(send) * h, True, send), (sum(recv) * h, True, recv)])
    problems = []
    for phase in ("fwd", "bwd"):
        calls = sorted(c for c in got[phase] if c[1])
        if calls != want:
            text = ", ".join(f"{n} elements split {list(s)}" for n, _, s in calls) or "none"
            problems.append(f"{where}: the {'forward' if phase == 'fwd' else 'backward'} made all-to-alls of rows "
                            f"(hidden-wide vectors) of [{text}]; expected exactly two: the dispatch of this rank's "
                            f"{sum(send)} kept rows x {h} = {sum(send) * h} elements split {list(send)} by destination, "
                            f"and the return of the {sum(recv)} rows it received ({sum(recv) * h} elements split "
                            f"{list(recv)} by source)")
    return problems


def test_2_10_all_to_all_bytes_match_the_cost_model(grade):
    results = _moe_layer(grade("2.10"), _moe_forward_rank, "ExpertParallelMoE.forward")
    problems = _moe_layer_problems(results, _moe_bytes_check)
    assert_no_problems(problems, "per layer and pass, one all-to-all sends exactly the kept rows (no padding to capacity, "
                                 "no dropped row) to their experts' ranks, one brings the results back; the split sizes "
                                 "travel first, in an exchange of their own (not counted here):")


def _moe_counts_check(got: dict, truth: dict, rank: int, ep: int, where: str) -> list[str]:
    local, j = _MOE_SIZES["experts"] // ep, rank % ep
    expected = _moe_counts(truth, _moe_row(rank, ep))[j * local:(j + 1) * local]
    problem = diff_report(torch.as_tensor(got["counts"]).long().reshape(-1), expected,
                          f"{where}: tokens_per_expert", 0, 0)
    return [problem] if problem else []


def test_2_10_tokens_per_expert_give_the_load_imbalance(grade):
    results = _moe_layer(grade("2.10"), _moe_forward_rank, "ExpertParallelMoE.forward")
    problems = _moe_layer_problems(results, _moe_counts_check)
    reference = grading.reference("2.10")
    if not problems:  # the layer's counts, put together per row of the mesh, give the imbalance of the routing
        for ep in _MOE_LAYOUTS:
            for name, (_, factor, empty) in _MOE_CASES.items():
                truth = _moe_truth_of(name)
                for row_start in range(0, _MOE_WORLD, ep):
                    counts = torch.cat([results[r][ep, name]["counts"].long() for r in range(row_start, row_start + ep)])
                    got = reference.load_imbalance(counts)
                    want = reference.load_imbalance(_moe_counts(truth, list(range(row_start, row_start + ep))))
                    if abs(got - want) > 1e-9 or (empty and got <= 1.0):
                        problems.append(f"ep={ep}, ranks {row_start}..{row_start + ep - 1}, {name}: load imbalance "
                                        f"{got:.3f}, expected {want:.3f}")
    assert_no_problems(problems, "after forward, tokens_per_expert[i] = the rows local expert i processed (kept "
                                 "assignments from every rank of the ep group); max / mean of them over the group "
                                 "is the load imbalance:")


def _moe_extras(ref: grading.ModuleRef, names) -> list:
    """The forward world's results; a rank's exception in one of the cases `names` of _MOE_EXTRAS raised again."""
    results = _moe_layer(ref, _moe_forward_rank, "ExpertParallelMoE.forward")
    for ep in _MOE_LAYOUTS:
        for name in names:
            for rank, result in enumerate(results):
                got = result.get(("extra", ep, name))
                if got is None:
                    failed = next((f"ep={key[1]}, {key[2]}" for r in results for key, value in r.items()
                                   if key[0] == "extra" and "error" in value), "an earlier case")
                    pytest.fail(f"rank {rank}: ep={ep}, {name}: not run ({failed} failed first, on some rank)")
                if "error" in got:
                    _moe_raise(rank, got["error"], f"ExpertParallelMoE.forward, ep={ep}, {name}")
    return results


def _moe_extra_problems(results: list, names, grads: bool = True) -> list[str]:
    """Each rank's output, aux, input gradient and (grads) every gradient after the reference's sync, in the
    case's dtype, against the reference MoE of one process in that dtype."""
    problems = []
    for ep in _MOE_LAYOUTS:
        for name in names:
            truth, tol = _moe_extra_truth(name), _MOE_EXTRA_TOL[_MOE_EXTRAS[name][0]]
            for rank, result in enumerate(results):
                got, local = result["extra", ep, name], _MOE_SIZES["experts"] // ep
                where = (f"ExpertParallelMoE.forward, ep={ep} (rank {rank} of {_MOE_WORLD}, experts "
                         f"{(rank % ep) * local}..{(rank % ep + 1) * local - 1}), {name}")
                found = []
                for what, key, tolerance in (("output y", "y", tol), ("aux loss", "aux", _MOE_TOL),
                                             ("input gradient", "x_grad", tol)):
                    value, expected = got[key], truth[key][rank]
                    if value is None and not (key == "x_grad" and expected.numel() == 0):
                        found.append(f"{where}: the {what} is None")
                    elif value is not None:
                        problem = diff_report(value, expected, f"{where}: {what}", **tolerance)
                        if problem:
                            found.append(problem)
                if not found and grads:
                    found = _moe_grad_problems(got, truth, rank, ep, where + ", after backward and the reference's "
                                               "sync", tol)
                problems += found
    return problems


def test_2_10_layer_output_in_the_dtype_of_x(grade):
    names = ("bfloat16", "float64")
    problems = _moe_extra_problems(_moe_extras(grade("2.10"), names), names)
    assert_no_problems(problems, "ExpertParallelMoE in bfloat16 and in float64 (the layer and x in that dtype) must "
                                 "equal the MoE of one process in that dtype: y in x's dtype, aux float32 (routing "
                                 "on softmax(logits.float())), the input gradient and every parameter's gradient:")


def test_2_10_layer_with_a_rank_that_has_no_tokens(grade):
    names = ("rank 1 has no tokens",)
    problems = _moe_extra_problems(_moe_extras(grade("2.10"), names), names)
    assert_no_problems(problems, "ExpertParallelMoE with T = 0 tokens on rank 1: its y is (0, hidden) and its aux 0, "
                                 "yet it joins every all-to-all (its experts serve its peers' rows, forward and "
                                 "backward); every output and gradient equals the MoE of one process:")


def test_2_10_tokens_per_expert_counted_anew_each_forward(grade):
    name = "two forwards, the first on other tokens (-x)"
    results, truth = _moe_extras(grade("2.10"), (name,)), _moe_extra_truth(name)
    problems = []
    for ep in _MOE_LAYOUTS:
        local = _MOE_SIZES["experts"] // ep
        for rank, result in enumerate(results):
            j, row = rank % ep, _moe_row(rank, ep)
            for f, counts in enumerate(result["extra", ep, name]["counts"]):
                expected = sum(truth["counts"][f][q] for q in row)[j * local:(j + 1) * local]
                problem = diff_report(torch.as_tensor(counts).long().reshape(-1), expected,
                                      f"ExpertParallelMoE.forward, ep={ep} (rank {rank} of {_MOE_WORLD}): "
                                      f"tokens_per_expert after forward {f + 1} of 2", 0, 0)
                if problem:
                    problems.append(problem)
    assert_no_problems(problems, "tokens_per_expert holds the rows each local expert processed in the LAST forward "
                                 "(set anew by each forward, not a running total): two forwards in a row, the second "
                                 "on other tokens:")


def test_2_10_layer_on_the_default_group_is_the_world(grade):
    results = _moe_layer(grade("2.10"), _moe_forward_rank, "ExpertParallelMoE.forward")
    truth, problems = _moe_truth_of(_MOE_DEFAULT_CASE), []
    for spelling in _MOE_DEFAULT_GROUPS:
        for rank, result in enumerate(results):
            where = f"from_full(moe, {spelling}), rank {rank} of {_MOE_WORLD}, {_MOE_DEFAULT_CASE}"
            got = result.get(("group", spelling))
            if got is None:
                pytest.fail(f"{where}: not run (an earlier case failed on some rank)")
            if "error" in got:
                _moe_raise(rank, got["error"], where)
            problems += _moe_forward_check(got, truth, rank, _MOE_WORLD, where)
    assert_no_problems(problems, "ExpertParallelMoE with group=None is the layer over the default group, the world "
                                 "(dist.group.WORLD): on a world of 4 it must give what the explicit group of the 4 "
                                 "ranks gives, the MoE of one process: output, aux loss, input gradient, gradients:")


def _moe_sync_check(got: dict, truth: dict, rank: int, ep: int, where: str) -> list[str]:
    return _moe_grad_problems(got, truth, rank, ep, where + ", after the reference's forward and backward")


def test_2_10_sync_gradients_router_over_the_world_experts_over_their_column(grade):
    results = _moe_layer(grade("2.10"), _moe_sync_rank, "sync_gradients")
    problems = _moe_layer_problems(results, _moe_sync_check)
    assert_no_problems(problems, "sync_gradients: the router's gradient averaged over all ranks; each expert's summed "
                                 "over the ranks holding it (groups.expert_dp) and divided by the world size; a None "
                                 "gradient (an expert that got no row on this rank) counts as zeros:")
