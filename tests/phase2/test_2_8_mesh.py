"""Graded tests of exercise 2.8, data parallel over tensor parallel on a 2-D mesh
(phase2_advanced/guidelines.md, section 2.8).

Run them with `python tests/test_phase2.py -k 2_8` (your code) or
`pytest tests/test_phase2.py -k 2_8` (the reference); tests/test_phase2.py collects them.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import grading
from compare import assert_no_problems, diff_report
from common.launch import WorldError, run_world
from common.measure import CollectiveLog

#
# Two worlds of 4 ranks: one builds the groups of each mesh shape with your
# build_groups (and sends a message through each group to see who really answers);
# the other trains with your train() on groups built by the reference, so a mistake in
# one function fails only its own test. Ranks return plain data; assertions happen here.

_MESH_WORLD = 4
_MESH_SHAPES = [(2, 2), (4, 1), (1, 4)]  # (dp, tp)
_MESH_MISFITS = [(3, 1), (2, 3), (1, 2)]  # (dp, tp) with dp * tp != 4: build_groups raises ValueError
_MESH_SIZES = dict(batch=8, hidden=8, ffn=16, steps=3, lr=0.2)
_MESH_TOL = dict(rtol=1e-5, atol=1e-6)
_MESH_EDGES = [(0, 8), (1, 8), (3, 2)]  # (steps, global batch) on the (2, 2) mesh: no step, one, one sample per replica


def _mesh_expected(rank: int, dp: int, tp: int) -> dict[str, list[int]]:
    """The rows (tp) and columns (dp) of a row-major (dp, tp) mesh that hold `rank`."""
    i, j = divmod(rank, tp)
    return {"tp": [i * tp + jj for jj in range(tp)], "dp": [ii * tp + j for ii in range(dp)]}


def _mesh_error(exc: BaseException) -> dict:
    return {"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}


def _mesh_ranks(group) -> list[int]:
    return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)


def _mesh_groups_rank(ref: grading.ModuleRef) -> dict:
    """For each shape: the ranks each returned group claims, and the ranks an all-reduce over it reaches."""
    mod, rank, out = ref.load(), dist.get_rank(), {}
    out["refused"] = {}
    for dp, tp in _MESH_MISFITS:  # before any group: a mesh that does not cover the world is refused by every rank
        try:
            mod.build_groups(dp, tp)
            out["refused"][dp, tp] = "returned"
        except ValueError:
            out["refused"][dp, tp] = None
        except Exception as exc:  # noqa: BLE001 - reported by the test
            out["refused"][dp, tp] = f"raised {type(exc).__name__}: {exc}"
    for dp, tp in _MESH_SHAPES:
        try:
            groups = mod.build_groups(dp, tp)
            out[dp, tp] = {}
            for name in ("dp", "tp"):
                group = getattr(groups, name)
                present = torch.zeros(_MESH_WORLD)
                present[rank] = 1.0
                dist.all_reduce(present, group=group)  # who really answered: the ranks wired into this group
                out[dp, tp][name] = {"claims": _mesh_ranks(group), "reached": present.nonzero().flatten().tolist()}
        except Exception as exc:  # noqa: BLE001 - reported by the test; stop: later groups would be out of step
            return {"error": _mesh_error(exc)}
    return out


def _mesh_data() -> dict:
    """The unsharded MLP's weights and the global batch (seeded; the global RNG untouched)."""
    c, ref = _MESH_SIZES, grading.reference("2.7")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return {"mlp": ref.MLP(c["hidden"], c["ffn"]).state_dict(),
                "x": torch.randn(c["batch"], c["hidden"]), "y": torch.randn(c["batch"], c["hidden"])}


def _mesh_full(data: dict):
    c = _MESH_SIZES
    full = grading.reference("2.7").MLP(c["hidden"], c["ffn"])
    full.load_state_dict(data["mlp"])
    return full


def _mesh_train_rank(ref: grading.ModuleRef, data: dict) -> dict:
    """For each shape: the trained shard's parameters and every collective (name, elements, ranks of its group)."""
    mod, reference, c, out = ref.load(), grading.reference("2.8"), _MESH_SIZES, {}
    for dp, tp in _MESH_SHAPES:
        groups = reference.build_groups(dp, tp)  # every rank, every shape, same order: never out of step
        try:
            with CollectiveLog() as log:
                model = mod.train(_mesh_full(data), data["x"].clone(), data["y"].clone(), groups,
                                  steps=c["steps"], lr=c["lr"])
            out[dp, tp] = {"params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
                           "calls": [(call.name, call.numel, _mesh_ranks(call.group)) for call in log.calls]}
        except Exception as exc:  # noqa: BLE001 - reported by the tests
            out[dp, tp] = {"error": _mesh_error(exc)}
    groups = reference.build_groups(2, 2)
    for steps, batch in _MESH_EDGES:  # no step, one step, and a dp slice of one sample, on the (2, 2) mesh
        try:
            model = mod.train(_mesh_full(data), data["x"][:batch].clone(), data["y"][:batch].clone(), groups,
                              steps=steps, lr=c["lr"])
            out["edge", steps, batch] = {"params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()}}
        except Exception as exc:  # noqa: BLE001 - reported by the tests
            out["edge", steps, batch] = {"error": _mesh_error(exc)}
    return out


_mesh_worlds: dict = {}  # (ModuleRef, worker name) -> per-rank results, or the exception the world raised


def _mesh_results(ref: grading.ModuleRef, worker, *args) -> list:
    key = (ref, worker.__name__)
    if key not in _mesh_worlds:
        try:
            _mesh_worlds[key] = run_world(worker, _MESH_WORLD, args=(ref, *args))
        except WorldError as exc:
            _mesh_worlds[key] = exc
            raise
    results = _mesh_worlds[key]
    if isinstance(results, BaseException):
        pytest.fail(f"not run: the world of {_MESH_WORLD} ranks failed (see the first 2.8 test that ran): "
                    f"{str(results).splitlines()[0]}")
    return results


def _mesh_raise(rank: int, error: dict, what: str) -> None:
    """A rank's exception, raised again here (a TODO stays TODO)."""
    if error["error"] == "NotImplementedError" and error["message"].startswith("TODO"):
        raise NotImplementedError(error["message"])
    pytest.fail(f"rank {rank} of {_MESH_WORLD} raised {error['error']} in {what}: {error['message']}\n{error['traceback']}")


def _mesh_trained(ref: grading.ModuleRef) -> list:
    results = _mesh_results(ref, _mesh_train_rank, _mesh_data())
    for shape in _MESH_SHAPES:
        for rank, result in enumerate(results):
            if "error" in result[shape]:
                _mesh_raise(rank, result[shape]["error"], f"train() on a {shape} (dp, tp) mesh")
    return results


def _mesh_ground_truth(data: dict, steps: int | None = None, batch: int | None = None) -> dict:
    """One process, the whole global batch: the same SGD steps on the unsharded MLP."""
    c = _MESH_SIZES
    full = _mesh_full(data)
    optimizer = torch.optim.SGD(full.parameters(), lr=c["lr"])
    for _ in range(c["steps"] if steps is None else steps):
        optimizer.zero_grad()
        F.mse_loss(full(data["x"][:batch]), data["y"][:batch]).backward()
        optimizer.step()
    return {n: p.detach() for n, p in full.named_parameters()}


def _mesh_shard(name: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """fc1 is column-parallel (rows of W and b), fc2 row-parallel (columns of W, whole bias)."""
    if name.startswith("fc1"):
        return full.chunk(tp, dim=0)[tp_rank]
    return full.chunk(tp, dim=1)[tp_rank] if full.dim() == 2 else full


def test_2_8_groups_are_the_rows_and_columns_of_the_mesh(grade):
    results = _mesh_results(grade("2.8"), _mesh_groups_rank)
    for rank, result in enumerate(results):
        if "error" in result:
            _mesh_raise(rank, result["error"], "build_groups")
    problems = [f"rank {rank}: build_groups({dp}, {tp}) in a world of {_MESH_WORLD} {got}; expected ValueError "
                f"(dp * tp must equal the world size)"
                for rank, result in enumerate(results) for (dp, tp), got in result["refused"].items() if got]
    for dp, tp in _MESH_SHAPES:
        for rank, result in enumerate(results):
            expected = _mesh_expected(rank, dp, tp)
            for name, what in (("tp", "row"), ("dp", "column")):
                got, want = result[dp, tp][name], expected[name]
                where = f"({dp}, {tp}) mesh, rank {rank}: its {name} group"
                if got["claims"] != want:
                    problems.append(f"{where} has ranks {got['claims']}, expected {want} (its {what} of the mesh)")
                elif got["reached"] != want:
                    problems.append(f"{where} claims ranks {want} but an all-reduce over it reached ranks "
                                    f"{got['reached']}: the ranks met under the same group name for different groups")
    assert_no_problems(problems, "rank = i * tp + j; the tp group of a rank is its row i, its dp group its column j; "
                                 "every rank must create every group, in the same order (guidelines 2.8):")


def test_2_8_training_on_the_mesh_equals_one_process(grade):
    results = _mesh_trained(grade("2.8"))
    data = _mesh_data()
    truth = _mesh_ground_truth(data)
    problems = []
    for dp, tp in _MESH_SHAPES:
        for rank, result in enumerate(results):
            got, tp_rank = result[dp, tp]["params"], rank % tp
            for name, full in truth.items():
                where = f"({dp}, {tp}) mesh, rank {rank} (tp index {tp_rank}): {name}"
                if name not in got:
                    problems.append(f"{where}: the returned model has no parameter {name} (expected a ParallelMLP)")
                    continue
                problem = diff_report(got[name], _mesh_shard(name, full, tp_rank, tp), where, **_MESH_TOL)
                if problem:
                    problems.append(problem)
    assert_no_problems(problems, f"after {_MESH_SIZES['steps']} SGD steps every rank's shard must equal that shard of "
                                 "the MLP trained in one process on the whole global batch (a ParallelMLP over the "
                                 "tp group, this dp index's rows of the batch, gradients averaged over the dp group):")


def test_2_8_training_edges_no_step_one_step_one_sample_per_replica(grade):
    """On the (2, 2) mesh: steps=0 returns the shard untrained, steps=1 one step, and a global batch of 2 (one
    sample per dp replica) trains as one process on those 2 samples."""
    results = _mesh_trained(grade("2.8"))
    data = _mesh_data()
    problems = []
    for steps, batch in _MESH_EDGES:
        truth = _mesh_ground_truth(data, steps, batch)
        for rank, result in enumerate(results):
            got = result["edge", steps, batch]
            if "error" in got:
                _mesh_raise(rank, got["error"], f"train(steps={steps}) on a global batch of {batch}")
            for name, full in truth.items():
                where = f"train(steps={steps}), global batch {batch}, (2, 2) mesh, rank {rank}: {name}"
                problem = diff_report(got["params"].get(name), _mesh_shard(name, full, rank % 2, 2), where, **_MESH_TOL) \
                    if name in got["params"] else f"{where}: the returned model has no parameter {name}"
                if problem:
                    problems.append(problem)
    assert_no_problems(problems, "train's edges must equal one process on the same samples and steps:")


def test_2_8_activations_reduce_in_tp_gradients_average_in_dp(grade):
    results = _mesh_trained(grade("2.8"))
    c, (dp, tp) = _MESH_SIZES, _MESH_SHAPES[0]
    activation = c["batch"] // dp * c["hidden"]
    params = c["hidden"] * c["ffn"] * 2 // tp + c["ffn"] // tp + c["hidden"]  # this rank's shard
    problems = []
    for rank, result in enumerate(results):
        groups, where = _mesh_expected(rank, dp, tp), f"({dp}, {tp}) mesh, rank {rank}"
        calls = result[dp, tp]["calls"]
        for name, numel, ranks in calls:
            if ranks not in (groups["tp"], groups["dp"]):
                problems.append(f"{where}: {name}({numel} elements) went to ranks {ranks}; a collective here belongs to "
                                f"the tp group {groups['tp']} or the dp group {groups['dp']}")
        in_tp = [numel for name, numel, ranks in calls if name == "all_reduce" and ranks == groups["tp"]]
        in_dp = sum(numel for name, numel, ranks in calls if name == "all_reduce" and ranks == groups["dp"])
        if in_tp.count(activation) < c["steps"]:  # f's backward all-reduce is skipped: the batch needs no gradient
            problems.append(f"{where}: {in_tp.count(activation)} all-reduces of {activation} activation elements in the "
                            f"tp group {groups['tp']} over {c['steps']} steps, expected one per step (fc2's g)")
        if in_dp < c["steps"] * params:
            problems.append(f"{where}: all-reduces of {in_dp} elements in the dp group {groups['dp']} over "
                            f"{c['steps']} steps; averaging this rank's gradient shard ({params} elements) each step "
                            f"needs {c['steps'] * params}")
    assert_no_problems(problems, "the tensor-parallel all-reduces of activations go to the tp group (the model is built "
                                 "on it), and the gradient average goes to the dp group: no collective on the world:")
