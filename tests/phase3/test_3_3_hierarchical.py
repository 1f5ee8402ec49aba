"""Graded tests of exercise 3.3, topology-aware (hierarchical) all-reduce
(phase3_multi_node/guidelines.md, section 3.3).

Run them with `python tests/test_phase3.py -k 3_3` (your code) or
`pytest tests/test_phase3.py -k 3_3` (the reference); tests/test_phase3.py collects them.

Two worlds (4 ranks as 2x2, 4x1, 1x4 nodes; 6 ranks as 2x3 and 3x2) each check, per
node shape: your topology_from_env, your all-reduce on groups built by the reference
(values, in place, same bits on every rank, which groups it uses, bytes across nodes),
then your build_groups (last: a group built out of step cannot spoil the other checks).
The cost model is checked in this process; one test runs your code under two real
torchrun agents. Ranks return plain data; assertions happen here.
"""

from __future__ import annotations

import os
import pickle
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import grading
from common.launch import WorldError, run_world
from common.measure import CollectiveLog, ring_elements_sent
from common.torchrun import Torchrun, TorchrunError, free_port, multi_node_args
from compare import assert_no_problems, diff_report

_HIER_SHAPES = {4: [(2, 2), (4, 1), (1, 4)], 6: [(2, 3), (3, 2)]}  # world -> (nodes, ranks per node)
_HIER_CASES = [  # (dtype, shape): numel divisible by the node size or not, smaller than it, a scalar
    (torch.float32, (1001,)), (torch.float32, (3, 5, 7)), (torch.float64, (17,)), (torch.int64, (4, 4)),
    (torch.int32, (1,)), (torch.float16, (33,)), (torch.bfloat16, (5,)), (torch.float32, ()),
]
# Exact cases: values whose sums need more than float32's 24-bit mantissa (int64 and float64 near 2**40, int32
# near 2**28, complex64 with an imaginary part), exactly representable so that any order of addition gives the
# same bits; numel 7 needs padding for node sizes 2, 3 and 4. Compared bit for bit with dist.all_reduce.
_HIER_EXACT_CASES = [(torch.int64, "sum"), (torch.float64, "sum"), (torch.float64, "avg"), (torch.int32, "sum"),
                     (torch.complex64, "sum"), (torch.int8, "sum"), (torch.uint8, "sum")]
_HIER_EXACT_NUMEL = 7
_HIER_BYTES_NUMEL = 840  # divisible by every node size above: no padding in the count
_TOPOLOGY_FIELDS = ("rank", "node_rank", "local_rank", "num_nodes", "ranks_per_node")
_TORCHRUN_DEADLINE_S = float(os.environ.get("COURSE_TORCHRUN_TIMEOUT", "120"))


def _where(shape) -> str:
    return f"{shape[0]} nodes x {shape[1]} ranks"


def _error(exc: BaseException) -> dict:
    return {"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}


def _ranks(group) -> list[int]:
    return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)


def _expected_topology(rank: int, shape) -> dict:
    n, k = shape
    return dict(rank=rank, node_rank=rank // k, local_rank=rank % k, num_nodes=n, ranks_per_node=k)


def _expected_groups(rank: int, shape) -> dict[str, list[int]]:
    n, k = shape
    node, local = divmod(rank, k)
    return {"intra": [node * k + j for j in range(k)], "inter": [i * k + local for i in range(n)]}


def _fields(topology) -> dict:
    return {f: getattr(topology, f, None) for f in _TOPOLOGY_FIELDS}


def _topology_checks(mod, shape) -> dict:
    """Your topology_from_env: with ranks_per_node; from torchrun's variables; on a world that does not split."""
    n, k = shape
    rank, out = dist.get_rank(), {}
    try:
        out["ranks_per_node"] = _fields(mod.topology_from_env(ranks_per_node=k))
    except Exception as exc:  # noqa: BLE001
        out["ranks_per_node"] = _error(exc)
    saved = {v: os.environ.get(v) for v in ("GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    os.environ.update(GROUP_RANK=str(rank // k), LOCAL_RANK=str(rank % k), LOCAL_WORLD_SIZE=str(k))
    try:
        out["torchrun_env"] = _fields(mod.topology_from_env())
    except Exception as exc:  # noqa: BLE001
        out["torchrun_env"] = _error(exc)
    finally:
        for var, value in saved.items():
            os.environ.pop(var, None) if value is None else os.environ.__setitem__(var, value)
    # torchrun's variables, all in range, but another rank's: GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK != RANK
    node, local = divmod(rank, k)
    node, local = ((node + 1) % n, local) if n > 1 else (node, (local + 1) % k)
    os.environ.update(GROUP_RANK=str(node), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(k))
    try:
        got = mod.topology_from_env()
        out["contradicting_env"] = f"returned {_fields(got)}"
    except ValueError:
        out["contradicting_env"] = None
    except Exception as exc:  # noqa: BLE001
        out["contradicting_env"] = f"raised {type(exc).__name__}: {exc}" if not grading.todo_of(exc) else _error(exc)
    finally:
        for var, value in saved.items():
            os.environ.pop(var, None) if value is None else os.environ.__setitem__(var, value)
    for key, nodes_of in (("bad_split", dist.get_world_size() - 1 if dist.get_world_size() > 2 else 3),
                          ("zero_split", None)):  # nodes that do not divide the world; torchrun's nodes of no rank
        if nodes_of is None:
            os.environ.update(GROUP_RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="0")
        try:
            mod.topology_from_env(ranks_per_node=nodes_of)
            out[key] = "returned a topology"
        except ValueError:
            out[key] = None
        except Exception as exc:  # noqa: BLE001
            out[key] = f"raised {type(exc).__name__}: {exc}" if not grading.todo_of(exc) else _error(exc)
        finally:
            for var, value in saved.items():
                os.environ.pop(var, None) if value is None else os.environ.__setitem__(var, value)
    return out


def _exact_input(dtype: torch.dtype, numel: int, gen: torch.Generator) -> torch.Tensor:
    """Values far beyond float32's precision whose sum over 6 ranks is exact in `dtype`, in any order."""
    if dtype == torch.int64:
        return torch.randint(-2**41, 2**41, (numel,), generator=gen, dtype=torch.int64)
    if dtype == torch.float64:  # multiples of 1/8 up to 2**41: sums of 6 need 47 bits of the 53
        return torch.randint(-2**44, 2**44, (numel,), generator=gen, dtype=torch.int64).double() / 8
    if dtype == torch.int32:  # up to 2**28: sums of 6 stay below 2**31
        return torch.randint(-2**28, 2**28, (numel,), generator=gen, dtype=torch.int32)
    if dtype == torch.complex64:  # integers up to 2**20 in both parts: exact in float32
        parts = torch.randint(-2**20, 2**20, (numel, 2), generator=gen).float()
        return torch.view_as_complex(parts.contiguous())
    if dtype == torch.int8:
        return torch.randint(-20, 21, (numel,), generator=gen, dtype=torch.int8)
    if dtype == torch.uint8:
        return torch.randint(0, 41, (numel,), generator=gen, dtype=torch.uint8)
    raise ValueError(dtype)


def _exact_checks(mod, groups, shape) -> tuple[list[str], dict]:
    """Your hierarchical_all_reduce on _HIER_EXACT_CASES: the same bits as dist.all_reduce (avg: to 1e-13)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    problems, results = [], {}
    for index, (dtype, op) in enumerate(_HIER_EXACT_CASES):
        gen = torch.Generator().manual_seed(5000 + 100 * rank + index)
        x = _exact_input(dtype, _HIER_EXACT_NUMEL, gen)
        expected = x.clone()
        dist.all_reduce(expected)
        if op == "avg":
            expected /= world
        actual = x.clone()
        returned = mod.hierarchical_all_reduce(actual, groups, op=op)
        what = f"hierarchical_all_reduce(op={op!r}, {dtype}, {_HIER_EXACT_NUMEL} values near {_magnitude(dtype)})"
        where = f"{what} on rank {rank}, {_where(shape)}"
        if returned is not actual:
            problems.append(f"{where}: must reduce the given tensor in place and return it")
        if actual.dtype != dtype:
            problems.append(f"{where}: the tensor's dtype became {actual.dtype}")
            continue
        problem = diff_report(actual, expected, where, rtol=1e-13 if op == "avg" else 0, atol=0)
        if problem:
            problems.append(problem + " (a buffer, padding included, of another dtype than the tensor's, e.g. "
                                      "torch.zeros' default float32, rounds these values)")
        results[what] = actual
    return problems, results


def _magnitude(dtype: torch.dtype) -> str:
    return {torch.int64: "2**41", torch.float64: "2**41 (in eighths)", torch.int32: "2**28",
            torch.complex64: "2**20 (real and imaginary)", torch.int8: "20", torch.uint8: "40"}[dtype]


def _reduce_checks(mod, groups, shape) -> dict:
    """Your hierarchical_all_reduce on the reference's groups: results, problems, groups used, bytes across nodes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    k = shape[1]
    node_of = {r: r // k for r in range(world)}
    problems, results, crossing = [], {}, 0.0
    cases = [(dtype, s, op) for dtype, s in _HIER_CASES for op in ("sum", "avg")
             if op == "sum" or dtype.is_floating_point]
    cases.append((torch.float32, (_HIER_BYTES_NUMEL,), "bytes"))
    for dtype, s, op in cases:
        gen = torch.Generator().manual_seed(1000 * rank + len(s) + (s[0] if s else 7))
        x = (torch.randn(s, generator=gen) * 10).to(dtype) if dtype.is_floating_point else \
            torch.randint(-100, 100, s, generator=gen).to(dtype)
        expected = x.clone()
        dist.all_reduce(expected)
        if op == "avg":
            expected /= world
        actual = x.clone()
        with CollectiveLog(also_in=(mod,)) as log:
            returned = mod.hierarchical_all_reduce(actual, groups, op="sum" if op == "bytes" else op)
        what = f"hierarchical_all_reduce(op={'sum' if op == 'bytes' else op!r}, {dtype}, shape {tuple(s)})"
        where = f"{what} on rank {rank}, {_where(shape)}"
        if returned is not actual:
            problems.append(f"{where}: must reduce the given tensor in place and return it")
        tol = dict(rtol=2e-2, atol=5e-2) if dtype in (torch.float16, torch.bfloat16) else dict(rtol=1e-5, atol=1e-4)
        problem = diff_report(actual, expected, where, **tol)
        if problem:
            problems.append(problem)
        results[what] = actual
        for call in log.calls:
            members = _ranks(call.group)
            nodes = {node_of[r] for r in members}
            if len(members) > 1 and 1 < len(nodes) < len(members):
                problems.append(f"{where}: {call.name} over ranks {members} (nodes {sorted(nodes)}): a collective "
                                "spans nodes AND holds several ranks of one node; use only the intra-node group "
                                "and the inter-node group")
            elif op == "bytes" and len(nodes) > 1:
                crossing += ring_elements_sent(call, len(members)) * dtype.itemsize
    # a tensor not contiguous in memory (a transpose; its storage is the caller's): reduced in place all the same,
    # not in a reshaped copy that is never written back
    gen = torch.Generator().manual_seed(77 + rank)
    base = torch.randn(5, 3, generator=gen)
    actual = base.t()
    expected = actual.contiguous()
    dist.all_reduce(expected)
    returned = mod.hierarchical_all_reduce(actual, groups)
    where = f"hierarchical_all_reduce(a non-contiguous (3, 5) float32 view, the transpose of a (5, 3)) on rank {rank}, " \
            f"{_where(shape)}"
    if returned is not actual:
        problems.append(f"{where}: must reduce the given tensor in place and return it")
    problem = diff_report(base.t(), expected, f"{where}: the caller's storage afterwards", rtol=1e-5, atol=1e-4)
    if problem:
        problems.append(problem + " (a reshape of a non-contiguous tensor is a copy: write the result back)")
    exact_problems, exact_results = _exact_checks(mod, groups, shape)
    problems += exact_problems
    results.update(exact_results)
    return {"problems": problems, "results": results, "crossing": crossing}


def _group_checks(mod, shape) -> dict:
    """Your build_groups: the ranks each group claims, and the ranks an all-reduce over it reaches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n, k = shape
    groups = mod.build_groups(mod.Topology(rank, rank // k, rank % k, n, k))
    out = {}
    for name in ("intra", "inter"):
        group = getattr(groups, name)
        present = torch.zeros(world)
        present[rank] = 1.0
        dist.all_reduce(present, group=group)  # who really answered: the ranks wired into this group
        out[name] = {"claims": _ranks(group), "reached": present.nonzero().flatten().tolist()}
    return out


def _hier_rank(ref: grading.ModuleRef) -> dict:
    mod, reference = ref.load(), grading.reference("3.3")
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = _HIER_SHAPES[world]
    # Every rank builds the reference's groups for every shape first, in the same order.
    ref_groups = {s: reference.build_groups(reference.Topology(rank, rank // s[1], rank % s[1], *s)) for s in shapes}
    out = {"topology": {}, "reduce": {}, "groups": {}}
    for shape in shapes:
        out["topology"][shape] = _topology_checks(mod, shape)
        try:
            out["reduce"][shape] = _reduce_checks(mod, ref_groups[shape], shape)
        except Exception as exc:  # noqa: BLE001 - stop: the ranks may be out of step now
            out["reduce"][shape] = _error(exc)
            break
    for shape in shapes:
        try:
            out["groups"][shape] = _group_checks(mod, shape)
        except Exception as exc:  # noqa: BLE001 - stop: later groups would be out of step
            out["groups"][shape] = _error(exc)
            break
    return out


_hier_worlds: dict = {}  # (ModuleRef, world) -> per-rank results, or the exception the world raised


def _hier_results(ref: grading.ModuleRef, world: int) -> list:
    key = (ref, world)
    if key not in _hier_worlds:
        try:
            _hier_worlds[key] = run_world(_hier_rank, world, args=(ref,))
        except WorldError as exc:
            _hier_worlds[key] = exc
            raise
    results = _hier_worlds[key]
    if isinstance(results, BaseException):
        pytest.fail(f"not run: the world of {world} ranks failed (see the first 3.3 test that ran): "
                    f"{str(results).splitlines()[0]}")
    return results


def _raise(rank: int, error: dict, what: str) -> None:
    """A rank's exception, raised again here (a TODO stays TODO)."""
    if error["error"] == "NotImplementedError" and error["message"].startswith("TODO"):
        raise NotImplementedError(error["message"])
    pytest.fail(f"rank {rank} raised {error['error']} in {what}: {error['message']}\n{error['traceback']}")


def _per_shape(ref, part: str, world: int):
    """(shape, rank, result of `part`) for every shape the world reached, errors raised."""
    results = _hier_results(ref, world)
    for shape in _HIER_SHAPES[world]:
        for rank, result in enumerate(results):
            got = result[part].get(shape)
            if got is None:  # an earlier shape raised on this rank, and that was reported
                continue
            if "error" in got and "traceback" in got:
                _raise(rank, got, f"{part} for {_where(shape)} (world of {world})")
            yield shape, rank, got


@pytest.mark.parametrize("world", sorted(_HIER_SHAPES))
def test_3_3_topology_from_the_launch_environment(grade, world):
    problems = []
    for shape, rank, got in _per_shape(grade("3.3"), "topology", world):
        want = _expected_topology(rank, shape)
        for how in ("ranks_per_node", "torchrun_env"):
            result = got[how]
            if "error" in result:
                _raise(rank, result, f"topology_from_env ({how}), {_where(shape)}")
            if result != want:
                source = (f"topology_from_env(ranks_per_node={shape[1]})" if how == "ranks_per_node" else
                          f"topology_from_env() with GROUP_RANK={rank // shape[1]}, LOCAL_RANK={rank % shape[1]}, "
                          f"LOCAL_WORLD_SIZE={shape[1]}")
                diff = {f: (result[f], want[f]) for f in want if result[f] != want[f]}
                problems.append(f"{source} on rank {rank} of {world}: (got, expected) {diff}")
        for key, what in (("bad_split", "nodes that do not divide a world"),
                          ("zero_split", "LOCAL_WORLD_SIZE=0 (GROUP_RANK=0, LOCAL_RANK=0) in a world")):
            if isinstance(got[key], dict):
                _raise(rank, got[key], f"topology_from_env with {what}")
            if got[key]:
                problems.append(f"topology_from_env with {what} of {world} ranks {got[key]}; expected ValueError "
                                "(the docstring: the world does not split into equal nodes)")
    assert_no_problems(problems, "nodes are consecutive blocks of ranks_per_node ranks: "
                                 "rank = node_rank * ranks_per_node + local_rank (guidelines 3.3):")


@pytest.mark.parametrize("world", sorted(_HIER_SHAPES))
def test_3_3_contradicting_torchrun_variables_refused(grade, world):
    problems = []
    for shape, rank, got in _per_shape(grade("3.3"), "topology", world):
        result = got["contradicting_env"]
        if isinstance(result, dict):
            _raise(rank, result, "topology_from_env with contradicting variables")
        if result:
            n, k = shape
            node, local = divmod(rank, k)
            node, local = ((node + 1) % n, local) if n > 1 else (node, (local + 1) % k)
            problems.append(f"topology_from_env() on RANK={rank} of {world} with GROUP_RANK={node}, LOCAL_RANK={local}, "
                            f"LOCAL_WORLD_SIZE={k} {result}; expected ValueError ({node} * {k} + {local} != {rank})")
    assert_no_problems(problems, "torchrun's GROUP_RANK and LOCAL_RANK are read, and checked against RANK (the "
                                 "docstring: ValueError when the variables contradict the node-major numbering):")


@pytest.mark.parametrize("world", sorted(_HIER_SHAPES))
def test_3_3_groups_are_the_nodes_and_the_local_ranks(grade, world):
    problems = []
    for shape, rank, got in _per_shape(grade("3.3"), "groups", world):
        want = _expected_groups(rank, shape)
        for name, what in (("intra", "the ranks of its node"), ("inter", "the ranks with its local rank, one per node")):
            where = f"{_where(shape)}, rank {rank}: its {name} group"
            if got[name]["claims"] != want[name]:
                problems.append(f"{where} has ranks {got[name]['claims']}, expected {want[name]} ({what})")
            elif got[name]["reached"] != want[name]:
                problems.append(f"{where} claims ranks {want[name]} but an all-reduce over it reached ranks "
                                f"{got[name]['reached']}: ranks met under the same group name for different groups "
                                "(every rank must create every group, in the same order)")
    assert_no_problems(problems, "build_groups: intra = this rank's node, inter = one rank per node with this "
                                 "rank's local rank (guidelines 3.3):")


@pytest.mark.parametrize("world", sorted(_HIER_SHAPES))
def test_3_3_hierarchical_all_reduce_equals_dist_all_reduce(grade, world):
    problems = []
    by_shape: dict = {}
    for shape, rank, got in _per_shape(grade("3.3"), "reduce", world):
        problems += got["problems"]
        by_shape.setdefault(shape, []).append(got["results"])
    for shape, per_rank in by_shape.items():
        for what, tensor in per_rank[0].items():
            for rank in range(1, len(per_rank)):
                other = per_rank[rank][what]
                if not torch.equal(other, tensor):
                    problems.append(f"{what}, {_where(shape)}: rank {rank} and rank 0 hold different results; every "
                                    "rank must end with bitwise the same tensor")
    assert_no_problems(problems, f"hierarchical_all_reduce differs from dist.all_reduce on {world} ranks:")


@pytest.mark.parametrize("world", sorted(_HIER_SHAPES))
def test_3_3_only_one_shard_per_rank_crosses_nodes(grade, world):
    """Bytes a rank sends over collectives whose group spans nodes, counted as ring algorithms
    send them (ring_elements_sent), must be 2(N-1)/N x S/k: its shard, all-reduced across N nodes."""
    problems = []
    for shape, rank, got in _per_shape(grade("3.3"), "reduce", world):
        n, k = shape
        nbytes = _HIER_BYTES_NUMEL * 4
        want = 2 * (n - 1) / n * nbytes / k
        if abs(got["crossing"] - want) > 1e-6 * nbytes:
            problems.append(f"{_where(shape)}, rank {rank}: {got['crossing']:.0f} bytes crossed nodes to all-reduce "
                            f"{nbytes} bytes, expected 2(N-1)/N * S/k = {want:.0f} (x{got['crossing'] / want:.2f})"
                            if want else f"{_where(shape)}, rank {rank}: {got['crossing']:.0f} bytes crossed nodes "
                            "on a single node")
    assert_no_problems(problems, "across nodes goes only this rank's shard of the intra-node reduce-scatter "
                                 "(guidelines 3.3):")


def _cross_formula(nbytes, n, k) -> dict:
    """Flat ring in rank order: p hops per step, n of them leave a node (1 in k); each rank
    sends 2(p-1)/p * S, so on average 2(p-1)/p * S/k crosses. Hierarchical: 2(n-1)/n * S/k."""
    p = n * k
    return {"flat_ring": 2 * (p - 1) / p * nbytes / k if n > 1 else 0.0, "hierarchical": 2 * (n - 1) / n * nbytes / k}


def _time_formula(nbytes, n, k, intra, inter, nics) -> dict:
    p = n * k
    if p == 1:
        return {"flat_ring": 0.0, "hierarchical": 0.0}
    c = nbytes / p
    hops = [intra.alpha + c / intra.bandwidth] if k > 1 else []
    hops += [inter.alpha + c / inter.bandwidth] if n > 1 else []
    step = max(hops)  # the slowest hop of those the ring has: intra-node ones if k > 1, node-crossing ones if n > 1
    per_rank_bw = inter.bandwidth * min(1.0, (k if nics is None else nics) / k)
    return {"flat_ring": 2 * (p - 1) * step,
            "hierarchical": 2 * (k - 1) * (intra.alpha + nbytes / k / intra.bandwidth)
            + 2 * (n - 1) * (inter.alpha + nbytes / (k * n) / per_rank_bw)}


_CLUSTERS = [(2, 8), (16, 8), (1, 8), (4, 1), (1, 1), (3, 5), (2, 2), (2, 3)]  # 1000 B is no multiple of 3


def test_3_3_cross_node_bytes_formula(grade):
    mod = grade("3.3").load()
    problems = []
    for n, k in _CLUSTERS:
        for nbytes in (4e6, 1000.0):
            got, want = mod.cross_node_bytes(nbytes, n, k), _cross_formula(nbytes, n, k)
            for key in want:
                if abs(got.get(key, float("nan")) - want[key]) > 1e-9 * nbytes or key not in got:
                    problems.append(f"cross_node_bytes({nbytes:g}, num_nodes={n}, ranks_per_node={k})[{key!r}] = "
                                    f"{got.get(key)}, expected {want[key]:.6g}")
    assert_no_problems(problems, "flat ring: 2(p-1)/p * S per rank, of which the fraction of hops that leave a node; "
                                 "hierarchical: 2(N-1)/N * S/k (guidelines 3.3):")


def test_3_3_cost_model_matches_the_alpha_beta_formula(grade):
    mod = grade("3.3").load()
    nvlink = mod.Link(alpha=3e-6, bandwidth=150e9)
    networks = {"100 Gb/s": mod.Link(alpha=10e-6, bandwidth=100e9 / 8), "400 Gb/s": mod.Link(alpha=5e-6, bandwidth=400e9 / 8)}
    problems = []
    for n, k in _CLUSTERS:
        for label, net in networks.items():
            for nics in (None, 1):
                for nbytes in (1e3, 1e8):
                    got = mod.predict_seconds(nbytes, n, k, nvlink, net, nics_per_node=nics)
                    want = _time_formula(nbytes, n, k, nvlink, net, nics)
                    for key in want:
                        value = got.get(key, float("nan"))
                        if not abs(value - want[key]) <= 1e-9 * max(want[key], 1e-12):
                            problems.append(f"predict_seconds({nbytes:g} B, {n}x{k}, NVLink / {label}, "
                                            f"nics_per_node={nics})[{key!r}] = {value:.6g}, expected {want[key]:.6g}")
    assert_no_problems(problems, "alpha-beta model of a flat ring vs hierarchical all-reduce (guidelines 3.3):")


def test_3_3_flat_ring_step_waits_for_its_slowest_hop(grade):
    """Links where the node's own links are the slow ones (for every size, or only for small messages):
    a flat ring's step is its slowest hop, inside a node or across."""
    mod = grade("3.3").load()
    links = {
        "PCIe-only nodes (8 us, 16 GB/s) with a 400 Gb/s network (5 us)":
            (mod.Link(alpha=8e-6, bandwidth=16e9), mod.Link(alpha=5e-6, bandwidth=400e9 / 8)),
        "a high-latency node link (20 us, 300 GB/s) with a 100 Gb/s network (5 us)":
            (mod.Link(alpha=20e-6, bandwidth=300e9), mod.Link(alpha=5e-6, bandwidth=100e9 / 8)),
    }
    problems = []
    for n, k in _CLUSTERS:
        for label, (intra, inter) in links.items():
            for nbytes in (1e3, 1e8):
                got = mod.predict_seconds(nbytes, n, k, intra, inter)
                want = _time_formula(nbytes, n, k, intra, inter, None)
                for key in want:
                    value = got.get(key, float("nan"))
                    if not abs(value - want[key]) <= 1e-9 * max(want[key], 1e-12):
                        c = nbytes / (n * k)
                        hops = (f"intra hop {intra.alpha + c / intra.bandwidth:.3g} s, " if k > 1 else "") + \
                               (f"inter hop {inter.alpha + c / inter.bandwidth:.3g} s" if n > 1 else "")
                        problems.append(f"predict_seconds({nbytes:g} B, {n}x{k}, {label})[{key!r}] = {value:.6g}, "
                                        f"expected {want[key]:.6g} (a step of {c:g} B: {hops.rstrip(', ')})")
    assert_no_problems(problems, "a ring step lasts as long as its slowest hop, whichever kind it is: the hops inside "
                                 "a node (if k > 1) and the hops that leave one (if N > 1); nodes whose own links "
                                 "are slower than the network exist (PCIe-only servers with fast NICs):")


def test_3_3_cost_model_caps_a_rank_at_one_nic(grade):
    mod = grade("3.3").load()
    nvlink = mod.Link(alpha=3e-6, bandwidth=150e9)
    net = mod.Link(alpha=10e-6, bandwidth=100e9 / 8)
    problems = []
    for n, k, nics in [(2, 8, 16), (4, 1, 2), (3, 5, 8), (16, 8, 9)]:
        for nbytes in (1e3, 1e8):
            got = mod.predict_seconds(nbytes, n, k, nvlink, net, nics_per_node=nics)
            want = _time_formula(nbytes, n, k, nvlink, net, nics)
            value = got.get("hierarchical", float("nan"))
            if not abs(value - want["hierarchical"]) <= 1e-9 * max(want["hierarchical"], 1e-12):
                problems.append(f"predict_seconds({nbytes:g} B, {n}x{k}, nics_per_node={nics})['hierarchical'] = "
                                f"{value:.6g}, expected {want['hierarchical']:.6g}")
    assert_no_problems(problems, "more NICs per node than ranks: a rank still sends through one NIC, "
                                 "inter.bandwidth * min(1, nics_per_node / k), never faster than its link:")


def test_3_3_runs_under_two_torchrun_agents(grade, tmp_path):
    """Two torchrun agents on this host, 2 ranks each, one c10d rendezvous: your topology from
    torchrun's variables, your groups, your all-reduce; a deadline, and no process left."""
    ref = grade("3.3")
    for key, value in _hier_worlds.items():  # what the worlds saw already: no launch to learn it again
        if key[0] != ref:
            continue
        if isinstance(value, BaseException):  # a deadlock would only wait out the deadline here
            pytest.fail(f"not run: the world of {key[1]} ranks failed (see the first 3.3 test that ran)")
        for part in ("topology", "reduce", "groups"):
            for got in value[0][part].values():
                nested = [got] + [v for v in got.values() if isinstance(v, dict)]
                for error in nested:
                    if error.get("error") == "NotImplementedError" and error["message"].startswith("TODO"):
                        raise NotImplementedError(error["message"])
    worker = Path(__file__).with_name("hierarchical_torchrun_worker.py")
    env = {"COURSE_GRADE_KIND": ref.kind, "COURSE_GRADE_LOCATION": ref.location, "COURSE_RESULT_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(grading.REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
           "COURSE_BACKEND": "gloo"}
    port = free_port()
    job = Torchrun(timeout=_TORCHRUN_DEADLINE_S, env=env, cwd=grading.REPO_ROOT)
    try:
        with job:
            for _ in range(2):
                job.start(multi_node_args(nnodes=2, nproc_per_node=2, port=port, rdzv_id=f"test33-{port}")
                          + [str(worker)])
            try:
                job.wait()
                failure = None
            except TorchrunError as exc:
                failure = exc
            left = job.processes()
    finally:
        results = {int(p.stem[4:]): pickle.loads(p.read_bytes()) for p in tmp_path.glob("rank*.pkl")}
    assert not left, f"processes {left} of the torchrun job outlived it"
    errors = {r: res for r, res in results.items() if "error" in res}
    for rank, error in sorted(errors.items()):
        _raise(rank, error, "the torchrun worker")
    if failure is not None:
        raise failure
    assert sorted(results) == [0, 1, 2, 3], f"ranks that reported: {sorted(results)}"
    problems = []
    for rank, res in sorted(results.items()):
        node = int(res["env"]["GROUP_RANK"])
        want_topology = _expected_topology(rank, (2, 2))
        if res["topology"] != want_topology:
            problems.append(f"rank {rank} (torchrun env {res['env']}): topology {res['topology']}, "
                            f"expected {want_topology}")
        want_groups = _expected_groups(rank, (2, 2))
        for name in ("intra", "inter"):
            if res[name] != want_groups[name]:
                problems.append(f"rank {rank} on node {node}: {name} group {res[name]}, expected {want_groups[name]}")
        for what, (actual, expected) in res["results"].items():
            problem = diff_report(actual, expected, f"rank {rank}: hierarchical_all_reduce of {what}",
                                  rtol=1e-5, atol=1e-4)
            if problem:
                problems.append(problem)
    assert_no_problems(problems, "under torchrun (2 agents x 2 ranks, c10d rendezvous on 127.0.0.1):")
