"""Contract of exercise 2.6 (pipeline.py's docstrings; guidelines 2.6): the schedules (GPipe, 1F1B, interleaved,
zero bubble), the time grid and its bubble, activations in flight, micro-batches, and the executor."""

import torch

from contracts import none, raises, when


def _pm(c):
    return c.a.get("num_stages", c.a.get("num_ranks")), c.a["num_microbatches"]


def _schedule_entries():
    return [
        when("m = p", lambda c: _pm(c)[1] == _pm(c)[0]),
        when("m > p", lambda c: _pm(c)[1] > _pm(c)[0]),
        when("m < p", lambda c: _pm(c)[1] < _pm(c)[0]),
        when("p = 1", lambda c: _pm(c)[0] == 1),
        when("m = 1", lambda c: _pm(c)[1] == 1),
        raises("an argument not an integer >= 1", ValueError),
    ]


def _kinds(actions):
    return {a[0] for a in actions}


CONTRACT = {
    "VirtualStage.__init__": [
        when("ranks round-robin (interleaved: k % p)", lambda c: list(c.a["ranks"]) == [k % (max(c.a["ranks"]) + 1)
                                                                                     for k in range(c.a["num_stages"])]),
        when("several virtual stages on one rank", lambda c: len(set(c.a["ranks"])) < len(c.a["ranks"])),
        none("device"),
    ],
    "gpipe_schedule": _schedule_entries(),
    "one_f_one_b_schedule": _schedule_entries(),
    "zero_bubble_schedule": _schedule_entries(),
    "interleaved_schedule": [
        when("v = 1 (1F1B)", lambda c: c.a["num_chunks"] == 1),
        when("v = 2", lambda c: c.a["num_chunks"] == 2),
        when("v > 2", lambda c: c.a["num_chunks"] > 2),
        when("m = p", lambda c: c.a["num_microbatches"] == c.a["num_ranks"]),
        when("m a larger multiple of p", lambda c: c.a["num_microbatches"] > c.a["num_ranks"]),
        when("p = 1", lambda c: c.a["num_ranks"] == 1),
        raises("m not a multiple of p", ValueError, lambda c: isinstance(c.a["num_microbatches"], int)
               and isinstance(c.a["num_ranks"], int) and c.a["num_ranks"] >= 1
               and c.a["num_microbatches"] % c.a["num_ranks"] != 0),
        raises("an argument not an integer >= 1", ValueError),
    ],
    "time_grid": [
        none("costs"),
        when("costs for F, B and W", lambda c: c.a["costs"] is not None and {"F", "B", "W"} <= set(c.a["costs"])),
        when("costs of 1 spelled out", lambda c: c.a["costs"] is not None and set(c.a["costs"].values()) == {1}),
        when("a zero-bubble schedule (W actions)", lambda c: any("W" in _kinds(row) for row in c.a["schedule"])),
        when("virtual stages (3-tuples)", lambda c: any(len(a) == 3 for row in c.a["schedule"] for a in row)),
        raises("a malformed schedule", ValueError),
    ],
    "bubble_fraction": [when("a grid without idle slots (0)", lambda c: c.result == 0),
                        when("a grid with a bubble", lambda c: c.result > 0)],
    "max_in_flight": [when("with W actions (held until W)", lambda c: "W" in _kinds(c.a["actions"])),
                      when("virtual stages counted apart", lambda c: any(len(a) == 3 for a in c.a["actions"])),
                      when("an empty list", lambda c: len(c.a["actions"]) == 0)],
    "split_microbatches": [
        when("one micro-batch", lambda c: c.a["num_microbatches"] == 1),
        when("one sample each", lambda c: c.a["num_microbatches"] == len(c.a["batch"])),
        when("a multi-dimensional batch", lambda c: c.a["batch"].dim() > 2),
        raises("not dividing len(batch)", ValueError),
    ],
    "run_pipeline": [
        when("GPipe actions", lambda c: _kinds(c.a["actions"]) == {"F", "B"}),
        when("zero-bubble actions (B split from W)", lambda c: "W" in _kinds(c.a["actions"])),
        when("several virtual stages on this rank", lambda c: isinstance(c.a["stage"], (list, tuple))
             and len(c.a["stage"]) > 1),
        when("inputs None (not the first stage)", lambda c: c.a["microbatch_inputs"] is None),
        when("targets None (not the last stage)", lambda c: c.a["microbatch_targets"] is None),
        when("one rank holding every stage", lambda c: c.world == 1 or (isinstance(c.a["stage"], (list, tuple))
                                                                          and any(s.is_first for s in c.a["stage"])
                                                                          and any(s.is_last for s in c.a["stage"]))),
        when("twice without zero_grad (gradients add up)", lambda c: c.count > 1),
    ],
}

IRRELEVANT = {
    "VirtualStage.__init__: device=None": "given code (no EXERCISE region): 2.5's PipelineStage resolves the device",
}
