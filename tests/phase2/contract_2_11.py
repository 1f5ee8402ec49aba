"""Contract of exercise 2.11 (parallel_3d.py's docstrings; guidelines 2.11): the (dp, pp, tp) mesh, this rank's
stages, the gradient norm over the mesh, and the training step."""

from contracts import default, explicit, raises, when


def _size(c, name):
    return c.a["mesh"][name].size()


def _mesh_entries():
    return [
        when("dp = 1", lambda c: _size(c, "dp") == 1), when("pp = 1", lambda c: _size(c, "pp") == 1),
        when("tp = 1", lambda c: _size(c, "tp") == 1),
        when("dp, pp, tp > 1", lambda c: min(_size(c, n) for n in ("dp", "pp", "tp")) > 1),
        when("tp > 2", lambda c: _size(c, "tp") > 2),
        when("several stages per rank", lambda c: len(c.a["stages"]) > 1),
    ]


CONTRACT = {
    "Transformer.__init__": [], "Transformer.forward": [],
    "TensorParallelBlock.__init__": [], "TensorParallelBlock.from_full": [], "TensorParallelBlock.forward": [],
    "train": [],
    "build_mesh": [
        when("dp = 1", lambda c: c.a["dp"] == 1), when("pp = 1", lambda c: c.a["pp"] == 1),
        when("tp = 1", lambda c: c.a["tp"] == 1),
        when("dp, pp, tp > 1", lambda c: min(c.a["dp"], c.a["pp"], c.a["tp"]) > 1),
        when("one dimension the whole world", lambda c: max(c.a["dp"], c.a["pp"], c.a["tp"]) == c.world),
        when("called again in one world (another mesh)", lambda c: c.count > 1),
        raises("dp * pp * tp not the world size", ValueError),
    ],
    "build_stages": [
        default("num_chunks"), explicit("num_chunks", 1),
        when("num_chunks = 2 (interleaved)", lambda c: c.a["num_chunks"] == 2),
        when("pp = 1", lambda c: _size(c, "pp") == 1), when("pp > 2", lambda c: _size(c, "pp") > 2),
        when("tp = 1", lambda c: _size(c, "tp") == 1), when("tp > 2", lambda c: _size(c, "tp") > 2),
    ],
    "grad_norm": _mesh_entries()[:5] + [
        when("several stages per rank", lambda c: len(c.a["stages"]) > 1),
        when("some gradients None", lambda c: any(p.grad is None for st in c.a["stages"] for p in st.parameters())),
    ],
    "train_step": _mesh_entries() + [
        when("dp = the world (no pp, no tp)", lambda c: _size(c, "dp") == c.world),
        when("a mesh with dp outermost (dimension order dp, pp, tp)",
             lambda c: tuple(c.a["mesh"].mesh_dim_names) == ("dp", "pp", "tp")),
        when("one micro-batch", lambda c: c.a["num_microbatches"] == 1),
        when("fewer micro-batches than stages (1F1B: not a multiple of pp)",
             lambda c: 1 < c.a["num_microbatches"] < _size(c, "pp")),
        when("micro-batches of one sample", lambda c: len(c.a["x"]) == _size(c, "dp") * c.a["num_microbatches"]),
        default("max_norm"),
        when("max_norm that clips (below the gradient norm)", lambda c: c.a["max_norm"] is not None
             and c.a["max_norm"] < 1),
        when("max_norm above the gradient norm (no clipping)", lambda c: c.a["max_norm"] is not None
             and c.a["max_norm"] >= 100),
        when("called again on the same stages (gradients of the step before)", lambda c: c.count > 1),
        raises("micro-batches that do not divide the replica's batch", ValueError),
    ],
}

_GIVEN = "given code (no EXERCISE region): the learner writes nothing in it"
IRRELEVANT = {
    "Transformer.__init__": _GIVEN + "; the tests build it to make the weights and the one-process truth",
    "Transformer.forward": _GIVEN + "; the one-process truth runs it",
    "TensorParallelBlock.__init__": _GIVEN + " (2.7's layers on a group)",
    "TensorParallelBlock.from_full": _GIVEN + "; build_stages calls it, the stages test checks its parameters",
    "TensorParallelBlock.forward": _GIVEN + "; train_step runs it through the stages",
    "train": _GIVEN + " (build_stages, then train_step per step)",
}
