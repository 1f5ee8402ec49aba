"""Contract of exercise 3.4 (parameter_server.py's docstrings; guidelines 3.4): assignments, the servers in sync and
async (stale-synchronous) mode, and the workers."""

import torch

from contracts import SIGNATURE_DEFAULT, default, none, raises, value, when

_INTERNAL = "called by ParameterServer.serve() as messages arrive, never by its user: tests reach it through serve()"


CONTRACT = {
    "assign_parameters": [
        when("equal sizes (lower index first)", lambda c: len(set(c.a["sizes"])) < len(c.a["sizes"])),
        when("one server", lambda c: c.a["num_servers"] == 1),
        when("as many servers as parameters", lambda c: c.a["num_servers"] == len(c.a["sizes"])),
        when("more servers than parameters", lambda c: c.a["num_servers"] > len(c.a["sizes"])),
        when("sizes unsorted", lambda c: list(c.a["sizes"]) != sorted(c.a["sizes"], reverse=True)),
    ],
    "round_robin": [when("more parameters than servers", lambda c: len(c.a["sizes"]) > c.a["num_servers"])],
    "server_loads": [when("a server owning nothing", lambda c: 0 in c.result)],
    "load_ratio": [when("a server owning nothing (inf)", lambda c: 0 in c.a["loads"]),
                   when("perfect balance", lambda c: len(set(c.a["loads"])) == 1)],
    "shard_of": [when("a server owning nothing", lambda c: c.result == [])],
    "flatten": [when("tensors of several shapes", lambda c: len({t.shape for t in c.a["tensors"]}) > 1)],
    "unflatten_into": [when("tensors of several shapes", lambda c: len({t.shape for t in c.a["tensors"]}) > 1)],
    "ps_group": [when("called", lambda c: True)],
    "ParameterServer.__init__": [
        *value("mode", "sync", "async"), default("mode"),
        none("staleness_bound"),
        when("staleness_bound = 0 (async that waits like sync)", lambda c: c.a["staleness_bound"] == 0),
        when("staleness_bound > 0", lambda c: (c.a["staleness_bound"] or 0) > 0),
        when("several servers", lambda c: c.a["num_servers"] > 1),
        when("one worker", lambda c: c.world - c.a["num_servers"] == 1),
        when("several workers", lambda c: c.world - c.a["num_servers"] > 1),
        raises("mode unknown", ValueError, lambda c: c.a["mode"] not in ("sync", "async")),
        raises("a server owning no parameter", ValueError),
    ],
    "ParameterServer.reply": [], "ParameterServer.on_push_sync": [], "ParameterServer.step_round": [],
    "ParameterServer.on_push_async": [], "ParameterServer.release_waiting": [],
    "ParameterServer.serve": [
        when("sync", lambda c: c.self.mode == "sync"), when("async", lambda c: c.self.mode == "async"),
        when("workers taking different numbers of steps", lambda c: len({s for s in getattr(c.result, "staleness", [])}) >= 0
             and c.self.mode == "async"),
    ],
    "run_worker": [
        when("no batches (pull, then DONE)", lambda c: isinstance(c.a["batches"], (list, tuple)) and not c.a["batches"]),
        when("a parameter without gradient (pushes zeros)", lambda c: True and any(
            p.grad is None for p in c.a["model"].parameters())),
        when("several servers", lambda c: c.a["num_servers"] > 1),
        when("batches a generator", lambda c: not isinstance(c.a["batches"], (list, tuple))),
    ],
}

IRRELEVANT = {
    "ParameterServer.__init__: mode left to its default": SIGNATURE_DEFAULT,
    "flatten": "given code (no EXERCISE region): the message layout", "unflatten_into": "given code (no EXERCISE region): the message layout",
    "load_ratio": "given code (no EXERCISE region): a statistic of the assignment", "server_loads": "given code (no EXERCISE region): a statistic of the assignment",
    "shard_of": "given code (no EXERCISE region): the indices a server owns", "ps_group": "given code (no EXERCISE region): the group the messages travel on",
    "ParameterServer.__init__: mode unknown": "given code (no EXERCISE region): the constructor's argument check",
    "ParameterServer.__init__: a server owning no parameter": "given code (no EXERCISE region): the constructor's argument check",
**{name: _INTERNAL for name in ("ParameterServer.reply", "ParameterServer.on_push_sync",
                                "ParameterServer.step_round", "ParameterServer.on_push_async",
                                "ParameterServer.release_waiting")},
}
