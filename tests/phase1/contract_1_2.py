"""Contract of exercise 1.2 (allreduce.py's docstrings; guidelines 1.2): dist.all_reduce's contract for three
algorithms, the input space tests/contracts.py records."""

import torch

from contracts import default, explicit, raises, when


def _t(c):
    return c.a["tensor"]


def _pow2(p):
    return p & (p - 1) == 0


def _common(root: bool = False):
    entries = [
        when("op='sum' spelled out", lambda c: "op" in c.given and c.a["op"] == "sum"),
        default("op"),
        when("op='avg'", lambda c: c.a["op"] == "avg"),
        when("world of 1", lambda c: c.world == 1),
        when("world of 2", lambda c: c.world == 2),
        when("world of 3 (not a power of two)", lambda c: c.world == 3),
        when("world of 4", lambda c: c.world == 4),
        when("world > 4, not a power of two", lambda c: c.world > 4 and not _pow2(c.world)),
        when("world > 4, a power of two", lambda c: c.world > 4 and _pow2(c.world)),
        when("float32", lambda c: _t(c).dtype == torch.float32),
        when("float64", lambda c: _t(c).dtype == torch.float64),
        when("an integer tensor, op='sum'", lambda c: not _t(c).is_floating_point() and c.a["op"] == "sum"),
        when("a half-precision tensor (bfloat16/float16)", lambda c: _t(c).dtype in (torch.bfloat16, torch.float16)),
        when("a 0-d tensor", lambda c: _t(c).dim() == 0),
        when("a multi-dimensional tensor", lambda c: _t(c).dim() > 1),
        when("one element", lambda c: _t(c).numel() == 1),
        when("a view into a larger buffer", lambda c: _t(c)._base is not None
             and _t(c)._base.numel() > _t(c).numel()),
        when("called again in the same process (repeat)", lambda c: c.count > 1),
        raises("op neither 'sum' nor 'avg'", ValueError, lambda c: c.a["op"] not in ("sum", "avg")),
        raises("op='avg' of an integer tensor", TypeError, lambda c: c.a["op"] == "avg"
               and not _t(c).is_floating_point()),
    ]
    if root:
        entries += [default("root"), explicit("root", 0),
                    when("root = world - 1 > 0", lambda c: c.a["root"] == c.world - 1 > 0),
                    when("root in the middle (0 < root < world - 1)", lambda c: 0 < c.a["root"] < c.world - 1)]
    return entries


CONTRACT = {
    "allreduce_reduce_broadcast": _common(root=True),
    "allreduce_gather_sum": _common(),
    "allreduce_recursive_doubling": _common(),
}

_GIVEN_CHECK = ("given code (_check, before the EXERCISE region): tests/test_phase1.py's test_allreduce_rejects_bad_op "
                "checks it for every strategy, outside the graded tests")
IRRELEVANT = {f"{fn}: {what}": _GIVEN_CHECK for fn in CONTRACT
              for what in ("op neither 'sum' nor 'avg'", "op='avg' of an integer tensor")}
