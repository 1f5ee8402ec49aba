"""Graded tests of exercise 2.9, sequence and context parallelism (phase2_advanced/guidelines.md, section 2.9).

Run them with `python tests/test_phase2.py -k 2_9` (your code) or
`pytest tests/test_phase2.py -k 2_9` (the reference); tests/test_phase2.py collects them.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import grading
from compare import assert_no_problems, diff_report
from common.distributed import current_device
from common.launch import WorldError, run_world
from common.measure import OpLog, PointToPointLog, ring_elements_sent, saved_activation_bytes

#
# One world per size (2 and 4 ranks) runs every check; each rank returns, per section, its
# outputs, gradients, the bytes it sent and what it computed (common.measure: PointToPointLog,
# OpLog, saved_activation_bytes). All assertions happen here, against one process: the
# unsharded Block of 2.7's modules and F.scaled_dot_product_attention on the whole sequence.

_CP_WORLDS = [2, 4]
# each graded test grades one part of the exercise (tests/grading.py shows one row per part)
_SP, _RING, _ULYSSES = (pytest.mark.part(name) for name in ("sequence parallelism", "ring attention", "Ulysses"))
_CP_BLOCK = dict(batch=2, seq=8, hidden=16, heads=4, ffn=32)
_CP_TOL = dict(rtol=1e-4, atol=1e-5)


def _cp_ring_cases(cp: int) -> dict:
    """name -> (batch, heads, c, head_dim, causal, logit scale, strided); the sequence is 2 * cp * c long, rank r
    holds chunks r and 2cp-1-r of c positions each. "plain" and "causal" have the same shapes (the work test pairs
    them); head_dim < 2c everywhere (the memory test's bound is then above all of K). strided: q, k, v and the
    upstream gradient are (batch, seq, heads, head_dim) tensors transposed to (batch, heads, seq, head_dim), as an
    attention layer makes them: not contiguous in memory. "causal, batch 1, one head": the memory test's bound,
    b*h*(S/cp)*S elements, is then that of one (S/cp) x S mask shared by every batch and head."""
    return {
        "plain": (2, 2, 2, 3, False, 1.0, False),
        "causal": (2, 2, 2, 3, True, 1.0, False),
        "causal, 3 heads, chunks of 3, strided": (1, 3, 3, 2, True, 1.0, True),
        "causal, large logits": (2, 2, 3, 2, True, 10.0, False),
        "large logits, strided": (1, 3, 3, 2, False, 10.0, True),
        "causal, chunks of 1": (2, 1, 1, 1, True, 1.0, False),
        "causal, batch 1, one head": (1, 1, 2, 3, True, 1.0, False),
    }


def _cp_ulysses_cases(cp: int) -> dict:
    """name -> (batch, heads, c, head_dim, causal, logit scale, strided); heads divide by cp."""
    return {"plain, strided": (2, cp, 2, 3, False, 1.0, True),
            "causal, large logits": (1, 2 * cp, 3, 2, True, 10.0, False)}


_CP_GROUPS = ([0, 2], [1, 3])  # in the world of 4: two context-parallel groups of 2, strided (peers are not rank +- 1)


def _cp_tensors(batch, heads, c, d, causal, scale, strided, cp, seed):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        s = 2 * cp * c
        q, k, v, g = (torch.randn(batch, heads, s, d) for _ in range(4))
        return {"q": q * scale, "k": k * scale, "v": v, "g": g, "causal": causal, "strided": strided}


def _cp_data(world: int) -> dict:
    """Weights, inputs and upstream gradients, made here (seeded, the global RNG untouched) and shipped to every rank."""
    ref, c = grading.reference("2.9"), _CP_BLOCK
    b, s, h = c["batch"], c["seq"], c["hidden"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        data = {
            "blocks": {causal: ref.Block(h, c["heads"], c["ffn"], causal=causal).state_dict() for causal in (False, True)},
            "x_block": torch.randn(b, s, h), "g_block": torch.randn(b, s, h),
            # a different tensor on every rank for the operators: rank r uses [r]
            "x_local": torch.randn(world, 2, 3, 4), "g_local": torch.randn(world, 2, 3, 4),
            "x_full": torch.randn(world, 2, 3 * world, 4), "g_full": torch.randn(world, 2, 3 * world, 4),
        }
    data["ring"] = {name: _cp_tensors(*case, world, seed) for seed, (name, case) in enumerate(_cp_ring_cases(world).items())}
    data["ulysses"] = {name: _cp_tensors(*case, world, 100 + seed)
                       for seed, (name, case) in enumerate(_cp_ulysses_cases(world).items())}
    data["group"] = _cp_tensors(2, 2, 2, 3, True, 1.0, False, 2, 200)
    return data


def _cp_positions(seq_len: int, rank: int, cp: int) -> torch.Tensor:
    """The test's own load-balanced layout: chunk rank, then chunk 2cp-1-rank."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def _cp_shard(t: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    return t.index_select(-2, _cp_positions(t.shape[-2], rank, cp).to(t.device))


# ------------------------------------------------------------------ instruments (inside a rank)

_CP_WATCHED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single", "send", "recv", "isend", "irecv",
               "batch_isend_irecv")


@contextlib.contextmanager
def _cp_contiguity_watch(found: list[str]):
    """Every tensor handed to a collective or a send/receive inside the block must be contiguous (NCCL refuses
    others; gloo copies quietly): the name of each call that got one that is not is appended to `found`.
    Patched on torch.distributed and its c10d module alike (P2POp checks its op against the latter)."""
    c10d, saved = dist.distributed_c10d, []
    for name in _CP_WATCHED:
        real = getattr(dist, name, None)
        if real is None:
            continue

        @functools.wraps(real)
        def watched(*args, _real=real, _name=name, **kwargs):
            given = [*args, *kwargs.values()]
            items = [t for a in given for t in (a if isinstance(a, (list, tuple)) else [a])]
            tensors = [getattr(t, "tensor", t) for t in items]
            if any(isinstance(t, torch.Tensor) and not t.is_contiguous() for t in tensors):
                found.append(_name)
            return _real(*args, **kwargs)

        for module in (dist, c10d):
            if getattr(module, name, None) is real:
                saved.append((module, name, real))
                setattr(module, name, watched)
    try:
        yield
    finally:
        for module, name, real in reversed(saved):
            setattr(module, name, real)


@contextlib.contextmanager
def _cp_waits(events: list):
    """Each Work.wait() inside the block appends ("wait", the work) to `events`."""
    work = dist.distributed_c10d.Work
    real = work.wait

    def wait(self, *args, **kwargs):
        events.append(("wait", self))
        return real(self, *args, **kwargs)

    work.wait = wait
    try:
        yield
    finally:
        work.wait = real


_CP_P2P = ("isend", "irecv", "send", "recv", "batch_isend_irecv")


@contextlib.contextmanager
def _cp_transfers(events: list, groups: set):
    """Each point-to-point call inside the block: the ranks of the group it runs on go into `groups` (a P2POp's
    group, or isend/irecv/send/recv's group=; None is the world), and each Work it returns is appended to `events`
    as ("issued", the work, the bytes it receives), for _cp_received_while_computing to match with its wait."""
    c10d, saved, depth = dist.distributed_c10d, [], [0]
    for name in _CP_P2P:
        real = getattr(dist, name)
        signature = inspect.signature(real)

        @functools.wraps(real)
        def watched(*args, _real=real, _name=name, _signature=signature, **kwargs):
            if depth[0]:  # batch_isend_irecv -> isend: seen once, as the batch
                return _real(*args, **kwargs)
            bound = _signature.bind_partial(*args, **kwargs).arguments
            if _name == "batch_isend_irecv":
                ops = [(op.group, inspect.unwrap(op.op).__name__, op.tensor) for op in bound["p2p_op_list"]]
            else:
                ops = [(bound.get("group"), _name, bound["tensor"])]
            groups.update(tuple(dist.get_process_group_ranks(g if g is not None else dist.group.WORLD))
                          for g, _, _ in ops)
            received = [t.numel() * t.element_size() if kind in ("irecv", "recv") else 0 for _, kind, t in ops]
            depth[0] += 1
            try:
                result = _real(*args, **kwargs)
            finally:
                depth[0] -= 1
            works = [w for w in (result if isinstance(result, list) else [result]) if w is not None]
            if len(works) != len(received):  # one Work for the whole batch (NCCL coalesces)
                received = [sum(received)] + [0] * (len(works) - 1)
            events.extend(("issued", w, n) for w, n in zip(works, received))
            return result

        for module in (dist, c10d):
            if getattr(module, name, None) is real:
                saved.append((module, name, real))
                setattr(module, name, watched)
    try:
        yield
    finally:
        for module, name, real in reversed(saved):
            setattr(module, name, real)


def _cp_received_while_computing(events: list) -> int:
    """Bytes received by transfers during which arithmetic ran: posted, then some computation, then waited for."""
    computed, issued, total = 0, {}, 0
    for event in events:
        if event[0] == "compute":
            computed += 1
        elif event[0] == "issued":
            issued[id(event[1])] = (computed, event[2])
        elif event[0] == "wait" and id(event[1]) in issued:
            at, nbytes = issued.pop(id(event[1]))
            total += nbytes if computed > at else 0
    return total


class _CpOpLog(OpLog):
    """common.measure.OpLog that also records the largest new buffer in ELEMENTS, whatever their type (a bool mask
    holds 1 byte per element): `most` = (elements, shape, op name)."""

    def __init__(self, on_op=None):
        super().__init__(on_op)
        self.most: tuple[int, tuple, str] = (0, (), "")

    def _seen(self, func, args, out) -> None:
        super()._seen(func, args, out)
        if not func.is_view:
            for t in (out if isinstance(out, (list, tuple)) else [out]):
                if isinstance(t, torch.Tensor) and t.numel() > self.most[0]:
                    self.most = (t.numel(), tuple(t.shape), str(func))


_CP_ARITHMETIC = {"mm", "bmm", "addmm", "baddbmm", "mul", "div", "add", "sub", "rsub", "neg", "exp", "log", "pow",
                  "sum", "amax", "max", "maximum", "softmax", "_softmax", "_log_softmax", "logsumexp", "logaddexp",
                  "masked_fill", "where", "sigmoid", "log_sigmoid_forward", "tanh"}


def _cp_is_compute(name: str) -> bool:
    """A matrix product or arithmetic on values (what attention computes); not an allocation, copy or view."""
    op = name.split(".")[1] if name.startswith("aten.") else ""
    return op.rstrip("_") in _CP_ARITHMETIC or "scaled_dot_product" in op


def _cp_measured(fn):
    """Run fn() and return (its result, what this rank did): bytes sent by each kind of call, the sends' peers, the
    blocking point-to-point calls, the order of posts / products / waits, FLOPs, the largest buffer made (in bytes
    and in elements), the calls given tensors that are not contiguous, the ranks of every collective's group and of
    every point-to-point call's, and the bytes received while arithmetic ran."""
    events: list = []
    strided: list[str] = []
    p2p_groups: set = set()
    with PointToPointLog(on_op=lambda kind, peer, t: events.append(("post", kind, peer, t.numel() * t.element_size()))) \
            as log, _cp_contiguity_watch(strided), _cp_waits(events), _cp_transfers(events, p2p_groups), \
            _CpOpLog(on_op=lambda name: events.append(("compute",)) if _cp_is_compute(name) else None) as ops:
        result = fn()
    world = dist.get_world_size()
    sent, collectives = 0.0, []
    for call in log.calls:
        if call.name in ("send", "recv", "isend", "irecv", "batch_isend_irecv"):
            continue  # counted from the posts
        ranks = list(range(world)) if call.group is None else dist.get_process_group_ranks(call.group)
        n = len(ranks)
        per_element = call.nbytes / call.numel if call.numel else 0
        elements = (n - 1) / n * call.numel if call.name == "all_to_all_single" else ring_elements_sent(call, n)
        sent += elements * per_element
        collectives.append((call.name, call.numel, ranks))
    sent += sum(e[3] for e in events if e[0] == "post" and e[1] == "send")
    return result, {
        "sent": sent, "collectives": collectives, "peers": sorted({e[2] for e in events if e[0] == "post"}),
        "blocking": sorted({c.name for c in log.calls if c.name in ("send", "recv")}),
        "events": [e[:2] if e[0] == "post" else e[:1] for e in events if e[0] != "issued"], "flops": ops.flops,
        "largest": ops.largest, "most": ops.most, "strided": strided, "p2p_groups": sorted(p2p_groups),
        "received_while_computing": _cp_received_while_computing(events),
    }


def _cp_cpu(t):
    return None if t is None else t.detach().cpu().clone()


def _cp_error(exc: BaseException) -> dict:
    return {"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}


# ------------------------------------------------------------------ sections (inside a rank)


def _cp_positions_section(mod, data, dev):
    """Every rank of several (seq_len, cp), cp = 3, 5, 6 among them (2cp not a power of two); each case asked again
    ("again") after the caller shifted the first result in place (then back): every call returns its own tensor."""
    cases = [(8, 2), (12, 2), (4, 2), (16, 4), (24, 4), (8, 1), (6, 3), (18, 3), (10, 5), (12, 6)]
    out = {}
    for s, cp in cases:
        for r in range(cp):
            first = mod.load_balanced_positions(s, r, cp)
            out[(s, cp, r)] = _cp_cpu(first)
            if isinstance(first, torch.Tensor):
                first.add_(s)  # what a caller may do with the tensor it was given, e.g. shift a window
                out[("again", s, cp, r)] = _cp_cpu(mod.load_balanced_positions(s, r, cp))
                first.sub_(s)
    return out


def _cp_op_run(fn, x: torch.Tensor, g: torch.Tensor) -> dict:
    """Forward, backward with g; output, input gradient, what each pass sent; whether x or g was modified."""
    x_given = x.clone().requires_grad_(True)
    y, fwd = _cp_measured(lambda: fn(x_given))
    out = {"y": _cp_cpu(y), "fwd": fwd, "bwd": None, "x_grad": None, "x_changed": not torch.equal(x_given.detach(), x),
           "g_changed": False}
    if y.shape != g.shape:
        return out
    g_given = g.clone()
    _, out["bwd"] = _cp_measured(lambda: y.backward(g_given))
    out["g_changed"] = not torch.equal(g_given, g)
    out["x_grad"] = _cp_cpu(x_given.grad)
    return out


def _cp_strided(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, -1).contiguous().transpose(0, -1)


def _cp_ops_section(mod, data, dev):
    rank = dist.get_rank()
    local, full = data["x_local"][rank].to(dev), data["x_full"][rank].to(dev)
    g_local, g_full = data["g_local"][rank].to(dev), data["g_full"][rank].to(dev)
    cases = {"gather": (mod.GatherFromSequenceParallelRegion, local, g_full),
             "reduce_scatter": (mod.ReduceScatterToSequenceParallelRegion, full, g_local)}
    out = {}
    for name, (fn, x, g) in cases.items():
        out[name] = _cp_op_run(lambda t, fn=fn: fn.apply(t, None), x, g)
        out[name, "default group"] = _cp_op_run(fn.apply, x, g)
        out[name, "not contiguous"] = _cp_op_run(lambda t, fn=fn: fn.apply(t, None), _cp_strided(x), _cp_strided(g))
        out[name, "4-D"] = _cp_op_run(lambda t, fn=fn: fn.apply(t, None), *(t.unflatten(-1, (2, 2)) for t in (x, g)))
    return out


class _TensorParallelBlock(nn.Module):
    """2.7's tensor parallelism around the same Block, without sequence parallelism (the memory test's baseline)."""

    def __init__(self, block, tp):
        super().__init__()
        self.ln1, self.ln2 = block.ln1, block.ln2
        self.attn, self.mlp = tp.ParallelSelfAttention.from_full(block.attn), tp.ParallelMLP.from_full(block.mlp)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _cp_full_block(data, causal, dev, dropout=0.0):
    c = _CP_BLOCK
    block = grading.reference("2.9").Block(c["hidden"], c["heads"], c["ffn"], causal=causal, dropout=dropout).to(dev)
    block.load_state_dict(data["blocks"][causal])
    return block


def _cp_block_run(mod, data, dev, causal, group=None):
    rank, t = dist.get_rank(group), dist.get_world_size(group)
    kwargs = {} if group is None else {"group": group}
    sp = mod.SequenceParallelBlock.from_full(_cp_full_block(data, causal, dev), **kwargs)
    x = data["x_block"].to(dev).chunk(t, dim=1)[rank].clone().requires_grad_(True)
    g = data["g_block"].to(dev).chunk(t, dim=1)[rank]
    y, fwd = _cp_measured(lambda: sp(x))
    _, bwd = _cp_measured(lambda: y.backward(g))
    _, reduce = _cp_measured(sp.reduce_replicated_grads)
    return {"y": _cp_cpu(y), "x_grad": _cp_cpu(x.grad), "fwd": fwd, "bwd": bwd, "reduce": reduce,
            "params": {n: _cp_cpu(p) for n, p in sp.named_parameters()},
            "grads": {n: _cp_cpu(p.grad) for n, p in sp.named_parameters()}}


def _cp_block_section(mod, data, dev):
    out = {causal: _cp_block_run(mod, data, dev, causal) for causal in (False, True)}
    rank, t = dist.get_rank(), dist.get_world_size()
    x = data["x_block"].to(dev).chunk(t, dim=1)[rank]
    dropped = mod.SequenceParallelBlock.from_full(_cp_full_block(data, True, dev, dropout=1.0)).train()
    out["dropout=1"] = _cp_cpu(dropped(x.clone()))
    with torch.no_grad():
        out["dropout=1, eval, no_grad"] = _cp_cpu(dropped.eval()(x.clone()))
    # memory: what forward + backward keep for backward, this block vs 2.7's tensor-parallel block
    full_block = _cp_full_block(data, True, dev)
    sp = mod.SequenceParallelBlock.from_full(full_block)
    xs, gs = x.clone().requires_grad_(True), data["g_block"].to(dev).chunk(t, dim=1)[rank]
    out["saved_sp"] = saved_activation_bytes(lambda: sp(xs).backward(gs), exclude=[*sp.parameters(), xs])
    tp_block = _TensorParallelBlock(full_block, grading.reference("2.7"))
    xf = data["x_block"].to(dev).clone().requires_grad_(True)
    out["saved_tp"] = saved_activation_bytes(lambda: tp_block(xf).backward(data["g_block"].to(dev)),
                                             exclude=[*tp_block.parameters(), xf])
    return out


def _cp_attention_run(fn, case, dev, group=None):
    rank, cp = dist.get_rank(group), dist.get_world_size(group)

    def chunks(t):  # this rank's chunks; with "strided", the same values laid out (batch, seq, heads, head_dim)
        mine = _cp_shard(t.to(dev), rank, cp)
        return mine.transpose(1, 2).contiguous().transpose(1, 2) if case["strided"] else mine

    q, k, v = (chunks(case[n]).requires_grad_(True) for n in "qkv")
    g = chunks(case["g"])
    given = [t.detach().clone() for t in (q, k, v, g)]
    kwargs = {} if group is None else {"group": group}
    y, fwd = _cp_measured(lambda: fn(q, k, v, case["causal"], **kwargs))
    out = {"y": _cp_cpu(y), "fwd": fwd, "bwd": None, "grads": None, "changed": False}
    if y.shape == g.shape:
        _, out["bwd"] = _cp_measured(lambda: y.backward(g))
        out["grads"] = [_cp_cpu(t.grad) for t in (q, k, v)]
    out["changed"] = not all(torch.equal(a, b.detach()) for a, b in zip(given, (q, k, v, g)))
    return out


def _cp_ring_section(mod, data, dev):
    return {name: _cp_attention_run(mod.ring_attention, case, dev) for name, case in data["ring"].items()}


def _cp_ulysses_section(mod, data, dev):
    return {name: _cp_attention_run(mod.ulysses_attention, case, dev) for name, case in data["ulysses"].items()}


def _cp_edges_sp_section(mod, data, dev):
    """SequenceParallelBlock with each rank alone in a group of one (t = 1: the whole sequence, nothing to send)."""
    return _cp_block_run(mod, data, dev, True, data["alone"])


def _cp_edges_ring_section(mod, data, dev):
    """ring_attention with each rank alone in a group of one (cp = 1), with the world's group spelled out, and a
    forward under no_grad."""
    case, rank, cp = data["ring"]["causal"], dist.get_rank(), dist.get_world_size()
    out = {"one rank": _cp_attention_run(mod.ring_attention, data["group"], dev, data["alone"]),
           "world group": _cp_attention_run(mod.ring_attention, case, dev, dist.group.WORLD)}
    with torch.no_grad():
        out["no_grad"] = _cp_cpu(mod.ring_attention(*(_cp_shard(case[n].to(dev), rank, cp) for n in "qkv"), True))
    return out


def _cp_edges_ulysses_section(mod, data, dev):
    """ulysses_attention with each rank alone in a group of one (cp = 1) and with the world's group spelled out."""
    return {"one rank": _cp_attention_run(mod.ulysses_attention, data["group"], dev, data["alone"]),
            "world group": _cp_attention_run(mod.ulysses_attention, data["ulysses"]["causal, large logits"], dev,
                                             dist.group.WORLD)}


def _cp_group_ring_section(mod, data, dev):
    return _cp_attention_run(mod.ring_attention, data["group"], dev, data["strided"])


def _cp_group_ulysses_section(mod, data, dev):
    return _cp_attention_run(mod.ulysses_attention, data["group"], dev, data["strided"])


def _cp_group_block_section(mod, data, dev):
    return _cp_block_run(mod, data, dev, True, data["strided"])


def _cp_group_ops_inputs(data: dict, rank: int) -> dict:
    """name -> ((input, upstream gradient) on the rank's group of 2, (input, upstream gradient) on the world of 4)."""
    xl, xf, gl, gf = (data[n][rank] for n in ("x_local", "x_full", "g_local", "g_full"))
    return {"gather": ((xl, gf[:, 6:]), (xl, gf)), "reduce_scatter": ((xf[:, 6:], gl), (xf, gl))}


def _cp_group_ops_section(mod, data, dev):
    """Each SP operator applied twice, on the rank's group {0, 2} or {1, 3} and on the world, both outputs alive
    before one backward through both: each call's backward must use that call's group."""
    ops = {"gather": mod.GatherFromSequenceParallelRegion, "reduce_scatter": mod.ReduceScatterToSequenceParallelRegion}
    out = {}
    for name, ((xa, ga), (xb, gb)) in _cp_group_ops_inputs(data, dist.get_rank()).items():
        a, b = (t.to(dev).clone().requires_grad_(True) for t in (xa, xb))
        ya, yb = ops[name].apply(a, data["strided"]), ops[name].apply(b, None)
        if ya.shape == ga.shape and yb.shape == gb.shape:
            torch.autograd.backward([ya, yb], [ga.to(dev), gb.to(dev)])
        out[name] = {"group": (_cp_cpu(ya), _cp_cpu(a.grad)), "world": (_cp_cpu(yb), _cp_cpu(b.grad))}
    return out


def _cp_float64_run(fn, case: dict, dev) -> dict:
    return _cp_attention_run(fn, {**case, **{n: case[n].double() for n in "qkvg"}}, dev)


def _cp_float64_ring_section(mod, data, dev):
    return _cp_float64_run(mod.ring_attention, data["ring"]["causal, 3 heads, chunks of 3, strided"], dev)


def _cp_float64_ulysses_section(mod, data, dev):
    return _cp_float64_run(mod.ulysses_attention, data["ulysses"]["causal, large logits"], dev)


def _cp_sizes_section(mod, data, dev):
    """Sizes that the layout does not allow must raise ValueError."""
    cp = dist.get_world_size()
    odd = torch.zeros(1, cp, 3, 2, device=dev)
    cases = {f"load_balanced_positions({2 * cp + 1}, 0, {cp})": lambda: mod.load_balanced_positions(2 * cp + 1, 0, cp),
             "ring_attention with 3 positions per rank (2 chunks each)": lambda: mod.ring_attention(odd, odd, odd),
             f"ulysses_attention with {cp + 1} heads": lambda: mod.ulysses_attention(*[torch.zeros(1, cp + 1, 2, 2, device=dev)] * 3)}
    problems = []
    for what, call in cases.items():
        try:
            call()
            problems.append(f"{what} in a world of {cp} was accepted; expected ValueError")
        except ValueError:
            pass
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{what} in a world of {cp} raised {type(exc).__name__}: {exc}; expected ValueError")
    return problems


# one section per part at most, so that one part left TODO (or failing) leaves the others' verdicts alone
_CP_SECTIONS = {"positions": _cp_positions_section, "ops": _cp_ops_section, "block": _cp_block_section,
                "ring": _cp_ring_section, "ulysses": _cp_ulysses_section, "edges sp": _cp_edges_sp_section,
                "edges ring": _cp_edges_ring_section,
                "edges ulysses": _cp_edges_ulysses_section, "group ring": _cp_group_ring_section,
                "group ulysses": _cp_group_ulysses_section, "group block": _cp_group_block_section,
                "group ops": _cp_group_ops_section, "float64 ring": _cp_float64_ring_section,
                "float64 ulysses": _cp_float64_ulysses_section, "sizes": _cp_sizes_section}


_CP_AGREE_S = 10.0  # how long a rank whose section raised waits for the others to finish that section


def _cp_rank(ref: grading.ModuleRef, data: dict):
    """Every section in turn; an exception is reported by the tests of its section only. Where it left the other
    ranks waiting inside the section (a send or collective it never made), they cannot go on: then the rank raises
    it after _CP_AGREE_S, and the world fails at once with its traceback instead of a deadlock's deadline."""
    mod = ref.load()
    dev = current_device()
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    # the groups of the edges and group sections, made before any section runs: every rank creates every group, in
    # the same order (dist.new_group's rule); "alone": this rank in a group of one, "strided": {0, 2} or {1, 3}
    alone = [dist.new_group([r]) for r in range(world)]
    strided = [dist.new_group(ranks) for ranks in _CP_GROUPS] if world == 4 else [None, None]
    data = {**data, "alone": alone[rank], "strided": strided[rank % 2]}
    results = {}
    for name, section in _CP_SECTIONS.items():
        if name.startswith("group") and world != 4:
            continue
        try:
            results[name] = section(mod, data, dev)
            store.set(f"2.9/{name}/{rank}", "done")
        except Exception as exc:  # noqa: BLE001 - reported by the test of that section
            results[name] = _cp_error(exc)
            store.set(f"2.9/{name}/{rank}", "raised")
            try:
                store.wait([f"2.9/{name}/{r}" for r in range(world)], datetime.timedelta(seconds=_CP_AGREE_S))
            except Exception:  # noqa: BLE001 - another rank is still inside the section, waiting for this one
                raise exc from None
    return results


_cp_worlds: dict = {}  # (ModuleRef, world) -> per-rank results, or the exception the world raised


def _cp_section(ref: grading.ModuleRef, world: int, name: str) -> list:
    """Per-rank results of one section; a rank's exception is raised again here (TODO stays TODO)."""
    key = (ref, world)
    if key not in _cp_worlds:
        try:
            _cp_worlds[key] = run_world(_cp_rank, world, args=(ref, _cp_data(world)))
        except WorldError as exc:
            _cp_worlds[key] = exc
            raise
    results = _cp_worlds[key]
    if isinstance(results, BaseException):
        pytest.fail(f"not run: the world of {world} ranks failed (see the first 2.9 test that ran): "
                    f"{str(results).splitlines()[0]}")
    for rank, result in enumerate(results):
        error = result[name]
        if isinstance(error, dict) and "error" in error:
            if error["error"] == "NotImplementedError" and error["message"].startswith("TODO"):
                raise NotImplementedError(error["message"])
            pytest.fail(f"rank {rank} of {world} raised {error['error']}: {error['message']}\n{error['traceback']}")
    return [result[name] for result in results]


# ------------------------------------------------------------------ checks (here)


def _cp_usage(got: dict, where: str) -> list[str]:
    """Inputs unchanged, tensors contiguous at every collective and send."""
    problems = []
    if got.get("x_changed") or got.get("changed"):
        problems.append(f"{where}: an input or the upstream gradient was modified (communicate on copies; autograd "
                        "may still use them)")
    if got.get("g_changed"):
        problems.append(f"{where}: backward modified the upstream gradient it was given")
    strided = [n for p in ("fwd", "bwd", "reduce") if got.get(p) for n in got[p]["strided"]]
    if strided:
        problems.append(f"{where}: {', '.join(dict.fromkeys(strided))} got a tensor that is not contiguous in memory "
                        "(NCCL refuses it; gloo copies it quietly): make tensors contiguous before communicating")
    return problems


def _cp_budget(got: dict | None, limit: float, where: str, what: str) -> list[str]:
    if got is None or got["sent"] <= limit * (1 + 1e-9):
        return []
    return [f"{where}: sent {got['sent']:.0f} bytes in {what}, the cost model allows {limit:.0f} "
            f"(calls: {got['collectives'] or 'none'}{'; point-to-point sends' if any(e[0] == 'post' for e in got['events']) else ''})"]


@_SP
@pytest.mark.parametrize("world", _CP_WORLDS)
def test_2_9_sequence_parallel_gather_and_reduce_scatter_operators(grade, world):
    results = _cp_section(grade("2.9"), world, "ops")
    data = _cp_data(world)
    xl, gl, xf, gf = data["x_local"], data["g_local"], data["x_full"], data["g_full"]
    local_bytes, full_bytes = xl[0].numel() * 4, xf[0].numel() * 4
    problems = []
    for rank, ops in enumerate(results):
        expected = {  # name: (output, input gradient, forward budget, backward budget, what it is)
            "gather": (torch.cat(list(xl), dim=1), gf.sum(0).chunk(world, dim=1)[rank],
                       (world - 1) * local_bytes, (world - 1) / world * full_bytes,
                       "GatherFromSequenceParallelRegion: forward all-gather along the sequence (dim 1), backward "
                       "reduce-scatter"),
            "reduce_scatter": (xf.sum(0).chunk(world, dim=1)[rank], torch.cat(list(gl), dim=1),
                               (world - 1) / world * full_bytes, (world - 1) * local_bytes,
                               "ReduceScatterToSequenceParallelRegion: forward reduce-scatter along the sequence, "
                               "backward all-gather"),
        }
        for name, (y, x_grad, fwd_budget, bwd_budget, what) in expected.items():
            for variant, how in ((name, "Op.apply(x, None)"), ((name, "default group"), "Op.apply(x)"),
                                 ((name, "not contiguous"), "Op.apply(x, None), x and the upstream gradient not "
                                                            "contiguous in memory"),
                                 ((name, "4-D"), "Op.apply(x, None), x of shape (batch, seq, 2, 2): the sequence is "
                                                 "dim 1 whatever follows it")):
                got, where = ops[variant], f"{what}; {how}, on rank {rank} of {world}"
                shaped = (lambda t: t.unflatten(-1, (2, 2))) if variant == (name, "4-D") else (lambda t: t)
                problem = diff_report(got["y"], shaped(y), f"{where}: output", **_CP_TOL) or \
                    (f"{where}: the input got no gradient" if got["x_grad"] is None else
                     diff_report(got["x_grad"], shaped(x_grad), f"{where}: input gradient", **_CP_TOL))
                if problem:
                    problems.append(problem)
                problems += _cp_usage(got, where)
                problems += _cp_budget(got["fwd"], fwd_budget, where, "forward")
                problems += _cp_budget(got["bwd"], bwd_budget, where, "backward")
    assert_no_problems(problems, f"the sequence-parallel operators are wrong in a world of {world} (rank r's input "
                                 "differs on every rank; bytes counted as a ring algorithm sends them, guidelines 1.3):")


def _cp_block_truth(data: dict, causal: bool) -> dict:
    block = _cp_full_block(data, causal, torch.device("cpu"))
    x = data["x_block"].clone().requires_grad_(True)
    y = block(x)
    y.backward(data["g_block"])
    return {"y": y.detach(), "x_grad": x.grad, "params": {n: p.detach() for n, p in block.named_parameters()},
            "grads": {n: p.grad for n, p in block.named_parameters()}}


def _cp_block_shard(name: str, full: torch.Tensor, rank: int, t: int) -> torch.Tensor:
    """2.7's shards: qkv per head, fc1 by rows, out and fc2 by columns with the whole bias; LayerNorms whole."""
    h = _CP_BLOCK["hidden"]
    if name.startswith("attn.qkv"):
        return torch.cat([part.chunk(t, dim=0)[rank] for part in full.split(h, dim=0)])
    if name.startswith("mlp.fc1"):
        return full.chunk(t, dim=0)[rank]
    if name in ("attn.out.weight", "mlp.fc2.weight"):
        return full.chunk(t, dim=1)[rank]
    return full


def _cp_block_problems(got: dict, truth: dict, rank: int, t: int, where: str) -> list[str]:
    problems = []
    for name, full in truth["params"].items():
        if name not in got["params"]:
            problems.append(f"{where}: no parameter named {name}")
            continue
        problem = diff_report(got["params"][name], _cp_block_shard(name, full, rank, t), f"{where}: {name}", 0, 0)
        if problem:
            problems.append(problem)
    problem = diff_report(got["y"], truth["y"].chunk(t, dim=1)[rank], f"{where}: output (this rank's positions)",
                          **_CP_TOL)
    if problem:
        return problems + [problem]
    problem = (f"{where}: the input got no gradient" if got["x_grad"] is None else
               diff_report(got["x_grad"], truth["x_grad"].chunk(t, dim=1)[rank], f"{where}: input gradient", **_CP_TOL))
    if problem:
        problems.append(problem)
    for name, grad in truth["grads"].items():
        mine = got["grads"].get(name)
        problem = (f"{where}: {name} got no gradient" if mine is None else
                   diff_report(mine, _cp_block_shard(name, grad, rank, t),
                               f"{where}: gradient of {name} after reduce_replicated_grads()", **_CP_TOL))
        if problem:
            problems.append(problem)
    return problems


@_SP
@pytest.mark.parametrize("world", _CP_WORLDS)
def test_2_9_sequence_parallel_block_matches_one_process(grade, world):
    results = _cp_section(grade("2.9"), world, "block")
    data = _cp_data(world)
    problems = []
    for causal in (False, True):
        truth = _cp_block_truth(data, causal)
        for rank, got in enumerate(results):
            where = f"SequenceParallelBlock(causal={causal}) on rank {rank} of {world}"
            problems += _cp_block_problems(got[causal], truth, rank, world, where)
            problems += _cp_usage(got[causal], where)
    for rank, got in enumerate(results):
        x = data["x_block"].chunk(world, dim=1)[rank]
        problem = diff_report(got["dropout=1"], x, f"SequenceParallelBlock(dropout=1.0), training, on rank {rank}: "
                                                   "output (each branch dropped entirely: the input itself)", **_CP_TOL)
        if problem:
            problems.append(problem)
        problem = diff_report(got["dropout=1, eval, no_grad"], _cp_block_truth(data, True)["y"].chunk(world, dim=1)[rank],
                              f"SequenceParallelBlock(dropout=1.0) in eval mode under torch.no_grad() on rank {rank}: "
                              "output (no dropout in eval mode)", **_CP_TOL)
        if problem:
            problems.append(problem)
    for rank, got in enumerate(_cp_section(grade("2.9"), world, "edges sp")):  # each rank alone: t = 1
        where = f"SequenceParallelBlock(group=a group of one rank: t = 1, the whole sequence) on rank {rank} of {world}"
        problems += _cp_block_problems(got, _cp_block_truth(data, True), 0, 1, where)
        talked = [p for p in ("fwd", "bwd", "reduce") if got[p]["peers"]
                  or any(r != [rank] for _, _, r in got[p]["collectives"])]
        if talked:
            problems.append(f"{where}: communicated with another rank in {', '.join(talked)}")
    assert_no_problems(problems, "rank r gets positions r*s/t:(r+1)*s/t of x and must return those of the one-process "
                                 "Block, with 2.7's shards of attention and MLP; after backward and "
                                 "reduce_replicated_grads(), every gradient equals that shard of the Block's (the "
                                 "LayerNorms and the row-parallel biases whole):")


@_SP
@pytest.mark.parametrize("world", _CP_WORLDS)
def test_2_9_sequence_parallel_block_moves_what_tensor_parallel_moves(grade, world):
    results = _cp_section(grade("2.9"), world, "block")
    c = _CP_BLOCK
    bsh = c["batch"] * c["seq"] * c["hidden"] * 4
    per_pass = 4 * (world - 1) / world * bsh  # 2 all-gathers + 2 reduce-scatters = 2.7's 2 all-reduces
    replicated = 6 * c["hidden"] * 4  # ln1, ln2 (weight, bias), attn.out.bias, mlp.fc2.bias
    problems = []
    for causal in (False, True):
        for rank, result in enumerate(results):
            got, where = result[causal], f"SequenceParallelBlock(causal={causal}) on rank {rank} of {world}"
            problems += _cp_budget(got["fwd"], per_pass, where, "forward")
            problems += _cp_budget(got["bwd"], per_pass, where, "backward")
            problems += _cp_budget(got["reduce"], 2 * (world - 1) / world * replicated, where,
                                   "reduce_replicated_grads()")
            if got["fwd"]["sent"] < per_pass * (1 - 1e-9):
                problems.append(f"{where}: forward sent {got['fwd']['sent']:.0f} bytes, expected {per_pass:.0f} (an "
                                "all-gather into each of attention and MLP, a reduce-scatter out of each)")
    assert_no_problems(problems, f"per block and pass, sequence parallelism moves what 2.7's two all-reduces move: "
                                 f"4 (t-1)/t b*s*h elements ({per_pass:.0f} bytes here); the replicated gradients "
                                 "(LayerNorms, row-parallel biases) are one all-reduce's worth:")


@_SP
@pytest.mark.parametrize("world", _CP_WORLDS)
def test_2_9_sequence_parallel_block_holds_the_residual_stream_sharded(grade, world):
    results = _cp_section(grade("2.9"), world, "block")
    c = _CP_BLOCK
    saving = (1 - 1 / world) * c["batch"] * c["seq"] * c["hidden"] * 4
    problems = [f"rank {rank}: the SequenceParallelBlock keeps {r['saved_sp']} bytes for backward, 2.7's "
                f"tensor-parallel block {r['saved_tp']}: expected at least {saving:.0f} fewer (ln2's input, the "
                f"residual stream, held as 1/{world} of the sequence)"
                for rank, r in enumerate(results) if r["saved_sp"] > r["saved_tp"] - saving]
    assert_no_problems(problems, "LayerNorm, dropout and residual must run on the sequence shard: what they keep for "
                                 "backward (common.measure.saved_activation_bytes) shrinks by t:")


def _cp_attention_truth(case: dict, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """F.scaled_dot_product_attention on the whole sequence, in float64: output and the gradients of q, k, v (as
    `dtype`)."""
    q, k, v = (case[n].double().requires_grad_(True) for n in "qkv")
    y = F.scaled_dot_product_attention(q, k, v, is_causal=case["causal"])
    y.backward(case["g"].double())
    return [t.to(dtype) for t in (y.detach(), q.grad, k.grad, v.grad)]


def _cp_attention_problems(got: dict, case: dict, truth: list, rank: int, cp: int, where: str) -> list[str]:
    problems = _cp_usage(got, where)
    # the large-logit cases (logits in the hundreds: exp overflows float32 past 88) check that nothing overflows;
    # float32's rounding of such logits is ~1e-4 of the gradients' scale (F.scaled_dot_product_attention's too)
    large = case["q"].abs().max().item() > 5
    for i, name in enumerate(("output", "gradient of q", "gradient of k", "gradient of v")):
        expected = _cp_shard(truth[i], rank, cp)
        tol = dict(rtol=1e-2, atol=5e-3 * expected.abs().max().item()) if large else _CP_TOL
        actual = got["y"] if i == 0 else (got["grads"][i - 1] if got["grads"] else None)
        problem = (f"{where}: {name}: none (no backward ran, or the input got no gradient)" if actual is None else
                   diff_report(actual, expected, f"{where}: {name}", **tol))
        if problem:
            problems.append(problem)
            if i == 0:
                break  # the gradients follow from it
    return problems


def _cp_case_text(name: str, case: dict, cp: int) -> str:
    b, h, s, d = case["q"].shape
    return f"{name} (batch {b}, {h} heads, sequence {s} = 2*{cp}*{s // (2 * cp)}, head_dim {d})"


@_RING
@pytest.mark.parametrize("world", _CP_WORLDS)
def test_2_9_load_balanced_positions(grade, world):
    results = _cp_section(grade("2.9"), world, "positions")
    problems = []
    for rank, got in enumerate(results):
        for (*again, s, cp, r), positions in got.items():
            expected = _cp_positions(s, r, cp)
            if positions is None or positions.dtype != torch.long or not torch.equal(positions, expected):
                problems.append(f"load_balanced_positions({s}, rank={r}, cp={cp}) returned "
                                f"{None if positions is None else positions.tolist()}, expected {expected.tolist()}"
                                + ("; asked again after the caller had added to the tensor an earlier call returned: "
                                   "each call must return a new tensor" if again else ""))
        if problems:
            break
    assert_no_problems(problems, "the sequence is cut into 2cp chunks of c = seq_len / 2cp positions; rank r holds "
                                 "chunk r then chunk 2cp-1-r, as a new LongTensor of global positions, for any cp:")


@_RING
@pytest.mark.parametrize("world", _CP_WORLDS)
def test_2_9_ring_attention_matches_full_attention(grade, world):
    results = _cp_section(grade("2.9"), world, "ring")
    data = _cp_data(world)
    problems = []
    for name, case in data["ring"].items():
        truth = _cp_attention_truth(case)
        for rank, got in enumerate(results):
            where = f"ring_attention, {_cp_case_text(name, case, world)}, on rank {rank} of {world}"
            problems += _cp_attention_problems(got[name], case, truth, rank, world, where)
    problems += _cp_edge_problems(grade("2.9"), world, data, "ring")
    assert_no_problems(problems, "rank r passes its chunks r and 2cp-1-r of Q, K, V and must get those rows of "
                                 "F.scaled_dot_product_attention over the whole sequence, and the gradients of its "
                                 "q, k, v chunks:")


def _cp_edge_problems(ref, world: int, data: dict, name: str) -> list[str]:
    """The edges section's runs of ring_attention or ulysses_attention: each rank alone in a group of one (cp = 1,
    the whole sequence), group=dist.group.WORLD spelled out, and (ring) a forward under torch.no_grad()."""
    results = _cp_section(ref, world, f"edges {name}")
    one, spelled = data["group"], data["ring"]["causal"] if name == "ring" else data["ulysses"]["causal, large logits"]
    truths = {"one": _cp_attention_truth(one), "world": _cp_attention_truth(spelled)}
    problems = []
    for rank, got in enumerate(results):
        problems += _cp_attention_problems(got["one rank"], one, truths["one"], 0, 1,
                                           f"{name}_attention in a group of one rank (cp = 1), rank {rank} of {world}")
        problems += _cp_attention_problems(got["world group"], spelled, truths["world"], rank, world,
                                           f"{name}_attention(group=dist.group.WORLD) on rank {rank} of {world}")
        if name == "ring":
            truth = _cp_attention_truth(data["ring"]["causal"])[0]
            problem = diff_report(got["no_grad"], _cp_shard(truth, rank, world),
                                  f"ring_attention under torch.no_grad() on rank {rank} of {world}: output", **_CP_TOL)
            if problem:
                problems.append(problem)
    return problems


def _cp_kv_bytes(case: dict, cp: int) -> int:
    return 2 * case["k"].numel() // cp * 4  # this rank's k and v chunks, float32


@_RING
@pytest.mark.parametrize("world", _CP_WORLDS)
def test_2_9_ring_attention_sends_what_the_cost_model_says(grade, world):
    results = _cp_section(grade("2.9"), world, "ring")
    data = _cp_data(world)
    problems = []
    for name, case in data["ring"].items():
        kv = _cp_kv_bytes(case, world)
        for rank, result in enumerate(results):
            got, where = result[name], f"ring_attention, {name}, on rank {rank} of {world}"
            problems += _cp_budget(got["fwd"], (world - 1) * kv, where, "forward")
            problems += _cp_budget(got["bwd"], (2 * world - 1) * kv, where, "backward")
    assert_no_problems(problems, "a rank sends at most (cp-1)/cp of the whole K and V in forward (its block and "
                                 "the cp-2 it passes on: nothing at the last step), and in backward K and V once more "
                                 "plus the dK, dV accumulators, which travel with their block and end at their owner: "
                                 "(cp-1 + cp) blocks of k and v:")


@_RING
@pytest.mark.parametrize("world", _CP_WORLDS)
def test_2_9_ring_attention_overlaps_sends_with_compute(grade, world):
    results = _cp_section(grade("2.9"), world, "ring")
    problems = []
    for name in _cp_ring_cases(world):
        for rank, result in enumerate(results):
            got, where = result[name]["fwd"], f"ring_attention forward, {name}, on rank {rank} of {world}"
            if got["blocking"]:
                problems.append(f"{where}: blocking {' and '.join(got['blocking'])}: a rank waits for its peer instead "
                                "of computing (use dist.isend / dist.irecv or dist.batch_isend_irecv)")
            pending = False  # a send or receive is posted and no product has run since
            for event in got["events"]:
                if event[0] == "post":
                    pending = True
                elif event[0] == "compute":
                    pending = False
                elif event[0] == "wait" and pending:
                    problems.append(f"{where}: waited for a send/receive it had just posted, with no computation in "
                                    "between: post the next block's transfer, compute with the current block, then "
                                    "wait")
                    break
    assert_no_problems(problems, "the transfer of the next K/V block must be in flight while the current block is "
                                 "computed (the order of posts, arithmetic operations and Work.wait() calls):")


@_RING
@pytest.mark.parametrize("world", _CP_WORLDS)
def test_2_9_ring_attention_backward_overlaps_like_forward(grade, world):
    results = _cp_section(grade("2.9"), world, "ring")
    problems = []
    for name in _cp_ring_cases(world):
        for rank, result in enumerate(results):
            fwd, bwd = (result[name][phase]["received_while_computing"] for phase in ("fwd", "bwd"))
            if bwd < fwd * (1 - 1e-9):
                problems.append(f"ring_attention, {name}, on rank {rank} of {world}: forward received {fwd} bytes "
                                f"while computing, backward only {bwd}: post the next K/V block's transfer, compute "
                                "with the block held, then wait (as forward does)")
    assert_no_problems(problems, "backward rides the same ring as forward, so its K/V transfers hide behind its "
                                 "blocks' compute as forward's do: the bytes received by transfers during which "
                                 "arithmetic ran (posted, computed, then waited for: Work.wait() matched to the "
                                 "send/receive that returned it) are at least forward's:")


@_RING
@pytest.mark.parametrize("world", _CP_WORLDS)
def test_2_9_ring_attention_causal_work_is_balanced_and_halved(grade, world):
    results = _cp_section(grade("2.9"), world, "ring")
    bound = (world + 1) / (2 * world)  # own block whole, half of each of the cp-1 others
    problems = []
    for phase in ("fwd", "bwd"):
        plain = [r["plain"][phase]["flops"] for r in results]
        causal = [r["causal"][phase]["flops"] for r in results]
        what = {"fwd": "forward", "bwd": "backward"}[phase]
        if len(set(causal)) > 1:
            problems.append(f"{what}: the ranks' causal FLOPs differ ({causal}): in the load-balanced layout every "
                            "rank has the same work")
        for rank, (p, c) in enumerate(zip(plain, causal)):
            if c > bound * p * (1 + 1e-9):
                problems.append(f"{what}, rank {rank}: causal {c} FLOPs vs {p} without the mask ({c / p:.2f}x); "
                                f"expected at most {bound:.3f}x: skip the half of each other block that the mask "
                                "hides")
    assert_no_problems(problems, f"under the causal mask a rank computes its own block and HALF of each of the "
                                 f"{world - 1} others (matrix-product FLOPs counted by common.measure.OpLog):")


@_RING
@pytest.mark.parametrize("world", _CP_WORLDS)
def test_2_9_ring_attention_never_holds_a_full_score_matrix(grade, world):
    results = _cp_section(grade("2.9"), world, "ring")
    data = _cp_data(world)
    problems = []
    for name, case in data["ring"].items():
        b, h, s, _ = case["q"].shape
        limit = b * h * (s // world) * s  # elements: my queries' scores (or mask) against ALL keys
        for rank, result in enumerate(results):
            for phase in ("fwd", "bwd"):
                got = result[name][phase]
                if got is not None and got["most"][0] >= limit:
                    elements, shape, op = got["most"]
                    problems.append(f"ring_attention {'forward' if phase == 'fwd' else 'backward'}, {name}, rank "
                                    f"{rank}: {op} made a buffer of {elements} elements, shape {list(shape)}; the "
                                    f"scores of this rank's {s // world} queries against all {s} keys would be {limit}")
                    break
    assert_no_problems(problems, "ring attention holds one block of scores (or of mask) at a time, (S/cp) x (S/cp) per "
                                 "head, never a rank's queries against the whole sequence (largest buffer any "
                                 "operation made, in elements of any type, common.measure.OpLog):")


@_ULYSSES
@pytest.mark.parametrize("world", _CP_WORLDS)
def test_2_9_ulysses_attention_matches_full_attention(grade, world):
    results = _cp_section(grade("2.9"), world, "ulysses")
    data = _cp_data(world)
    problems = []
    for name, case in data["ulysses"].items():
        truth = _cp_attention_truth(case)
        budget = 4 * (world - 1) / world * (case["q"].numel() // world * 4)  # q, k, v there, the output back
        for rank, result in enumerate(results):
            where = f"ulysses_attention, {_cp_case_text(name, case, world)}, on rank {rank} of {world}"
            problems += _cp_attention_problems(result[name], case, truth, rank, world, where)
            problems += _cp_budget(result[name]["fwd"], budget, where, "forward")
            problems += _cp_budget(result[name]["bwd"], budget, where, "backward")
    problems += _cp_edge_problems(grade("2.9"), world, data, "ulysses")
    assert_no_problems(problems, "same contract as ring_attention (same layout, same rows), by two all-to-alls per "
                                 "pass: sequence -> heads for q, k, v, heads -> sequence for the output ((cp-1)/cp of "
                                 "each moved):")


def _cp_group_problems(ref, part: str) -> list[str]:
    """In a world of 4 split into groups {0, 2} and {1, 3} (made by the test), `part` run with group= on each rank:
    its results are those of one process over the group's ranks, and it talks only inside its group."""
    results = _cp_section(ref, 4, f"group {part}")
    data = _cp_data(4)
    problems = []
    for rank, got in enumerate(results):
        ranks, index = _CP_GROUPS[rank % 2], _CP_GROUPS[rank % 2].index(rank)
        if part == "block":
            problems += _cp_block_problems(got, _cp_block_truth(data, True), index, 2,
                                           f"SequenceParallelBlock(group={ranks}) on rank {rank} of 4")
        else:
            where = f"{part}_attention(group={ranks}) on rank {rank} of 4 (index {index} in its group)"
            problems += _cp_attention_problems(got, data["group"], _cp_attention_truth(data["group"]), index, 2, where)
        for phase in ("fwd", "bwd", "reduce"):
            measured = got.get(phase)
            if measured is None:
                continue
            outside = [p for p in measured["peers"] if p not in ranks] + \
                [f"{n} over {r}" for n, _, r in measured["collectives"] if r != ranks] + \
                [f"a send/receive on the group of {list(r)}" for r in measured["p2p_groups"] if list(r) != ranks]
            if outside:
                what = "SequenceParallelBlock" if part == "block" else f"{part}_attention"
                problems.append(f"{what} on rank {rank} (group {ranks}), {phase}: talked outside its group: "
                                f"{outside} (point-to-point peers are GLOBAL ranks: dist.get_global_rank(group, i); "
                                "collectives, P2POps and isend/irecv take the group)")
    return problems


_CP_GROUP_HEADER = ("with group=, positions and chunks are those of the rank's index in the group (dist.get_rank(group)), "
                    "and every send, receive and collective stays in the group:")


@_SP
def test_2_9_sequence_parallel_block_on_a_group_communicates_only_within_it(grade):
    """SequenceParallelBlock.from_full(block, group=) on the groups {0, 2} and {1, 3} of a world of 4: the one-process
    Block's rows and gradients for the group's shards, every collective over the group."""
    assert_no_problems(_cp_group_problems(grade("2.9"), "block"), _CP_GROUP_HEADER)


@_RING
def test_2_9_ring_attention_on_a_group_communicates_only_within_it(grade):
    """ring_attention(..., group=) on the groups {0, 2} and {1, 3} of a world of 4: full attention over the group's
    sequence, every send and receive to a global rank of the group."""
    assert_no_problems(_cp_group_problems(grade("2.9"), "ring"), _CP_GROUP_HEADER)


@_ULYSSES
def test_2_9_ulysses_attention_on_a_group_communicates_only_within_it(grade):
    """ulysses_attention(..., group=) on the groups {0, 2} and {1, 3} of a world of 4: full attention over the group's
    sequence, every all-to-all over the group."""
    assert_no_problems(_cp_group_problems(grade("2.9"), "ulysses"), _CP_GROUP_HEADER)


@_SP
def test_2_9_sequence_parallel_operators_on_two_groups_at_once(grade):
    """In a world of 4, each operator applied on the rank's group ({0, 2} or {1, 3}) and on the world, both outputs
    alive before one backward through both (two blocks on different groups, or two forwards before a backward)."""
    results = _cp_section(grade("2.9"), 4, "group ops")
    data = _cp_data(4)
    problems = []
    for rank, got in enumerate(results):
        ranks, index = _CP_GROUPS[rank % 2], _CP_GROUPS[rank % 2].index(rank)
        xl, xf, gl, gf = (data[n] for n in ("x_local", "x_full", "g_local", "g_full"))
        expected = {  # name: {where: (output, input gradient)}
            "gather": {"group": (torch.cat([xl[j] for j in ranks], dim=1),
                                 sum(gf[j][:, 6:] for j in ranks).chunk(2, dim=1)[index]),
                       "world": (torch.cat(list(xl), dim=1), gf.sum(0).chunk(4, dim=1)[rank])},
            "reduce_scatter": {"group": (sum(xf[j][:, 6:] for j in ranks).chunk(2, dim=1)[index],
                                         torch.cat([gl[j] for j in ranks], dim=1)),
                               "world": (xf.sum(0).chunk(4, dim=1)[rank], torch.cat(list(gl), dim=1))},
        }
        for name, cases in expected.items():
            for which, (y, x_grad) in cases.items():
                where = (f"{name} on rank {rank}: Op.apply(x, {'group ' + str(ranks) if which == 'group' else 'None'}),"
                         f" alive with a call on {'the world' if which == 'group' else 'group ' + str(ranks)}")
                got_y, got_grad = got[name][which]
                problem = diff_report(got_y, y, f"{where}: output", **_CP_TOL) or \
                    (f"{where}: the input got no gradient" if got_grad is None else
                     diff_report(got_grad, x_grad, f"{where}: input gradient", **_CP_TOL))
                if problem:
                    problems.append(problem)
    assert_no_problems(problems, "each call of an operator keeps its own group for its backward (on ctx, not on the "
                                 "class or the module): two calls on different groups, both alive, then one backward:")


@_RING
@pytest.mark.parametrize("world", _CP_WORLDS)
def test_2_9_ring_attention_in_float64(grade, world):
    """ring_attention on float64 q, k, v (and upstream gradient): F.scaled_dot_product_attention's result is float64,
    and so are the gradients of q, k, v."""
    results = _cp_section(grade("2.9"), world, "float64 ring")
    _cp_float64_check(results, _cp_data(world)["ring"]["causal, 3 heads, chunks of 3, strided"], "ring", world)


@_ULYSSES
@pytest.mark.parametrize("world", _CP_WORLDS)
def test_2_9_ulysses_attention_in_float64(grade, world):
    """ulysses_attention on float64 q, k, v: float64 results, as F.scaled_dot_product_attention's."""
    results = _cp_section(grade("2.9"), world, "float64 ulysses")
    _cp_float64_check(results, _cp_data(world)["ulysses"]["causal, large logits"], "ulysses", world)


def _cp_float64_check(results: list, case: dict, name: str, world: int) -> None:
    case = {**case, **{n: case[n].double() for n in "qkvg"}}
    truth = _cp_attention_truth(case, torch.float64)
    problems = []
    for rank, got in enumerate(results):
        where = f"{name}_attention on float64 inputs, {_cp_case_text('causal', case, world)}, on rank {rank} of {world}"
        problems += _cp_attention_problems(got, case, truth, rank, world, where)
    assert_no_problems(problems, "the output and the gradients have the inputs' dtype, as F.scaled_dot_product_attention "
                                 "gives them (buffers made like q, k, v: zeros_like, new_zeros, dtype=q.dtype):")


def _cp_block_cases() -> dict:
    """name -> (leading dims, q positions, k positions, causal, logit scale): every query sees at least one key."""
    return {
        "queries after every key (q_pos [4, 5], k_pos [0, 1])": ((2, 3), [4, 5], [0, 1], True, 1.0),
        "positions in no order (q_pos [6, 1, 3], k_pos [0, 5, 2, 1])": ((3,), [6, 1, 3], [0, 5, 2, 1], True, 1.0),
        "some keys after some queries, large logits (q_pos [3, 0, 2], k_pos [0, 1, 2, 3, 4])":
            ((1, 2), [3, 0, 2], [0, 1, 2, 3, 4], True, 30.0),
        "not causal: every key seen whatever the positions (q_pos [0, 1], k_pos [5, 6, 7])":
            ((2, 1), [0, 1], [5, 6, 7], False, 1.0),
    }


@_RING
def test_2_9_attention_block_masks_by_global_positions(grade):
    """attention_block alone (no world): the contract of its docstring, for positions that are not those of a rank's
    own chunks (offset, in no order, keys after queries)."""
    mod = grade("2.9").load()
    problems = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(300)
        for name, (lead, q_pos, k_pos, causal, logits) in _cp_block_cases().items():
            d = 3
            q, k = (torch.randn(*lead, len(pos), d) * logits for pos in (q_pos, k_pos))
            v = torch.randn(*lead, len(k_pos), d)
            qp, kp, scale = torch.tensor(q_pos), torch.tensor(k_pos), d ** -0.5
            scores = (q.double() @ k.double().mT) * scale
            if causal:
                scores = scores.masked_fill(kp[None, :] > qp[:, None], float("-inf"))
            expected = (scores.softmax(-1) @ v.double()).float(), scores.logsumexp(-1).float()
            out, lse = mod.attention_block(q, k, v, qp, kp, causal, scale)
            where = f"attention_block, {name}, causal={causal}, q of shape {list(q.shape)}"
            large = dict(rtol=1e-2, atol=5e-3 * expected[0].abs().max().item())
            problem = diff_report(out, expected[0], f"{where}: out", **(large if logits > 5 else _CP_TOL)) or \
                diff_report(lse, expected[1], f"{where}: lse", **(dict(rtol=1e-4, atol=1e-3) if logits > 5 else _CP_TOL))
            if problem:
                problems.append(problem)
    assert_no_problems(problems, "the query at global position q_pos[i] sees the key at k_pos[j] iff k_pos[j] <= "
                                 "q_pos[i] (causal), every key otherwise; out is the softmax over the keys it sees times "
                                 "v, lse the log-sum-exp of their scores:")


def test_context_parallel_sizes_that_do_not_split_raise_value_error(grade):
    """Not graded (the checks are given in the template): the reference must keep them."""
    problems = [p for rank_problems in _cp_section(grade("2.9"), 2, "sizes") for p in rank_problems]
    assert_no_problems(problems, "sizes the layout does not allow must fail with a ValueError:")
