"""Contract of exercise 3.1 (ring.py's docstrings; guidelines 3.1): a ring of point-to-point messages over a group."""

import torch

from contracts import SIGNATURE_DEFAULT, default, none, raises, when, world_group


def _t(c):
    return c.a["tensor"]


def _sub(c):
    g = c.a.get("group")
    return g is not None and torch.distributed.get_world_size(g) < c.world


def _ring(op: bool = True):
    entries = [
        none("group"), world_group(), when("group a subgroup (global ranks != group ranks)", _sub),
        when("world of 1", lambda c: c.world == 1), when("world of 2", lambda c: c.world == 2),
        when("world > 3", lambda c: c.world > 3),
        when("numel divisible by p", lambda c: c.world > 1 and _t(c).numel() % c.world == 0),
        when("numel not divisible by p (longer first chunks)", lambda c: _t(c).numel() % c.world != 0
             and _t(c).numel() > c.world),
        when("numel < p (empty chunks)", lambda c: 0 < _t(c).numel() < c.world),
        when("a multi-dimensional tensor", lambda c: _t(c).dim() > 1),
        when("a non-contiguous tensor", lambda c: not _t(c).is_contiguous()),
        when("an integer tensor", lambda c: not _t(c).is_floating_point()),
        when("float64", lambda c: _t(c).dtype == torch.float64),
        when("half precision (bf16/fp16)", lambda c: _t(c).dtype in (torch.bfloat16, torch.float16)),
    ]
    if op:
        entries += [default("op"), when("op='sum' spelled out", lambda c: "op" in c.given and c.a["op"] == "sum"),
                    when("op='avg'", lambda c: c.a["op"] == "avg"),
                    raises("op unknown", ValueError, lambda c: c.a["op"] not in ("sum", "avg")),
                    raises("op='avg' of an integer tensor", TypeError, lambda c: c.a["op"] == "avg")]
    return entries


CONTRACT = {
    "send_recv": [
        when("dst == src (a ring of 2)", lambda c: c.a["dst"] == c.a["src"]),
        when("dst != src", lambda c: c.a["dst"] != c.a["src"]),
        when("group given", lambda c: c.a["group"] is not None),
        when("tensors of different sizes", lambda c: c.a["to_send"].numel() != c.a["to_recv"].numel()),
        when("empty tensors", lambda c: c.a["to_send"].numel() == 0),
    ],
    "ring_neighbours": [none("group"), world_group(), when("group a subgroup", _sub),
                        when("world of 1", lambda c: c.world == 1)],
    "ring_reduce_scatter": _ring(),
    "ring_all_gather": _ring(op=False),
    "ring_all_reduce": _ring(),
}

IRRELEVANT = {
    "ring_reduce_scatter: op left to its default": SIGNATURE_DEFAULT,
    "ring_all_reduce: op left to its default": SIGNATURE_DEFAULT,
    "send_recv": "given code (no EXERCISE region): the exchange primitive the graded ring functions call",
    **{f"{fn}: {what}": "given code (before the EXERCISE region): a non-contiguous tensor is made contiguous, "
        "reduced and copied back by the given lines; the op checks are given (_check)" for fn, what in [
        ("ring_reduce_scatter", "a non-contiguous tensor"), ("ring_all_gather", "a non-contiguous tensor"),
        ("ring_all_reduce", "a non-contiguous tensor"), ("ring_reduce_scatter", "op unknown"),
        ("ring_all_reduce", "op unknown"), ("ring_reduce_scatter", "op='avg' of an integer tensor")]},
}
