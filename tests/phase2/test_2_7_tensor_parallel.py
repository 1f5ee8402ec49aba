"""Graded tests of exercise 2.7, tensor parallelism (phase2_advanced/guidelines.md, section 2.7).

Run them with `python tests/test_phase2.py -k 2_7` (your code) or
`pytest tests/test_phase2.py -k 2_7` (the reference); tests/test_phase2.py collects them.
"""

from __future__ import annotations

import contextlib
import functools
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import grading
from compare import assert_no_problems, diff_report
from common.distributed import current_device
from common.launch import WorldError, run_world
from common.measure import CollectiveLog


#
# One world per world size (2 and 4) runs every check; each rank returns, per section,
# its outputs, gradients, parameter shards and the collectives it called (recorded by
# common.measure.CollectiveLog inside the rank, with the ranks of the group each went
# to). All assertions happen here against the unsharded modules run in this process.

_TP_SIZES = dict(batch=2, seq=5, col_in=6, col_out=8, row_in=8, row_out=6, hidden=8, ffn=16, embed=16, heads=8)
_TP_TOL = dict(rtol=1e-5, atol=1e-5)
_TP_SAME_COLLECTIVE = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather"}


def _tp_data(world: int) -> dict:
    """Weights, inputs and upstream gradients, made here (seeded, the global RNG untouched) and shipped to every rank."""
    ref, c = grading.reference("2.7"), _TP_SIZES
    b, s = c["batch"], c["seq"]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return {
            "column": nn.Linear(c["col_in"], c["col_out"]).state_dict(),
            "row": nn.Linear(c["row_in"], c["row_out"]).state_dict(),
            "column_no_bias": nn.Linear(c["col_in"], c["col_out"], bias=False).state_dict(),
            "row_no_bias": nn.Linear(c["row_in"], c["row_out"], bias=False).state_dict(),
            "mlp": ref.MLP(c["hidden"], c["ffn"]).state_dict(),
            "attention": ref.SelfAttention(c["embed"], c["heads"]).state_dict(),
            "x_column": torch.randn(b, s, c["col_in"]), "g_column": torch.randn(b, s, c["col_out"]),
            "x_row": torch.randn(b, s, c["row_in"]), "g_row": torch.randn(b, s, c["row_out"]),
            "x_mlp": torch.randn(b, s, c["hidden"]), "g_mlp": torch.randn(b, s, c["hidden"]),
            "x_attention": torch.randn(b, s, c["embed"]), "g_attention": torch.randn(b, s, c["embed"]),
            # a different tensor on every rank for the region operators: rank r uses [r]
            "x_small": torch.randn(world, 3, 4), "g_small": torch.randn(world, 3, 4),
            "x_wide": torch.randn(world, 3, 4 * world), "g_wide": torch.randn(world, 3, 4 * world),
        }


_TP_CONTIGUOUS_ONLY = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor")


@contextlib.contextmanager
def _tp_contiguity_watch(found: list[str]):
    """Every tensor handed to a collective inside the block must be contiguous (NCCL refuses others; gloo
    copies quietly): the name of each collective that got one that is not is appended to `found`."""
    saved = {}
    for name in _TP_CONTIGUOUS_ONLY:
        real = getattr(dist, name, None)
        if real is None:
            continue

        @functools.wraps(real)
        def watched(*args, _real=real, _name=name, **kwargs):
            given = [*args, *kwargs.values()]
            tensors = [t for a in given for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
            if any(not t.is_contiguous() for t in tensors):
                found.append(_name)
            return _real(*args, **kwargs)

        saved[name] = real
        setattr(dist, name, watched)
    try:
        yield
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)


def _tp_logged(fn):
    """(fn(), the collectives it called as (name, elements this rank sent, ranks of the group), and the names of
    those given a tensor that is not contiguous)."""
    strided: list[str] = []
    with CollectiveLog() as log, _tp_contiguity_watch(strided):
        result = fn()
    world = list(range(dist.get_world_size()))
    return result, [(_TP_SAME_COLLECTIVE.get(c.name, c.name), c.numel,
                     tuple(world if c.group is None else dist.get_process_group_ranks(c.group))) for c in log.calls], strided


def _tp_cpu(t):
    return None if t is None else t.detach().cpu().clone()


def _tp_fwd_bwd(module, x: torch.Tensor, g: torch.Tensor) -> dict:
    """Forward, then backward with upstream gradient g; outputs, grads and collectives of each pass, and whether
    the input (forward) or the upstream gradient (backward) was modified. The copies keep x's and g's
    memory layout (a non-contiguous x or g stays so)."""
    x_given = x.clone().requires_grad_(True)
    params = dict(module.named_parameters()) if isinstance(module, nn.Module) else {}
    y, fwd, strided = _tp_logged(lambda: module(x_given))
    out = {"y": _tp_cpu(y), "fwd": fwd, "bwd": None, "x_grad": None, "x_changed": not torch.equal(x_given.detach(), x),
           "g_changed": False, "params": {n: _tp_cpu(p) for n, p in params.items()}, "grads": {}, "strided": strided}
    if y.shape != g.shape:
        return out  # reported as a shape mismatch of y
    g_given = g.clone()
    _, out["bwd"], strided = _tp_logged(lambda: y.backward(g_given))
    out["strided"] = out["strided"] + strided
    out["g_changed"] = not torch.equal(g_given, g)
    out["x_grad"] = _tp_cpu(x_given.grad)
    out["grads"] = {n: _tp_cpu(p.grad) for n, p in params.items()}
    return out


def _tp_changed(got: dict, what: str) -> list[str]:
    """Inputs that must come back unchanged (autograd may still use them); collectives on contiguous tensors."""
    return ([f"{what}: forward modified its input x (communicate on a copy; autograd may still use x)"]
            if got.get("x_changed") else []) + \
        ([f"{what}: {', '.join(dict.fromkeys(got['strided']))} got a tensor that is not contiguous in memory (NCCL "
          "refuses it; gloo copies it quietly): make tensors contiguous before a collective"]
         if got.get("strided") else []) + \
        ([f"{what}: backward modified the upstream gradient it was given (communicate on a copy; autograd may "
          "still use it)"] if got.get("g_changed") else [])


def _tp_strided(t: torch.Tensor) -> torch.Tensor:
    """The same values, not contiguous in memory (the transpose of a contiguous transpose)."""
    return t.transpose(0, -1).contiguous().transpose(0, -1)


def _tp_ops(mod, data, dev):
    """Each operator called as Op.apply(x, group) and as Op.apply(x) (default group), and once on inputs and
    upstream gradients that are not contiguous in memory."""
    rank, world = dist.get_rank(), dist.get_world_size()
    small, wide = data["x_small"][rank].to(dev), data["x_wide"][rank].to(dev)
    g_small, g_wide = data["g_small"][rank].to(dev), data["g_wide"][rank].to(dev)
    cases = {  # name: (Function, input, upstream gradient)
        "f": (mod.CopyToTensorParallelRegion, small, g_small),
        "g": (mod.ReduceFromTensorParallelRegion, small, g_small),
        "gather": (mod.GatherFromTensorParallelRegion, small, g_wide),
        "scatter": (mod.ScatterToTensorParallelRegion, wide, g_small),
    }
    out = {}
    for name, (fn, x, g) in cases.items():
        out[name] = _tp_fwd_bwd(lambda t, fn=fn: fn.apply(t, None), x, g)
        out[name, "default group"] = _tp_fwd_bwd(fn.apply, x, g)
        out[name, "not contiguous"] = _tp_fwd_bwd(lambda t, fn=fn: fn.apply(t, None), _tp_strided(x), _tp_strided(g))
    return out


def _tp_full(kind: str, mod, data, dev, **kwargs):
    c = _TP_SIZES
    full = {"column": lambda: nn.Linear(c["col_in"], c["col_out"]), "row": lambda: nn.Linear(c["row_in"], c["row_out"]),
            "column_no_bias": lambda: nn.Linear(c["col_in"], c["col_out"], bias=False),
            "row_no_bias": lambda: nn.Linear(c["row_in"], c["row_out"], bias=False),
            "mlp": lambda: mod.MLP(c["hidden"], c["ffn"]),
            "attention": lambda: mod.SelfAttention(c["embed"], c["heads"], **kwargs)}[kind]().to(dev)
    full.load_state_dict(data[kind])
    return full


_TP_COLUMN_RUNS = [(False, True), (True, True), (False, False), (True, False)]  # (gather_output, bias)
_TP_ROW_RUNS = [(True, True), (False, True), (True, False), (False, False)]  # (input_is_parallel, bias)


def _tp_column(mod, data, dev, group=None):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    x, g = data["x_column"].to(dev), data["g_column"].to(dev)
    out = {}
    for gather, bias in _TP_COLUMN_RUNS if group is None else [(True, True)]:
        full = _tp_full("column" if bias else "column_no_bias", mod, data, dev)
        kwargs = {} if group is None else {"group": group}
        layer = mod.ColumnParallelLinear.from_full(full, gather_output=gather, **kwargs)
        out[gather, bias] = _tp_fwd_bwd(layer, x, g if gather else g.chunk(world, dim=-1)[rank])
    return out


def _tp_row(mod, data, dev, group=None):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    x, g = data["x_row"].to(dev), data["g_row"].to(dev)
    out = {}
    for parallel, bias in _TP_ROW_RUNS if group is None else [(False, True)]:
        full = _tp_full("row" if bias else "row_no_bias", mod, data, dev)
        kwargs = {} if group is None else {"group": group}
        layer = mod.RowParallelLinear.from_full(full, input_is_parallel=parallel, **kwargs)
        out[parallel, bias] = _tp_fwd_bwd(layer, x.chunk(world, dim=-1)[rank] if parallel else x, g)
    return out


def _tp_mlp(mod, data, dev):
    block = mod.ParallelMLP.from_full(_tp_full("mlp", mod, data, dev))
    return _tp_fwd_bwd(block, data["x_mlp"].to(dev), data["g_mlp"].to(dev))


def _tp_attention(mod, data, dev):
    out = {}
    for causal in (False, True):
        block = mod.ParallelSelfAttention.from_full(_tp_full("attention", mod, data, dev, causal=causal))
        out[causal] = _tp_fwd_bwd(block, data["x_attention"].to(dev), data["g_attention"].to(dev))
    return out


def _tp_sizes(mod, data, dev):
    """Constructions that cannot split over this world must raise ValueError."""
    world = dist.get_world_size()
    cases = {
        f"ColumnParallelLinear(4, {2 * world + 1})": lambda: mod.ColumnParallelLinear(4, 2 * world + 1),
        f"RowParallelLinear({2 * world + 1}, 4)": lambda: mod.RowParallelLinear(2 * world + 1, 4),
        f"ParallelMLP(8, {4 * world + 1})": lambda: mod.ParallelMLP(8, 4 * world + 1),
        f"ParallelSelfAttention({2 * (world + 1)}, num_heads={world + 1})":
            lambda: mod.ParallelSelfAttention(2 * (world + 1), world + 1),
        "ParallelSelfAttention(10, num_heads=4)": lambda: mod.ParallelSelfAttention(10, 4),
    }
    problems = []
    for what, build in cases.items():
        try:
            build()
            problems.append(f"{what} in a world of {world} was accepted; expected ValueError")
        except ValueError:
            pass
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{what} in a world of {world} raised {type(exc).__name__}: {exc}; expected ValueError")
    return problems


_TP_HALVES = ([0, 1], [2, 3])  # in a world of 4: two tensor-parallel groups of 2


def _tp_subgroup(mod, data, dev):
    """In a world of 4, layers built with group= one of two halves must work within it alone."""
    groups = [dist.new_group(ranks) for ranks in _TP_HALVES]  # every rank creates both, in the same order
    group = groups[dist.get_rank() // 2]
    full = _tp_full("mlp", mod, data, dev)
    attention = mod.ParallelSelfAttention.from_full(_tp_full("attention", mod, data, dev), group=group)
    return {"mlp": _tp_fwd_bwd(mod.ParallelMLP.from_full(full, group=group), data["x_mlp"].to(dev), data["g_mlp"].to(dev)),
            "column": _tp_column(mod, data, dev, group)[True, True],
            "row": _tp_row(mod, data, dev, group)[False, True],
            "attention": _tp_fwd_bwd(attention, data["x_attention"].to(dev), data["g_attention"].to(dev))}


_TP_LEFT_OUT = object()  # an argument not passed: its default stands


def _tp_kwargs(**options) -> dict:
    return {k: v for k, v in options.items() if v is not _TP_LEFT_OUT}


def _tp_built(mod, data, dev):
    """Layers built by their constructors (every option spelled out or left to its default; group= left out, the
    world's group spelled out, a subgroup in a world of 4) and filled by copy_from_full_ from the unsharded module;
    then forward of data that needs no gradient, 2-D and 3-D, under torch.no_grad() and not, each against the
    unsharded module here (single-process ground truth). Also the four region operators on 3-D float64 tensors.
    Returns the problems found on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    c, problems = _TP_SIZES, []
    groups = {"group left out": (_TP_LEFT_OUT, rank, world), "group=dist.group.WORLD": (dist.group.WORLD, rank, world)}
    if world == 4:  # the world's group in the world of 2; here a subgroup only
        halves = [dist.new_group(ranks) for ranks in _TP_HALVES]  # every rank creates both, in the same order
        groups = {f"group={_TP_HALVES[rank // 2]}": (halves[rank // 2], rank % 2, 2)}
    gen = torch.Generator().manual_seed(7)
    x3 = {n: torch.randn(c["batch"], c["seq"], n, generator=gen).to(dev) for n in (c["col_in"], c["row_in"], c["hidden"])}
    x2 = {n: t[0] for n, t in x3.items()}  # (seq, n): a 2-D input

    def check(what, layer, full, x, expected_of):
        for grad in (False, True):
            for name, inputs in (("2-D", x2[x]), ("3-D", x3[x])):
                with torch.set_grad_enabled(grad):
                    got, want = layer(inputs), expected_of(full(inputs))
                where = f"{what}, a {name} input that needs no gradient{'' if grad else ', under torch.no_grad()'}"
                problem = diff_report(_tp_cpu(got), _tp_cpu(want), f"{where}: output", **_TP_TOL)
                if problem:
                    problems.append(problem)
                elif grad and not got.requires_grad:
                    problems.append(f"{where}: the output does not require grad (the parameters do)")

    left = _TP_LEFT_OUT
    combos = ((True, True), (False, False), (left, left), (False, True), (True, left))  # (bias, the layer's flag)
    for group, r, p in groups.values():
        for bias, gather in combos:
            kw = _tp_kwargs(bias=bias, gather_output=gather, group=group)
            full = nn.Linear(c["col_in"], c["col_out"], bias=bias is not False).to(dev)
            layer = mod.ColumnParallelLinear(c["col_in"], c["col_out"], device=dev, **kw).copy_from_full_(full)
            check(f"ColumnParallelLinear({c['col_in']}, {c['col_out']}, {kw}).copy_from_full_(full) on rank {rank}",
                  layer, full, c["col_in"], lambda y, gather=gather: y if gather is True else y.chunk(p, dim=-1)[r])
        for bias, parallel in combos:
            kw = _tp_kwargs(bias=bias, input_is_parallel=parallel, group=group)
            full = nn.Linear(c["row_in"], c["row_out"], bias=bias is not False).to(dev)
            layer = mod.RowParallelLinear(c["row_in"], c["row_out"], device=dev, **kw).copy_from_full_(full)
            if parallel is not False:  # the layer gets this rank's slice of the input, the full layer all of it
                layer = (lambda module: lambda t: module(t.chunk(p, dim=-1)[r]))(layer)
            check(f"RowParallelLinear({c['row_in']}, {c['row_out']}, {kw}).copy_from_full_(full) on rank {rank}",
                  layer, full, c["row_in"], lambda y: y)
        full = mod.MLP(c["hidden"], c["ffn"]).to(dev)
        kw = _tp_kwargs(group=group)
        check(f"ParallelMLP({c['hidden']}, {c['ffn']}, {kw}).copy_from_full_(mlp) on rank {rank}",
              mod.ParallelMLP(c["hidden"], c["ffn"], **kw).copy_from_full_(full), full, c["hidden"], lambda y: y)
        # causal; one head per rank and a sequence of 1; causal left to its default
        for causal, embed, heads, seq in ((True, c["embed"], c["heads"], c["seq"]), (False, 4 * p, p, 1),
                                          (left, c["embed"], c["heads"], 1)):
            kw = _tp_kwargs(causal=causal, group=group)
            full = mod.SelfAttention(embed, heads, causal=causal is True).to(dev)
            layer = mod.ParallelSelfAttention(embed, heads, **kw).copy_from_full_(full)
            x = torch.randn(c["batch"], seq, embed, generator=gen).to(dev)
            with torch.no_grad():
                problem = diff_report(_tp_cpu(layer(x)), _tp_cpu(full(x)),
                                      f"ParallelSelfAttention({embed}, {heads}, {kw}).copy_from_full_(attn) on rank "
                                      f"{rank}, input {tuple(x.shape)} under torch.no_grad(): output", **_TP_TOL)
            if problem:
                problems.append(problem)
    # the region operators on a 3-D float64 tensor, different on every rank (forward)
    base = torch.randn(2, 3, 4, dtype=torch.float64, generator=gen)
    mine = (base * (rank + 1)).to(dev)
    every = [base * (q + 1) for q in range(world)]
    wide = torch.cat(every, dim=-1).to(dev)
    for name, fn, x, expected in (
            ("CopyToTensorParallelRegion", mod.CopyToTensorParallelRegion, mine, mine),
            ("ReduceFromTensorParallelRegion", mod.ReduceFromTensorParallelRegion, mine, sum(every).to(dev)),
            ("GatherFromTensorParallelRegion", mod.GatherFromTensorParallelRegion, mine, wide),
            ("ScatterToTensorParallelRegion", mod.ScatterToTensorParallelRegion, wide, wide.chunk(world, dim=-1)[rank])):
        y = fn.apply(x.clone().requires_grad_(True))
        if y.dtype != torch.float64:
            problems.append(f"{name}.apply(a float64 (2, 3, n) tensor) on rank {rank}: the output is {y.dtype}")
        problem = diff_report(_tp_cpu(y).double(), _tp_cpu(expected), f"{name}.apply(a float64 (2, 3, n) tensor) "
                                                                      f"on rank {rank}: output", rtol=1e-12, atol=1e-12)
        if problem:
            problems.append(problem)
    return problems


_TP_SECTIONS = {"ops": _tp_ops, "column": _tp_column, "row": _tp_row, "mlp": _tp_mlp,
                "attention": _tp_attention, "sizes": _tp_sizes, "subgroup": _tp_subgroup, "built": _tp_built}


def _tp_rank(ref: grading.ModuleRef, data: dict):
    mod = ref.load()
    dev = current_device()
    results = {}
    for name, section in _TP_SECTIONS.items():
        if name == "subgroup" and dist.get_world_size() != 4:
            continue
        try:
            results[name] = section(mod, data, dev)
        except Exception as exc:  # noqa: BLE001 - reported by the test of that section
            results[name] = {"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
    return results


_tp_worlds: dict = {}  # (ModuleRef, world) -> per-rank results, or the exception the world raised


def _tp_section(ref: grading.ModuleRef, world: int, name: str) -> list:
    """Per-rank results of one section; a rank's exception is raised again here (TODO stays TODO)."""
    key = (ref, world)
    if key not in _tp_worlds:
        try:
            _tp_worlds[key] = run_world(_tp_rank, world, args=(ref, _tp_data(world)))
        except WorldError as exc:
            _tp_worlds[key] = exc
            raise
    results = _tp_worlds[key]
    if isinstance(results, BaseException):
        pytest.fail(f"not run: the world of {world} ranks failed (see the first 2.7 test that ran): "
                    f"{str(results).splitlines()[0]}")
    for rank, result in enumerate(results):
        error = result[name]
        if isinstance(error, dict) and "error" in error:
            if error["error"] == "NotImplementedError" and error["message"].startswith("TODO"):
                raise NotImplementedError(error["message"])
            pytest.fail(f"rank {rank} of {world} raised {error['error']}: {error['message']}\n{error['traceback']}")
    return [result[name] for result in results]


def _tp_reference(module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict:
    """The unsharded ground truth: output, input gradient, parameter gradients."""
    x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(g)
    return {"y": y.detach(), "x_grad": x.grad,
            "params": {n: p.detach() for n, p in module.named_parameters()},
            "grads": {n: p.grad for n, p in module.named_parameters()}}


def _tp_calls_text(calls) -> str:
    return ("[" + ", ".join(f"{op}({n} elements, group of ranks {list(ranks)})" for op, n, ranks in calls) + "]"
            if calls else "no collective")


def _tp_problems(got: dict, expected: dict, shard, what: str, fwd=None, bwd=None) -> list[str]:
    """Compare one rank's run with the ground truth. shard(name, full tensor) -> this rank's expected part.
    fwd / bwd: the exact list of collectives expected in each pass (None: not checked)."""
    problems, grads_to_check = _tp_changed(got, what), []
    for name, full in expected["params"].items():
        if name not in got["params"]:
            problems.append(f"{what}: no parameter named {name}")
            continue
        problem = diff_report(got["params"][name], shard(name, full), f"{what}: shard of parameter {name}", 0, 0)
        if problem:
            problems.append(problem)
        else:
            grads_to_check.append(name)
    problem = diff_report(got["y"], expected["y"], f"{what}: output", **_TP_TOL)
    if problem:
        problems.append(problem)  # the gradients follow from it: not compared
    elif got["x_grad"] is None:
        problems.append(f"{what}: the input got no gradient (is the graph cut, e.g. a .detach() or torch.no_grad()?)")
    else:
        problem = diff_report(got["x_grad"], expected["x_grad"], f"{what}: input gradient", **_TP_TOL)
        if problem:
            problems.append(problem)
        for name in grads_to_check:
            grad = got["grads"].get(name)
            problem = (f"{what}: {name} got no gradient" if grad is None else
                       diff_report(grad, shard(name, expected["grads"][name]), f"{what}: gradient of {name}", **_TP_TOL))
            if problem:
                problems.append(problem)
    for phase, calls, want in (("forward", got["fwd"], fwd), ("backward", got["bwd"], bwd)):
        if want is not None and calls is not None and sorted(calls) != sorted(want):
            problems.append(f"{what}: the {phase} pass made {_tp_calls_text(calls)}, expected {_tp_calls_text(want)}")
    return problems


def _tp_expect(world: int, *calls, ranks=None) -> list:
    """Expected collectives: (name, elements) pairs, all in the group of `ranks` (default: the world)."""
    ranks = tuple(range(world)) if ranks is None else tuple(ranks)
    return [(name, n, ranks) for name, n in calls]


def _tp_rows(rank, world):
    return lambda name, t: t.chunk(world, dim=0)[rank]


def _tp_cols_or_whole(rank, world):  # row-parallel: weight split along in, bias whole
    return lambda name, t: t.chunk(world, dim=1)[rank] if t.dim() == 2 else t


_TP_WORLDS = [2, 4]


@pytest.mark.parametrize("world", _TP_WORLDS)
def test_2_7_f_g_gather_scatter_operators(grade, world):
    results = _tp_section(grade("2.7"), world, "ops")
    data = _tp_data(world)
    xs, gs, xw, gw = data["x_small"], data["g_small"], data["x_wide"], data["g_wide"]
    n = xs[0].numel()
    problems = []
    for rank, ops in enumerate(results):
        expected = {  # name: (output, input gradient, forward collectives, backward collectives, what it is)
            "f": (xs[rank], gs.sum(0), [], None, "f (CopyToTensorParallelRegion): forward identity, backward all-reduce"),
            "g": (xs.sum(0), gs[rank], None, [], "g (ReduceFromTensorParallelRegion): forward all-reduce, backward identity"),
            "gather": (torch.cat(list(xs), dim=-1), gw[rank].chunk(world, dim=-1)[rank], None, [],
                       "GatherFromTensorParallelRegion: forward all-gather (last dim), backward this rank's slice"),
            "scatter": (xw[rank].chunk(world, dim=-1)[rank], torch.cat(list(gs), dim=-1), [], None,
                        "ScatterToTensorParallelRegion: forward this rank's slice, backward all-gather"),
        }
        for name, (y, x_grad, fwd, bwd, what) in expected.items():
            for variant, how in ((name, "Op.apply(x, None)"), ((name, "default group"), "Op.apply(x)"),
                                 ((name, "not contiguous"), "Op.apply(x, None), x and the upstream gradient not "
                                                            "contiguous in memory")):
                got, where = ops[variant], f"{what}; {how}, on rank {rank} of {world}"
                problem = diff_report(got["y"], y, f"{where}: output", **_TP_TOL) or \
                    (f"{where}: the input got no gradient" if got["x_grad"] is None else
                     diff_report(got["x_grad"], x_grad, f"{where}: input gradient", **_TP_TOL))
                if problem:
                    problems.append(problem)
                problems += _tp_changed(got, where)
                for phase, calls, want in (("forward", got["fwd"], fwd), ("backward", got["bwd"], bwd)):
                    if want is not None and calls != want:
                        problems.append(f"{where}: its {phase} must not communicate, it made {_tp_calls_text(calls)}")
    assert_no_problems(problems, f"the region operators are wrong in a world of {world} (rank r's input is "
                                 f"different on every rank; {n} elements each):")


def _tp_linear_truth(kind: str, data: dict, bias: bool) -> dict:
    c = _TP_SIZES
    size = {"column": "col", "row": "row"}[kind]
    full = nn.Linear(c[f"{size}_in"], c[f"{size}_out"], bias=bias)
    full.load_state_dict(data[kind if bias else f"{kind}_no_bias"])
    return _tp_reference(full, data[f"x_{kind}"], data[f"g_{kind}"])


def _tp_column_problems(got: dict, data: dict, gather: bool, bias: bool, rank: int, world: int, ranks=None) -> list:
    c = _TP_SIZES
    bsi, bso = c["batch"] * c["seq"] * c["col_in"], c["batch"] * c["seq"] * c["col_out"]
    truth = _tp_linear_truth("column", data, bias)
    if not gather:
        truth = dict(truth, y=truth["y"].chunk(world, dim=-1)[rank])
    where = (f"ColumnParallelLinear(gather_output={gather}, bias={bias}) on rank {rank} of {world}"
             + (f" in the group of ranks {list(ranks)}" if ranks else ""))
    return _tp_problems(got, truth, _tp_rows(rank, world), where,
                        fwd=_tp_expect(world, *([("all_gather", bso // world)] if gather else []), ranks=ranks),
                        bwd=_tp_expect(world, ("all_reduce", bsi), ranks=ranks))


def _tp_row_problems(got: dict, data: dict, parallel: bool, bias: bool, rank: int, world: int, ranks=None) -> list:
    c = _TP_SIZES
    bsi, bso = c["batch"] * c["seq"] * c["row_in"], c["batch"] * c["seq"] * c["row_out"]
    truth = _tp_linear_truth("row", data, bias)
    if parallel:
        truth = dict(truth, x_grad=truth["x_grad"].chunk(world, dim=-1)[rank])
    where = (f"RowParallelLinear(input_is_parallel={parallel}, bias={bias}) on rank {rank} of {world}"
             + (f" in the group of ranks {list(ranks)}" if ranks else ""))
    return _tp_problems(got, truth, _tp_cols_or_whole(rank, world), where,
                        fwd=_tp_expect(world, ("all_reduce", bso), ranks=ranks),
                        bwd=_tp_expect(world, *([] if parallel else [("all_gather", bsi // world)]), ranks=ranks))


@pytest.mark.parametrize("world", _TP_WORLDS)
def test_2_7_column_parallel_linear_matches_nn_linear(grade, world):
    results = _tp_section(grade("2.7"), world, "column")
    data = _tp_data(world)
    problems = [problem for rank, runs in enumerate(results) for (gather, bias) in _TP_COLUMN_RUNS
                for problem in _tp_column_problems(runs[gather, bias], data, gather, bias, rank, world)]
    assert_no_problems(problems, "each rank must hold rows r*n:(r+1)*n of W and b (no b with bias=False), output its "
                                 "columns of Y (or all of Y, gathered), and get the FULL input gradient (f all-reduces "
                                 "it in backward):")


@pytest.mark.parametrize("world", _TP_WORLDS)
def test_2_7_row_parallel_linear_matches_nn_linear(grade, world):
    results = _tp_section(grade("2.7"), world, "row")
    data = _tp_data(world)
    problems = [problem for rank, runs in enumerate(results) for (parallel, bias) in _TP_ROW_RUNS
                for problem in _tp_row_problems(runs[parallel, bias], data, parallel, bias, rank, world)]
    assert_no_problems(problems, "each rank must hold columns r*n:(r+1)*n of W and the whole bias (none with bias=False), "
                                 "all-reduce the partial sums X_r W_r^T and add the bias ONCE, after the reduction:")


def _tp_mlp_problems(got: dict, data: dict, ref, rank: int, world: int, where: str, one: list) -> list:
    c = _TP_SIZES
    full = ref.MLP(c["hidden"], c["ffn"])
    full.load_state_dict(data["mlp"])
    truth = _tp_reference(full, data["x_mlp"], data["g_mlp"])
    rows, cols = _tp_rows(rank, world), _tp_cols_or_whole(rank, world)
    return _tp_problems(got, truth, lambda name, t: (rows if name.startswith("fc1") else cols)(name, t), where,
                        fwd=one, bwd=one)


@pytest.mark.parametrize("world", _TP_WORLDS)
def test_2_7_parallel_mlp_matches_reference_one_allreduce_each_way(grade, world):
    results = _tp_section(grade("2.7"), world, "mlp")
    data, c, ref = _tp_data(world), _TP_SIZES, grading.reference("2.7")
    one = _tp_expect(world, ("all_reduce", c["batch"] * c["seq"] * c["hidden"]))
    problems = [problem for rank, got in enumerate(results)
                for problem in _tp_mlp_problems(got, data, ref, rank, world, f"ParallelMLP on rank {rank} of {world}", one)]
    assert_no_problems(problems, "ParallelMLP (fc1 column-parallel, GELU, fc2 row-parallel) must equal the unsharded MLP "
                                 "with exactly one all-reduce of b*s*h elements in forward (g) and one in backward (f):")


def _tp_attention_problems(got: dict, data: dict, ref, causal: bool, rank: int, world: int, where: str,
                           ranks=None) -> list:
    c = _TP_SIZES
    e = c["embed"]
    full = ref.SelfAttention(e, c["heads"], causal=causal)
    full.load_state_dict(data["attention"])
    truth = _tp_reference(full, data["x_attention"], data["g_attention"])

    def shard(name, t):  # qkv: this rank's heads of each of q, k, v; out: row-parallel
        if name.startswith("qkv"):
            return torch.cat([part.chunk(world, dim=0)[rank] for part in t.split(e, dim=0)])
        return _tp_cols_or_whole(rank, world)(name, t)

    one = _tp_expect(world, ("all_reduce", c["batch"] * c["seq"] * e), ranks=ranks)
    return _tp_problems(got, truth, shard, where, fwd=one, bwd=one)


@pytest.mark.parametrize("world", _TP_WORLDS)
def test_2_7_parallel_attention_matches_reference_one_allreduce_each_way(grade, world):
    results = _tp_section(grade("2.7"), world, "attention")
    data, c, ref = _tp_data(world), _TP_SIZES, grading.reference("2.7")
    problems = [problem for causal in (False, True) for rank, runs in enumerate(results)
                for problem in _tp_attention_problems(runs[causal], data, ref, causal, rank, world,
                                                      f"ParallelSelfAttention(causal={causal}) on rank {rank} of {world}")]
    assert_no_problems(problems, f"ParallelSelfAttention ({c['heads']} heads, {c['heads'] // world} per rank) must equal "
                                 "the unsharded SelfAttention; rank r's qkv holds [W_q; W_k; W_v] rows of ITS heads; "
                                 "exactly one all-reduce of b*s*h elements in forward and one in backward:")


def test_2_7_layers_built_on_a_group_communicate_only_within_it(grade):
    """In a world of 4 split into tensor-parallel groups {0, 1} and {2, 3} (built by the test), the layers and the
    MLP built with group= must equal the unsharded ones with shards of that group, and talk only to that group."""
    results = _tp_section(grade("2.7"), 4, "subgroup")
    data, c, ref = _tp_data(4), _TP_SIZES, grading.reference("2.7")
    problems = []
    for rank, got in enumerate(results):
        ranks, tp_rank = _TP_HALVES[rank // 2], rank % 2
        one = _tp_expect(2, ("all_reduce", c["batch"] * c["seq"] * c["hidden"]), ranks=ranks)
        problems += _tp_mlp_problems(got["mlp"], data, ref, tp_rank, 2,
                                     f"ParallelMLP(group={ranks}) on rank {rank} of 4", one)
        problems += _tp_column_problems(got["column"], data, True, True, tp_rank, 2, ranks=ranks)
        problems += _tp_row_problems(got["row"], data, False, True, tp_rank, 2, ranks=ranks)
        problems += _tp_attention_problems(got["attention"], data, ref, False, tp_rank, 2,
                                           f"ParallelSelfAttention(group={ranks}) on rank {rank} of 4", ranks=ranks)
    assert_no_problems(problems, "with group=, the shards are those of the group's rank (dist.get_rank(group)) and its "
                                 "size, and every collective goes to that group (group=... in each call):")


@pytest.mark.parametrize("world", _TP_WORLDS)
def test_2_7_layers_built_by_their_constructors_match_the_full_ones(grade, world):
    """Every layer built by its constructor, each option (bias, gather_output, input_is_parallel, causal, group)
    spelled out or left to its default, group the world's or a subgroup, then filled by copy_from_full_: its
    forward equals the unsharded module's (this rank's part of it), on data that needs no gradient, 2-D and 3-D,
    under torch.no_grad() and not; an attention with one head per rank and a sequence of 1; the region operators
    on 3-D float64 tensors."""
    problems = [p for rank_problems in _tp_section(grade("2.7"), world, "built") for p in rank_problems]
    assert_no_problems(problems, f"layers built by their constructors and copy_from_full_ in a world of {world}:")


def test_tensor_parallel_sizes_that_do_not_split_raise_value_error(grade):
    """Not graded (the checks are given in the template): the reference must keep them."""
    problems = [p for rank_problems in _tp_section(grade("2.7"), 2, "sizes") for p in rank_problems]
    assert_no_problems(problems, "bad sizes must fail at construction with a ValueError:")
