"""Contract of exercise 4.6 (hangs.py's docstrings; guidelines 4.6): a per-rank flight recorder and the diagnosis of
where ranks diverged."""

import torch.distributed as dist

from contracts import SIGNATURE_DEFAULT, default, none, raises, when


def _op(c):
    return getattr(c.a["collective"], "__name__", "")


CONTRACT = {
    "signature": [none("dtype"), when("a shape", lambda c: c.a["shape"] is not None),
                  when("an empty shape (0-d)", lambda c: c.a["shape"] == [])],
    "CollectiveRecorder.__init__": [default("capacity"), when("a small capacity (ring buffer wraps)",
                                                              lambda c: c.a["capacity"] < 10),
                                    none("dump_path"), when("a '{rank}' dump path", lambda c: "{rank}" in str(c.a["dump_path"]))],
    "CollectiveRecorder.__call__": [
        when("all_reduce", lambda c: _op(c) == "all_reduce"), when("broadcast", lambda c: _op(c) == "broadcast"),
        when("barrier (no tensor)", lambda c: _op(c) == "barrier"),
        when("all_gather_into_tensor / _single", lambda c: "gather" in _op(c)),
        when("reduce_scatter", lambda c: "reduce_scatter" in _op(c)),
        when("group a subgroup", lambda c: c.a["group"] is not None and dist.get_world_size(c.a["group"]) < c.world),
        when("two groups interleaved", lambda c: c.a["group"] is not None and any(p.get("group") is None
                                                                                   for p in c.previous("__call__"))),
        when("a keyword argument passed on", lambda c: len(c.given - {"collective", "args", "group"}) > 0),
        raises("timed out (a rank never came)", Exception, lambda c: type(c.raised).__name__ == "CollectiveTimeout"),
        raises("the collective's own error (propagated)", Exception,
               lambda c: type(c.raised).__name__ != "CollectiveTimeout"),
        when("more collectives than the capacity", lambda c: c.count > c.self.capacity),
    ],
    "CollectiveRecorder.dump": [when("after a timeout", lambda c: True),
                                when("a copy (the caller mutates it)", lambda c: True)],
    "CollectiveRecorder.write_dump": [when("called", lambda c: True)],
    "diagnose": [
        when("no divergence ([])", lambda c: c.result == []),
        when("a skipped collective", lambda c: any(f["kind"] == "skipped" for f in c.result)),
        when("a mismatch (op, dtype or shape)", lambda c: any(f["kind"] == "mismatch" for f in c.result)),
        when("several groups diverging", lambda c: len(c.result) > 1),
        when("dumps in any order", lambda c: [d.get("rank") for d in c.a["dumps"]]
             != sorted(d.get("rank") for d in c.a["dumps"] if d.get("rank") is not None)),
        when("an entry evicted from a ring buffer", lambda c: any(f.get("expected") is None for f in c.result)),
        when("a tie for 'expected'", lambda c: True and len(c.a["dumps"]) == 2),
    ],
}

IRRELEVANT = {
    "CollectiveRecorder.__init__: capacity left to its default": SIGNATURE_DEFAULT + " (2000)",
    "signature": "given code (no EXERCISE region): the name of a collective in messages",
    "CollectiveRecorder.write_dump": "given code (no EXERCISE region): writes the graded dump() atomically",
}
