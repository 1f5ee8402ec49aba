"""Graded tests of exercise 2.7, tensor parallelism (phase2_advanced/guidelines.md, section 2.7).

Run them with `python tests/test_phase2.py -k 2_7` (your code) or
`pytest tests/test_phase2.py -k 2_7` (the reference); tests/test_phase2.py collects them.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import grading
from compare import assert_no_problems, diff_report
from common.launch import WorldError, run_world
from common.models import MLP
from common.distributed import current_device


#
# One world per world size (2 and 4) runs every check; each rank returns, per section,
# its outputs, gradients, parameter shards and the collectives it called (counted by
# wrapping dist.all_reduce / dist.all_gather inside the rank). All assertions happen
# here against the unsharded modules run in this process.

_TP_SIZES = dict(batch=2, seq=5, col_in=6, col_out=8, row_in=8, row_out=6, hidden=8, ffn=16, embed=16, heads=8)
_TP_TOL = dict(rtol=1e-5, atol=1e-5)
_tp_calls: list[tuple[str, int]] = []  # (collective, elements sent), filled inside a rank


def _tp_data(world: int) -> dict:
    """Weights, inputs and upstream gradients, made here (seeded, the global RNG untouched) and shipped to every rank."""
    ref, c = grading.reference("2.7"), _TP_SIZES
    b, s = c["batch"], c["seq"]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return {
            "column": nn.Linear(c["col_in"], c["col_out"]).state_dict(),
            "row": nn.Linear(c["row_in"], c["row_out"]).state_dict(),
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


def _tp_counting(name: str, real):
    sent = {"all_reduce": (0, "tensor"), "all_gather": (1, "tensor"), "all_gather_into_tensor": (1, "input_tensor")}[name]

    def counted(*args, **kwargs):
        i, key = sent
        tensor = args[i] if len(args) > i else kwargs.get(key)
        _tp_calls.append((name.replace("_into_tensor", ""), tensor.numel() if tensor is not None else -1))
        return real(*args, **kwargs)

    return counted


def _tp_logged(fn):
    """(fn(), the collectives it called)."""
    _tp_calls.clear()
    result = fn()
    calls = list(_tp_calls)
    _tp_calls.clear()
    return result, calls


def _tp_cpu(t):
    return None if t is None else t.detach().cpu().clone()


def _tp_fwd_bwd(module, x: torch.Tensor, g: torch.Tensor) -> dict:
    """Forward, then backward with upstream gradient g; outputs, grads and collectives of each pass."""
    x = x.clone().requires_grad_(True)
    params = dict(module.named_parameters()) if isinstance(module, nn.Module) else {}
    y, fwd = _tp_logged(lambda: module(x))
    out = {"y": _tp_cpu(y), "fwd": fwd, "bwd": None, "x_grad": None,
           "params": {n: _tp_cpu(p) for n, p in params.items()}, "grads": {}}
    if y.shape != g.shape:
        return out  # reported as a shape mismatch of y
    _, out["bwd"] = _tp_logged(lambda: y.backward(g.clone()))  # a copy: an in-place backward may modify it
    out["x_grad"] = _tp_cpu(x.grad)
    out["grads"] = {n: _tp_cpu(p.grad) for n, p in params.items()}
    return out


def _tp_ops(mod, data, dev):
    rank, world = dist.get_rank(), dist.get_world_size()
    small, wide = data["x_small"][rank].to(dev), data["x_wide"][rank].to(dev)
    g_small, g_wide = data["g_small"][rank].to(dev), data["g_wide"][rank].to(dev)
    cases = {  # name: (Function, input, upstream gradient)
        "f": (mod.CopyToTensorParallelRegion, small, g_small),
        "g": (mod.ReduceFromTensorParallelRegion, small, g_small),
        "gather": (mod.GatherFromTensorParallelRegion, small, g_wide),
        "scatter": (mod.ScatterToTensorParallelRegion, wide, g_small),
    }
    return {name: _tp_fwd_bwd(fn.apply, x, g) for name, (fn, x, g) in cases.items()}


def _tp_full(kind: str, mod, data, dev, **kwargs):
    c = _TP_SIZES
    full = {"column": lambda: nn.Linear(c["col_in"], c["col_out"]), "row": lambda: nn.Linear(c["row_in"], c["row_out"]),
            "mlp": lambda: mod.MLP(c["hidden"], c["ffn"]),
            "attention": lambda: mod.SelfAttention(c["embed"], c["heads"], **kwargs)}[kind]().to(dev)
    full.load_state_dict(data[kind])
    return full


def _tp_column(mod, data, dev):
    rank, world = dist.get_rank(), dist.get_world_size()
    x, g = data["x_column"].to(dev), data["g_column"].to(dev)
    out = {}
    for gather in (False, True):
        layer = mod.ColumnParallelLinear.from_full(_tp_full("column", mod, data, dev), gather_output=gather)
        out[gather] = _tp_fwd_bwd(layer, x, g if gather else g.chunk(world, dim=-1)[rank])
    return out


def _tp_row(mod, data, dev):
    rank, world = dist.get_rank(), dist.get_world_size()
    x, g = data["x_row"].to(dev), data["g_row"].to(dev)
    out = {}
    for parallel in (True, False):
        layer = mod.RowParallelLinear.from_full(_tp_full("row", mod, data, dev), input_is_parallel=parallel)
        out[parallel] = _tp_fwd_bwd(layer, x.chunk(world, dim=-1)[rank] if parallel else x, g)
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


_TP_SECTIONS = {"ops": _tp_ops, "column": _tp_column, "row": _tp_row, "mlp": _tp_mlp,
                "attention": _tp_attention, "sizes": _tp_sizes}


def _tp_rank(ref: grading.ModuleRef, data: dict):
    mod = ref.load()
    dev = current_device()
    real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "all_gather_into_tensor")}
    for name, fn in real.items():
        setattr(dist, name, _tp_counting(name, fn))
    results = {}
    try:
        for name, section in _TP_SECTIONS.items():
            try:
                results[name] = section(mod, data, dev)
            except Exception as exc:  # noqa: BLE001 - reported by the test of that section
                results[name] = {"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
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
    return "[" + ", ".join(f"{op}({n} elements)" for op, n in calls) + "]" if calls else "no collective"


def _tp_problems(got: dict, expected: dict, shard, what: str, fwd=None, bwd=None) -> list[str]:
    """Compare one rank's run with the ground truth. shard(name, full tensor) -> this rank's expected part.
    fwd / bwd: the exact list of collectives expected in each pass (None: not checked)."""
    problems, grads_to_check = [], []
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
            got, where = ops[name], f"{what}; on rank {rank} of {world}"
            problem = diff_report(got["y"], y, f"{where}: output", **_TP_TOL) or \
                (f"{where}: the input got no gradient" if got["x_grad"] is None else
                 diff_report(got["x_grad"], x_grad, f"{where}: input gradient", **_TP_TOL))
            if problem:
                problems.append(problem)
            for phase, calls, want in (("forward", got["fwd"], fwd), ("backward", got["bwd"], bwd)):
                if want is not None and calls != want:
                    problems.append(f"{where}: its {phase} must not communicate, it made {_tp_calls_text(calls)}")
    assert_no_problems(problems, f"the region operators are wrong in a world of {world} (rank r's input is "
                                 f"different on every rank; {n} elements each):")


@pytest.mark.parametrize("world", _TP_WORLDS)
def test_2_7_column_parallel_linear_matches_nn_linear(grade, world):
    results = _tp_section(grade("2.7"), world, "column")
    data, c = _tp_data(world), _TP_SIZES
    full = nn.Linear(c["col_in"], c["col_out"])
    full.load_state_dict(data["column"])
    truth = _tp_reference(full, data["x_column"], data["g_column"])
    bsi, bso = c["batch"] * c["seq"] * c["col_in"], c["batch"] * c["seq"] * c["col_out"]
    problems = []
    for rank, runs in enumerate(results):
        local = dict(truth, y=truth["y"].chunk(world, dim=-1)[rank])
        problems += _tp_problems(runs[False], local, _tp_rows(rank, world),
                                 f"ColumnParallelLinear(gather_output=False) on rank {rank} of {world}",
                                 fwd=[], bwd=[("all_reduce", bsi)])
        problems += _tp_problems(runs[True], truth, _tp_rows(rank, world),
                                 f"ColumnParallelLinear(gather_output=True) on rank {rank} of {world}",
                                 fwd=[("all_gather", bso // world)], bwd=[("all_reduce", bsi)])
    assert_no_problems(problems, "each rank must hold rows r*n:(r+1)*n of W and b, output its columns of Y (or all of Y, "
                                 "gathered), and get the FULL input gradient (f all-reduces it in backward):")


@pytest.mark.parametrize("world", _TP_WORLDS)
def test_2_7_row_parallel_linear_matches_nn_linear(grade, world):
    results = _tp_section(grade("2.7"), world, "row")
    data, c = _tp_data(world), _TP_SIZES
    full = nn.Linear(c["row_in"], c["row_out"])
    full.load_state_dict(data["row"])
    truth = _tp_reference(full, data["x_row"], data["g_row"])
    bsi, bso = c["batch"] * c["seq"] * c["row_in"], c["batch"] * c["seq"] * c["row_out"]
    problems = []
    for rank, runs in enumerate(results):
        local = dict(truth, x_grad=truth["x_grad"].chunk(world, dim=-1)[rank])
        problems += _tp_problems(runs[True], local, _tp_cols_or_whole(rank, world),
                                 f"RowParallelLinear(input_is_parallel=True) on rank {rank} of {world}",
                                 fwd=[("all_reduce", bso)], bwd=[])
        problems += _tp_problems(runs[False], truth, _tp_cols_or_whole(rank, world),
                                 f"RowParallelLinear(input_is_parallel=False) on rank {rank} of {world}",
                                 fwd=[("all_reduce", bso)], bwd=[("all_gather", bsi // world)])
    assert_no_problems(problems, "each rank must hold columns r*n:(r+1)*n of W and the whole bias, all-reduce the partial "
                                 "sums X_r W_r^T and add the bias ONCE, after the reduction:")


@pytest.mark.parametrize("world", _TP_WORLDS)
def test_2_7_parallel_mlp_matches_reference_one_allreduce_each_way(grade, world):
    results = _tp_section(grade("2.7"), world, "mlp")
    data, c, ref = _tp_data(world), _TP_SIZES, grading.reference("2.7")
    full = ref.MLP(c["hidden"], c["ffn"])
    full.load_state_dict(data["mlp"])
    truth = _tp_reference(full, data["x_mlp"], data["g_mlp"])
    one = [("all_reduce", c["batch"] * c["seq"] * c["hidden"])]
    problems = []
    for rank, got in enumerate(results):
        rows, cols = _tp_rows(rank, world), _tp_cols_or_whole(rank, world)
        problems += _tp_problems(got, truth, lambda name, t: (rows if name.startswith("fc1") else cols)(name, t),
                                 f"ParallelMLP on rank {rank} of {world}", fwd=one, bwd=one)
    assert_no_problems(problems, "ParallelMLP (fc1 column-parallel, GELU, fc2 row-parallel) must equal the unsharded MLP "
                                 "with exactly one all-reduce of b*s*h elements in forward (g) and one in backward (f):")


@pytest.mark.parametrize("world", _TP_WORLDS)
def test_2_7_parallel_attention_matches_reference_one_allreduce_each_way(grade, world):
    results = _tp_section(grade("2.7"), world, "attention")
    data, c, ref = _tp_data(world), _TP_SIZES, grading.reference("2.7")
    e = c["embed"]
    one = [("all_reduce", c["batch"] * c["seq"] * e)]
    problems = []
    for causal in (False, True):
        full = ref.SelfAttention(e, c["heads"], causal=causal)
        full.load_state_dict(data["attention"])
        truth = _tp_reference(full, data["x_attention"], data["g_attention"])
        for rank, runs in enumerate(results):
            def shard(name, t, rank=rank):  # qkv: this rank's heads of each of q, k, v; out: row-parallel
                if name.startswith("qkv"):
                    return torch.cat([part.chunk(world, dim=0)[rank] for part in t.split(e, dim=0)])
                return _tp_cols_or_whole(rank, world)(name, t)

            problems += _tp_problems(runs[causal], truth, shard,
                                     f"ParallelSelfAttention(causal={causal}) on rank {rank} of {world}",
                                     fwd=one, bwd=one)
    assert_no_problems(problems, f"ParallelSelfAttention ({c['heads']} heads, {c['heads'] // world} per rank) must equal "
                                 "the unsharded SelfAttention; rank r's qkv holds [W_q; W_k; W_v] rows of ITS heads; "
                                 "exactly one all-reduce of b*s*h elements in forward and one in backward:")


def test_tensor_parallel_sizes_that_do_not_split_raise_value_error(grade):
    """Not graded (the checks are given in the template): the reference must keep them."""
    problems = [p for rank_problems in _tp_section(grade("2.7"), 2, "sizes") for p in rank_problems]
    assert_no_problems(problems, "bad sizes must fail at construction with a ValueError:")
