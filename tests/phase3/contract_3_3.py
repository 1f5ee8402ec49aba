"""Contract of exercise 3.3 (hierarchical.py's docstrings; guidelines 3.3): topology, groups, the hierarchical
all-reduce and its cost model."""

import torch

from contracts import default, none, raises, when


def _t(c):
    return c.a["tensor"]


def _k(c):
    return torch.distributed.get_world_size(c.a["groups"].intra)


CONTRACT = {
    "topology_from_env": [
        none("ranks_per_node"), when("ranks_per_node = 1", lambda c: c.a["ranks_per_node"] == 1),
        when("one node (ranks_per_node = world)", lambda c: c.result.num_nodes == 1),
        when("from torchrun's GROUP_RANK/LOCAL_RANK", lambda c: c.a["ranks_per_node"] is None),
        raises("world not divisible into nodes", ValueError),
        raises("variables contradict node-major numbering", ValueError, lambda c: c.a["ranks_per_node"] is None),
    ],
    "build_groups": [
        when("2 nodes of 2", lambda c: c.a["topology"].num_nodes == 2 and c.a["topology"].ranks_per_node == 2),
        when("one rank per node", lambda c: c.a["topology"].ranks_per_node == 1),
        when("one node", lambda c: c.a["topology"].num_nodes == 1),
        when("more than 2 nodes", lambda c: c.a["topology"].num_nodes > 2),
        when("more than 2 ranks per node", lambda c: c.a["topology"].ranks_per_node > 2),
    ],
    "hierarchical_all_reduce": [
        default("op"), when("op='avg'", lambda c: c.a["op"] == "avg"),
        raises("op unknown", ValueError, lambda c: c.a["op"] not in ("sum", "avg")),
        raises("op='avg' of an integer tensor", TypeError, lambda c: c.a["op"] == "avg"),
        when("numel not divisible by the node size", lambda c: _t(c).numel() % _k(c) != 0),
        when("numel < node size", lambda c: _t(c).numel() < _k(c)),
        when("an integer tensor", lambda c: not _t(c).is_floating_point()),
        when("float64", lambda c: _t(c).dtype == torch.float64),
        when("bf16/fp16", lambda c: _t(c).dtype in (torch.bfloat16, torch.float16)),
        when("a multi-dimensional tensor", lambda c: _t(c).dim() > 1),
        when("a non-contiguous tensor", lambda c: not _t(c).is_contiguous()),
        when("one rank per node", lambda c: _k(c) == 1),
        when("one node", lambda c: torch.distributed.get_world_size(c.a["groups"].inter) == 1),
    ],
    "cross_node_bytes": [
        when("one node", lambda c: c.a["num_nodes"] == 1), when("one rank per node", lambda c: c.a["ranks_per_node"] == 1),
        when("several of both", lambda c: c.a["num_nodes"] > 1 and c.a["ranks_per_node"] > 1),
    ],
    "predict_seconds": [
        none("nics_per_node"), when("nics_per_node < ranks_per_node (shared NICs)",
                                    lambda c: c.a["nics_per_node"] is not None
                                    and c.a["nics_per_node"] < c.a["ranks_per_node"]),
        when("one node", lambda c: c.a["num_nodes"] == 1), when("one rank per node", lambda c: c.a["ranks_per_node"] == 1),
        when("intra links slower than inter", lambda c: c.a["intra"].bandwidth < c.a["inter"].bandwidth),
        when("intra links faster", lambda c: c.a["intra"].bandwidth > c.a["inter"].bandwidth),
    ],
    "main": [],
}

IRRELEVANT = {
    "hierarchical_all_reduce: op unknown": "given code (the op check before the EXERCISE region)",
    "hierarchical_all_reduce: op='avg' of an integer tensor": "given code (the op check before the EXERCISE region)",

    "main": "given code (no EXERCISE region): the benchmark's command line",
}
