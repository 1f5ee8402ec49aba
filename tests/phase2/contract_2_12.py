"""Contract of exercise 2.12 (planner.py's docstrings; guidelines 2.12): the schedule's in-flight count and bubble,
memory per GPU, bytes per dimension, the placement's links, step time, the ranking and the command line."""

from contracts import SIGNATURE_DEFAULT, always, default, raises, when

_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def _layout(c):
    return c.a["layout"]


def _schedule_entries():
    return [*[when(f"schedule={s!r}", lambda c, s=s: c.a["schedule"] == s) for s in _SCHEDULES],
            when("pp = 1", lambda c: c.a["pp"] == 1),
            when("interleaved with v > 1", lambda c: c.a["schedule"] == "interleaved" and c.a["chunks"] > 1)]


def _precision_entries():
    return [default("precision"),
            when("fp32 precision (the course's worlds)", lambda c: c.a.get("precision") is not None
                 and getattr(c.a["precision"], "optimizer", None) == 8)]


def _sp_entries(also=lambda c: True):
    """tp > 1 with sequence parallelism (2.9) and without (sp=False: 2.7's tp alone, as 2.11 runs it)."""
    return [when(f"sp={sp}, tp > 1", lambda c, sp=sp: _layout(c).tp > 1 and _layout(c).sp is sp and also(c))
            for sp in (True, False)]


def _dimension_entries(dim: str, more=()):
    return [when(f"{dim} = 1 (nothing to send)", lambda c: getattr(_layout(c), dim) == 1 and c.result == []),
            when(f"{dim} > 1", lambda c: getattr(_layout(c), dim) > 1),
            when(f"{dim} > 1 with checkpointing", lambda c: getattr(_layout(c), dim) > 1 and _layout(c).checkpointing),
            *more, *_precision_entries()]


CONTRACT = {
    "Model.layer_parameters": [],
    "Model.parameters": [always()],
    "Layout.describe": [],
    "stage_parameters": [when("pp > 1 and tp > 1", lambda c: c.a["pp"] > 1 and c.a["tp"] > 1)],
    "micro_batch_size": [],
    "check_layout": [],
    "in_flight": [*_schedule_entries(), when("m < p", lambda c: c.a["microbatches"] < c.a["pp"])],
    "bubble_fraction": _schedule_entries(),
    "activation_bytes": [
        when("checkpointing", lambda c: _layout(c).checkpointing),
        when("flash attention (no saved scores)", lambda c: c.a["model"].flash),
        when("cp > 1", lambda c: _layout(c).cp > 1),
        when("interleaved chunks", lambda c: _layout(c).chunks > 1),
        *_sp_entries(),
        when("sp=False, tp > 1, with checkpointing (the kept input whole)",
             lambda c: _layout(c).tp > 1 and not _layout(c).sp and _layout(c).checkpointing),
        *_precision_entries(),
    ],
    "memory": [*[when(f"ZeRO stage {z}", lambda c, z=z: _layout(c).zero == z) for z in range(4)],
               when("tp and pp > 1", lambda c: _layout(c).tp > 1 and _layout(c).pp > 1),
               *_sp_entries(), *_precision_entries()],
    "ring_bytes": [*[when(f"kind={k!r}", lambda c, k=k: c.a["kind"] == k)
                     for k in ("all_reduce", "reduce_scatter", "all_gather", "send")],
                   when("n = 1", lambda c: c.a["n"] == 1),
                   raises("another kind", ValueError)],
    "tp_collectives": _dimension_entries("tp"),
    "cp_collectives": _dimension_entries("cp"),
    "pp_collectives": _dimension_entries("pp", [
        when("pp = 2 (two edge ranks)", lambda c: _layout(c).pp == 2),
        when("pp > 2, interleaved", lambda c: _layout(c).pp > 2 and _layout(c).chunks > 1),
        *_sp_entries(lambda c: _layout(c).pp > 1)]),
    "dp_collectives": [*[when(f"ZeRO stage {z} over dp * cp > 1", lambda c, z=z: _layout(c).zero == z
                              and _layout(c).dp * _layout(c).cp > 1) for z in range(4)],
                       when("dp * cp = 1", lambda c: _layout(c).dp * _layout(c).cp == 1),
                       *_precision_entries()],
    "collectives": [always(), default("precision")],
    "communication_bytes": [always(), *_precision_entries()],
    "link": [*[when(f"dim={d!r}", lambda c, d=d: c.a["dim"] == d) for d in ("tp", "cp", "dp", "pp")],
             when("inside a node", lambda c: tuple(c.result) == (c.a["cluster"].alpha_intra, c.a["cluster"].beta_intra)),
             when("across nodes", lambda c: tuple(c.result) == (c.a["cluster"].alpha_inter, c.a["cluster"].beta_inter)
                  and c.a["cluster"].alpha_inter != c.a["cluster"].alpha_intra)],
    "collective_seconds": [when("n = 1", lambda c: c.a["c"].n == 1),
                           *[when(f"kind={k!r}", lambda c, k=k: c.a["c"].kind == k)
                             for k in ("all_reduce", "reduce_scatter", "all_gather", "send")]],
    "flops_per_token": [],
    "step_time": [when("pp > 1 (a bubble)", lambda c: _layout(c).pp > 1),
                  when("groups across nodes", lambda c: c.a["cluster"].gpus_per_node < _layout(c).world),
                  raises("layout.world != cluster.world", ValueError), default("precision")],
    "candidate_layouts": [],
    "rank_layouts": [when("nothing fits (empty)", lambda c: c.result == []),
                     when("some fit", lambda c: len(c.result) > 0), default("precision")],
    "format_table": [],
    "main": [when("a ranked table (0)", lambda c: c.result == 0), raises("bad input (exit 2)", SystemExit)],
}

_GIVEN = "given code (no EXERCISE region): the learner writes nothing in it"
IRRELEVANT = {
    "Model.layer_parameters": _GIVEN + "; its numbers reach the tests through stage_parameters and memory",
    "Layout.describe": _GIVEN + " (a label for the table)",
    "micro_batch_size": _GIVEN + " (batch // (dp * microbatches))",
    "check_layout": _GIVEN + "; the exercise functions call it before their regions",
    "flops_per_token": _GIVEN + "; test_2_12_step_time_terms checks the compute term it feeds",
    "candidate_layouts": _GIVEN + "; test_2_12_rank_layouts_sorted_and_only_what_fits ranks its output",
    "format_table": _GIVEN + "; test_2_12_command_line prints it",
    "memory: precision left to its default": SIGNATURE_DEFAULT,
    "activation_bytes: precision left to its default": SIGNATURE_DEFAULT,
    "tp_collectives: precision left to its default": SIGNATURE_DEFAULT,
    "cp_collectives: precision left to its default": SIGNATURE_DEFAULT,
    "pp_collectives: precision left to its default": SIGNATURE_DEFAULT,
    "dp_collectives: precision left to its default": SIGNATURE_DEFAULT,
    "collectives: precision left to its default": SIGNATURE_DEFAULT,
    "communication_bytes: precision left to its default": SIGNATURE_DEFAULT,
    "step_time: precision left to its default": SIGNATURE_DEFAULT,
    "rank_layouts: precision left to its default": SIGNATURE_DEFAULT,
}
