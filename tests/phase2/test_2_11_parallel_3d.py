"""Graded tests of exercise 2.11, 3-D parallelism: a transformer on a (dp, pp, tp) mesh
(phase2_advanced/guidelines.md, section 2.11).

Run them with `python tests/test_phase2.py -k 2_11` (your code) or
`pytest tests/test_phase2.py -k 2_11` (the reference); tests/test_phase2.py collects them.
"""

from __future__ import annotations

import io
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import grading
from compare import assert_no_problems, diff_report
from common.launch import WorldError, run_world

#
# Worlds of 8 ranks, each started once per graded implementation and only when a test needs it:
#   "mesh"   your build_mesh on every mesh shape of 8 ranks (and sizes that do not fit);
#   "stages" your build_stages and grad_norm on meshes built by the reference;
#   "train"  your train_step on the reference's stages, each rank returning its parameters
#            and the one-process truth (the reference's shards of the model trained in one
#            process on the whole global batch): its own world, the costly one, so that a
#            mistake in build_stages or grad_norm is graded without it;
#   "errors" a micro-batch count that does not divide: every rank must refuse it.
# Ranks return plain data; assertions happen here.

_WORLD = 8
_MESH_PART, _STAGES_PART, _NORM_PART, _TRAIN_PART = (
    pytest.mark.part(name) for name in ("mesh", "stages", "gradient norm", "training step"))
_SIZES = dict(layers=4, hidden=8, heads=4, ffn=16, seq=4, batch=8)
_LR = 0.1
_TOL = dict(rtol=1e-4, atol=1e-5)
_MESH_SHAPES = [(2, 2, 2), (1, 2, 4), (4, 2, 1), (2, 1, 4), (8, 1, 1), (1, 8, 1), (1, 1, 8)]
_MESH_MISFITS = [(3, 1, 2), (2, 2, 1), (2, 2, 4)]
# name -> ((dp, pp, tp) sizes, dimension order, chunks per rank, micro-batches, max_norm, steps)
_TRAIN_CASES = {
    "(2, 2, 2)": ((2, 2, 2), ("pp", "dp", "tp"), 1, 2, None, 2),
    "(2, 2, 2) interleaved, 2 chunks": ((2, 2, 2), ("pp", "dp", "tp"), 2, 2, None, 2),
    "(1, 2, 4)": ((1, 2, 4), ("pp", "dp", "tp"), 1, 4, None, 2),
    "(2, 4, 1), one sample per micro-batch": ((2, 4, 1), ("pp", "dp", "tp"), 1, 4, None, 2),
    "(2, 4, 1), 2 micro-batches for 4 stages": ((2, 4, 1), ("pp", "dp", "tp"), 1, 2, None, 2),
    "(1, 2, 4), one micro-batch": ((1, 2, 4), ("pp", "dp", "tp"), 1, 1, None, 2),
    "(4, 1, 2), no pipeline": ((4, 1, 2), ("pp", "dp", "tp"), 1, 2, None, 2),
    "(8, 1, 1), one sample per replica": ((8, 1, 1), ("pp", "dp", "tp"), 1, 1, None, 2),
    "(2, 2, 2) dp outermost (dp, pp, tp)": ((2, 2, 2), ("dp", "pp", "tp"), 1, 2, None, 2),
    "(2, 2, 2) clipped (max_norm 0.05)": ((2, 2, 2), ("pp", "dp", "tp"), 1, 2, 0.05, 2),
    "(2, 2, 2) interleaved, 4 micro-batches, clipped (max_norm 0.2)": ((2, 2, 2), ("pp", "dp", "tp"), 2, 4, 0.2, 2),
    "(2, 2, 2) max_norm above the norm": ((2, 2, 2), ("pp", "dp", "tp"), 1, 2, 1e3, 1),
}
# name -> (mesh shape, chunks per rank, parameter names ("blocks.<i>.<name>") whose gradient is None)
_NORM_CASES = {
    "(2, 2, 2)": ((2, 2, 2), 1, ()),
    "(2, 2, 2) interleaved": ((2, 2, 2), 2, ()),
    "(1, 2, 4)": ((1, 2, 4), 1, ()),
    "(2, 4, 1)": ((2, 4, 1), 1, ()),
    "(4, 1, 2), some gradients None": ((4, 1, 2), 1, ("blocks.0.ln1.weight", "blocks.2.attn.qkv.bias",
                                                        "blocks.3.mlp.fc2.bias")),
}


def _error(exc: BaseException) -> dict:
    return {"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}


def _raise(rank: int, error: dict, what: str) -> None:
    """A rank's exception, raised again here (a TODO stays TODO)."""
    if error["error"] == "NotImplementedError" and error["message"].startswith("TODO"):
        raise NotImplementedError(error["message"])
    pytest.fail(f"rank {rank} of {_WORLD} raised {error['error']} in {what}: {error['message']}\n{error['traceback']}")


_data_made: dict = {}


def _data() -> dict:
    """The model's weights, the global batch, a gradient for every parameter (seeded; the global RNG untouched), and
    per training case the one-process truth (trained weights, losses, gradient norms): made once, here, and shipped
    to the ranks, which then only cut the truth into their shards."""
    if not _data_made:
        c, ref = _SIZES, grading.reference("2.11")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = ref.Transformer(c["layers"], c["hidden"], c["heads"], c["ffn"])
            _data_made.update(model=model.state_dict(), grads={n: torch.randn_like(p) for n, p in model.named_parameters()},
                              x=torch.randn(c["batch"], c["seq"], c["hidden"]),
                              y=torch.randn(c["batch"], c["seq"], c["hidden"]))
        truths = {}
        for name, (_, _, _, _, max_norm, steps) in _TRAIN_CASES.items():
            trained, losses, norms = _one_process(_data_made, steps, max_norm)
            truths[name] = {"model": trained.state_dict(), "losses": losses, "norms": norms}
        buffer = io.BytesIO()  # as bytes: hundreds of tensors as arguments would each need a file descriptor
        torch.save(truths, buffer)
        _data_made["truths"] = buffer.getvalue()
    return _data_made


def _truths(data: dict) -> dict:
    return torch.load(io.BytesIO(data["truths"]), weights_only=True)


def _model(state: dict):
    c = _SIZES
    model = grading.reference("2.11").Transformer(c["layers"], c["hidden"], c["heads"], c["ffn"])
    model.load_state_dict(state)
    return model


def _one_process(data: dict, steps: int, max_norm: float | None) -> tuple:
    """The truth: one process, the whole global batch, SGD with torch's clip_grad_norm_. (model, losses, norms)."""
    model, losses, norms = _model(data["model"]), [], []
    for _ in range(steps):
        model.zero_grad()
        loss = F.mse_loss(model(data["x"]), data["y"])
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        with torch.no_grad():
            for p in model.parameters():
                p -= _LR * p.grad
    return model, losses, norms


_rank_meshes: dict = {}  # in a rank: (shape, names) -> the mesh, built once per world (every rank, same order)


def _mesh(shape: tuple, names: tuple = ("pp", "dp", "tp")):
    """A mesh built here, with torch's init_device_mesh (not an exercise function); shape = (dp, pp, tp) sizes."""
    from torch.distributed.device_mesh import init_device_mesh
    if (shape, names) not in _rank_meshes:
        sizes = dict(zip(("dp", "pp", "tp"), shape))
        _rank_meshes[shape, names] = init_device_mesh("cpu", tuple(sizes[n] for n in names), mesh_dim_names=names)
    return _rank_meshes[shape, names]


def _params(stages) -> list[dict]:
    return [{n: p.detach().clone() for n, p in st.named_parameters()} for st in stages]


def _describe(stages) -> list[dict]:
    return [{"type": type(st).__name__, "stage_id": getattr(st, "stage_id", None),
             "num_stages": getattr(st, "num_stages", None), "ranks": list(getattr(st, "ranks", []) or []),
             "layers": [type(layer).__name__ for layer in getattr(st, "layers", [])]} for st in stages]


# ------------------------------------------------------------------ the worlds' ranks


def _mesh_rank(ref: grading.ModuleRef) -> dict:
    """For each shape: per dimension name, the ranks its group claims, the ranks an all-reduce over it reaches,
    and this rank's index in it."""
    mod, rank, out = ref.load(), dist.get_rank(), {"refused": {}}
    for shape in _MESH_MISFITS:  # before any group: every rank refuses a mesh that does not cover the world
        try:
            mod.build_mesh(*shape)
            out["refused"][shape] = "returned"
        except ValueError:
            out["refused"][shape] = None
        except Exception as exc:  # noqa: BLE001 - reported by the test
            out["refused"][shape] = f"raised {type(exc).__name__}: {exc}"
    for shape in _MESH_SHAPES:
        try:
            mesh = mod.build_mesh(*shape)
            out[shape] = {}
            for name in ("dp", "pp", "tp"):
                sub = mesh[name]
                present = torch.zeros(_WORLD)
                present[rank] = 1.0
                dist.all_reduce(present, group=sub.get_group())  # who really answers in this group
                out[shape][name] = {"claims": sorted(dist.get_process_group_ranks(sub.get_group())),
                                    "reached": present.nonzero().flatten().tolist(), "index": sub.get_local_rank()}
        except Exception as exc:  # noqa: BLE001 - reported by the test; stop: later groups would be out of step
            return {"error": _error(exc)}
    return out


def _stages_section(mod, reference, data: dict) -> dict:
    out = {}
    for shape, chunks in (((2, 2, 2), 1), ((2, 2, 2), 2), ((1, 4, 2), 1), ((2, 1, 4), 1), ((2, 4, 1), 1)):
        mesh = _mesh(shape)
        try:  # the first case leaves num_chunks to its default
            model = _model(data["model"])
            got = (mod.build_stages(model, mesh) if (shape, chunks) == ((2, 2, 2), 1)
                   else mod.build_stages(model, mesh, chunks))
            out[shape, chunks] = {"stages": _describe(got), "params": _params(got)}
            out[shape, chunks]["model"] = _model_changes(model, got)  # after the copy: it writes to the stages
        except Exception as exc:  # noqa: BLE001 - reported by the test
            out[shape, chunks] = {"error": _error(exc)}
        want = reference.build_stages(_model(data["model"]), mesh, chunks)
        out[shape, chunks]["want"] = {"stages": _describe(want), "params": _params(want)}
    return out


def _model_changes(model, stages) -> list[str]:
    """How `stages` are entangled with the model they were built from: the model's blocks replaced, a parameter
    shared, or the model's weights changed once every stage parameter is written to (a step would do that)."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    mine = {id(p) for n, p in model.named_parameters()}
    found = [f"model.blocks[{i}] is now a {type(b).__name__}" for i, b in enumerate(model.blocks)
             if type(b).__name__ != "Block"]
    found += [f"stage {st.stage_id}: {n} is the model's own parameter" for st in stages
              for n, p in st.named_parameters() if id(p) in mine]
    with torch.no_grad():
        for st in stages:
            for p in st.parameters():
                p.add_(1.0)
    found += [f"the model's {n} changed when the stages' parameters did" for n, p in model.named_parameters()
              if not torch.equal(p, before[n])]
    return found


def _norm_section(mod, reference, data: dict) -> dict:
    out = {}
    for name, (shape, chunks, no_grad) in _NORM_CASES.items():
        mesh = _mesh(shape)
        stages = reference.build_stages(_model(data["model"]), mesh, chunks)
        grads = reference.build_stages(_model(data["grads"]), mesh, chunks)  # the same shards of the gradient
        for stage, grad_stage in zip(stages, grads):
            grad_of = dict(grad_stage.named_parameters())
            for pname, p in stage.named_parameters():
                p.grad = grad_of[pname].detach().clone()
        for stage in stages:  # the gradients listed None, by the model's parameter name
            for block_index in stage.layer_range:
                block = stage.layers[block_index - stage.layer_range.start]
                for pname, p in block.named_parameters():
                    if f"blocks.{block_index}.{pname}" in no_grad:
                        p.grad = None
        before = [[None if p.grad is None else p.grad.clone() for p in st.parameters()] for st in stages]
        try:
            norm = mod.grad_norm(stages, mesh)
            after = [[None if p.grad is None else p.grad.clone() for p in st.parameters()] for st in stages]
            out[name] = {"norm": torch.as_tensor(norm).detach().cpu().clone(), "unchanged": all(
                (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                for sa, sb in zip(before, after) for a, b in zip(sa, sb))}
        except Exception as exc:  # noqa: BLE001 - reported by the test
            out[name] = {"error": _error(exc)}
    return out


def _train_section(mod, reference, data: dict) -> dict:
    out, truths = {}, _truths(data)
    for name, (shape, names, chunks, m, max_norm, steps) in _TRAIN_CASES.items():
        mesh = _mesh(shape, names)
        try:
            stages = reference.build_stages(_model(data["model"]), mesh, chunks)  # train_step graded alone
            clip = {} if max_norm is None else {"max_norm": max_norm}  # None: left to its default
            losses = [mod.train_step(stages, mesh, data["x"].clone(), data["y"].clone(), num_microbatches=m, lr=_LR,
                                     **clip) for _ in range(steps)]
            out[name] = {"params": _params(stages), "losses": [float(v) for v in losses],
                         "types": sorted({type(v).__name__ for v in losses})}
        except Exception as exc:  # noqa: BLE001 - reported by the tests
            out[name] = {"error": _error(exc)}
        truth = truths[name]
        out[name]["want"] = {"params": _params(reference.build_stages(_model(truth["model"]), mesh, chunks)),
                             "losses": truth["losses"], "norms": truth["norms"]}
    return out


def _stages_rank(ref: grading.ModuleRef, data: dict) -> dict:
    """Your build_stages and grad_norm (on the reference's stages) on meshes made here; the reference's next to
    each."""
    mod, reference = ref.load(), grading.reference("2.11")
    return {"stages": _stages_section(mod, reference, data), "norm": _norm_section(mod, reference, data)}


def _train_rank(ref: grading.ModuleRef, data: dict) -> dict:
    """Your train_step on the reference's stages, with the one-process truth next to each case."""
    mod, reference = ref.load(), grading.reference("2.11")
    return {"train": _train_section(mod, reference, data)}


def _errors_rank(ref: grading.ModuleRef, data: dict) -> dict:
    """train_step with 3 micro-batches of a replica's 4 samples, on every rank of a (2, 4, 1) mesh (stages in the
    middle of the pipeline, which need no micro-batch of their own, must refuse it too)."""
    mod, reference = ref.load(), grading.reference("2.11")
    mesh = _mesh((2, 4, 1))
    stages = reference.build_stages(_model(data["model"]), mesh, 1)
    try:
        mod.train_step(stages, mesh, data["x"], data["y"], num_microbatches=3, lr=_LR)
        return {"refused": "returned"}
    except ValueError:
        return {"refused": None}
    except Exception as exc:  # noqa: BLE001 - reported by the test
        return {"refused": f"raised {type(exc).__name__}: {exc}", "error": _error(exc)}


_worlds: dict = {}  # (ModuleRef, worker name) -> per-rank results, or the exception the world raised


def _results(ref: grading.ModuleRef, worker, *args) -> list:
    key = (ref, worker.__name__)
    if key not in _worlds:
        try:
            _worlds[key] = run_world(worker, _WORLD, args=(ref, *args))
        except WorldError as exc:
            _worlds[key] = exc
            raise
    results = _worlds[key]
    if isinstance(results, BaseException):
        pytest.fail(f"not run: the world of {_WORLD} ranks failed (see the first 2.11 test that ran): "
                    f"{str(results).splitlines()[0]}")
    return results


def _section(ref: grading.ModuleRef, section: str) -> list[dict]:
    worker = _train_rank if section == "train" else _stages_rank
    return [result[section] for result in _results(ref, worker, _data())]


def _compare_params(got: list[dict], want: list[dict], where: str) -> list[str]:
    if len(got) != len(want):
        return [f"{where}: {len(got)} stages, expected {len(want)}"]
    problems = []
    for k, (g, w) in enumerate(zip(got, want)):
        for name, expected in w.items():
            if name not in g:
                problems.append(f"{where}, stage {k}: no parameter {name} (its parameters: {sorted(g)[:6]}...)")
            else:
                problem = diff_report(g[name], expected, f"{where}, stage {k}: {name}", **_TOL)
                if problem:
                    problems.append(problem)
    return problems


# ------------------------------------------------------------------ the tests


@_MESH_PART
def test_2_11_mesh_has_named_dimensions_with_tp_innermost(grade):
    results = _results(grade("2.11"), _mesh_rank)
    for rank, result in enumerate(results):
        if "error" in result:
            _raise(rank, result["error"], "build_mesh")
    problems = [f"rank {rank}: build_mesh{shape} in a world of {_WORLD} {got}; expected ValueError "
                "(dp * pp * tp must equal the world size)"
                for rank, result in enumerate(results) for shape, got in result["refused"].items() if got]
    for shape in _MESH_SHAPES:
        sizes = dict(zip(("dp", "pp", "tp"), shape))
        coords = {}
        for rank, result in enumerate(results):
            where = f"build_mesh{shape}, rank {rank}"
            for name in ("dp", "pp", "tp"):
                got = result[shape][name]
                if len(got["claims"]) != sizes[name]:
                    problems.append(f"{where}: mesh[{name!r}] has ranks {got['claims']}, expected {sizes[name]} ranks")
                elif got["reached"] != got["claims"]:
                    problems.append(f"{where}: mesh[{name!r}] claims ranks {got['claims']} but an all-reduce over it "
                                    f"reached {got['reached']}")
            tp = sizes["tp"]
            first = rank - rank % tp
            if result[shape]["tp"]["claims"] != list(range(first, first + tp)):
                problems.append(f"{where}: its tp group is ranks {result[shape]['tp']['claims']}, expected the {tp} "
                                f"consecutive ranks {list(range(first, first + tp))}: tp is innermost (one node), "
                                "its all-reduces are the most frequent traffic of the three")
            coords[rank] = tuple(result[shape][n]["index"] for n in ("dp", "pp", "tp"))
        if len(set(coords.values())) != _WORLD:
            problems.append(f"build_mesh{shape}: two ranks have the same (dp, pp, tp) indices: {coords}")
        for name, others in (("dp", (1, 2)), ("pp", (0, 2)), ("tp", (0, 1))):
            for rank, result in enumerate(results):
                same = sorted(r for r in range(_WORLD) if all(coords[r][i] == coords[rank][i] for i in others))
                if result[shape][name]["claims"] != same:
                    problems.append(f"build_mesh{shape}, rank {rank}: mesh[{name!r}] is ranks "
                                    f"{result[shape][name]['claims']}, but the ranks whose other two indices equal "
                                    f"this rank's are {same}: a {name} group varies the {name} index only")
    assert_no_problems(problems, "build_mesh(dp, pp, tp) is the world as a mesh with dimensions named dp, pp, tp; "
                                 "tp innermost (consecutive ranks); every rank calls it (guidelines 2.11):")


@_STAGES_PART
def test_2_11_stages_hold_this_ranks_chunks_tensor_parallel(grade):
    problems = []
    for rank, section in enumerate(_section(grade("2.11"), "stages")):
        for (shape, chunks), result in section.items():
            where = f"build_stages on a {shape} mesh, {chunks} chunk(s) per rank, rank {rank}"
            if "error" in result:
                _raise(rank, result["error"], where)
            got, want = result["stages"], result["want"]["stages"]
            if [s["stage_id"] for s in got] != [s["stage_id"] for s in want]:
                problems.append(f"{where}: stages {[s['stage_id'] for s in got]}, expected {[s['stage_id'] for s in want]}"
                                " (rank at pp index s holds s, s + pp, ...)")
                continue
            for g, w in zip(got, want):
                for key, text in (("num_stages", "num_stages"), ("ranks", "ranks (the global rank of each stage)"),
                                  ("layers", "layers")):
                    if g[key] != w[key]:
                        problems.append(f"{where}, stage {w['stage_id']}: {text} {g[key]}, expected {w[key]}")
            problems += _compare_params(result["params"], result["want"]["params"], where)
            problems += [f"{where}: {change}" for change in result["model"]]
    assert_no_problems(problems, "each stage is a VirtualStage over this rank's blocks, each a TensorParallelBlock on "
                                 "the tp group, with the global ranks of the pp group; the model passed in is left as "
                                 "it was, sharing nothing with the stages (guidelines 2.11):")


@_NORM_PART
def test_2_11_grad_norm_counts_every_parameter_once(grade):
    data, problems = _data(), []
    for rank, section in enumerate(_section(grade("2.11"), "norm")):
        for name, result in section.items():
            where = f"grad_norm on {name}, rank {rank}"
            if "error" in result:
                _raise(rank, result["error"], where)
            no_grad = _NORM_CASES[name][2]
            want = torch.nn.utils.get_total_norm([g for n, g in data["grads"].items() if n not in no_grad])
            got = result["norm"]
            if got.shape != () or got.dtype != torch.float32:
                problems.append(f"{where}: returned {got!r}; expected a 0-d float32 tensor")
            elif (problem := diff_report(got.float(), want, where, **_TOL)):
                ratio = got.item() ** 2 / want.item() ** 2
                problems.append(f"{problem} (squared ratio {ratio:.3f}: a whole copy counted tp times, or shards "
                                "not summed over tp, or stages not summed over pp?)")
            if not result["unchanged"]:
                problems.append(f"{where}: the gradients changed; grad_norm only reads them")
    assert_no_problems(problems, "grad_norm is the norm of the whole model's gradient, the same on every rank: tp "
                                 "shards summed over the tp group, whole copies once, every stage over pp:")


@_TRAIN_PART
@pytest.mark.parametrize("case", list(_TRAIN_CASES))
def test_2_11_training_on_the_mesh_equals_one_process(grade, case):
    problems = []
    for rank, section in enumerate(_section(grade("2.11"), "train")):
        result, where = section[case], f"{case}, rank {rank}"
        if "error" in result:
            _raise(rank, result["error"], f"train_step on {case}")
        want = result["want"]
        max_norm = _TRAIN_CASES[case][4]
        if max_norm is not None and max_norm < 1 and not all(n > max_norm for n in want["norms"]):
            problems.append(f"{where}: the test's clipping case does not clip (norms {want['norms']})")
        if result["types"] not in ([], ["float"]):
            problems.append(f"{where}: train_step returned {result['types']}; expected a Python float")
        if len(result["losses"]) != len(want["losses"]) or any(
                abs(g - w) > 1e-5 * (1 + abs(w)) for g, w in zip(result["losses"], want["losses"])):
            problems.append(f"{where}: losses {result['losses']}, expected {want['losses']} (the global batch's loss "
                            "before each step, on every rank)")
        problems += _compare_params(result["params"], want["params"], where)
    assert_no_problems(problems, "after the steps every rank's shards equal the reference's shards of the model "
                                 "trained in one process on the whole global batch (pp row of the schedule, tp layers, "
                                 "gradients averaged over the dp group, clipped by the global norm):")


@_TRAIN_PART
def test_2_11_bad_microbatch_count_refused_on_every_rank(grade):
    results = _results(grade("2.11"), _errors_rank, _data())
    for rank, result in enumerate(results):
        if result.get("error") and result["error"]["error"] == "NotImplementedError":
            _raise(rank, result["error"], "train_step")
    problems = [f"rank {rank}: train_step with 3 micro-batches of a replica's 4 samples {got}; expected ValueError"
                for rank, result in enumerate(results) if (got := result["refused"])]
    assert_no_problems(problems, "every rank refuses a micro-batch count that does not divide its replica's batch "
                                 "(not only the first stage: the others would wait for it forever):")
