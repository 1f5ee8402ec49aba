"""Contract of exercise 1.3 (comm_bench.py's docstrings; guidelines 1.3): timing a collective, the alpha-beta fit,
the cost model and nccl-tests' bandwidths."""

import math

from contracts import default, explicit, raises, value, when

_STRATEGIES = ("reduce_broadcast", "gather_sum", "recursive_doubling", "ring", "halving_doubling")


def _pow2(p):
    return p & (p - 1) == 0


def _line_is_exact(c):
    n, t = c.a["sizes_bytes"], c.a["seconds"]
    alpha, beta = c.result
    return all(math.isclose(alpha + beta * x, y, rel_tol=1e-9) for x, y in zip(n, t))


CONTRACT = {
    "time_collective": [
        default("iters"), default("warmup"), explicit("iters", 10), explicit("warmup", 2),
        when("iters = 1", lambda c: c.a["iters"] == 1),
        when("warmup = 0", lambda c: c.a["warmup"] == 0),
        when("a clock given (the caller's)", lambda c: "clock" in c.given),
        default("clock"),
        when("world of 1", lambda c: c.world == 1),
        when("world > 2", lambda c: c.world > 2),
        when("a CPU tensor", lambda c: not c.a["tensor"].is_cuda),
        when("a CUDA tensor (wait for the device)", lambda c: c.a["tensor"].is_cuda),
        raises("iters = 0", ValueError, lambda c: c.a["iters"] == 0),
        raises("warmup < 0", ValueError, lambda c: c.a["warmup"] < 0),
    ],
    "fit_alpha_beta": [
        when("two sizes, exact", lambda c: len(set(c.a["sizes_bytes"])) == 2),
        when("many sizes, timings on the line", lambda c: len(set(c.a["sizes_bytes"])) > 2 and _line_is_exact(c)),
        when("many sizes, noisy timings", lambda c: len(set(c.a["sizes_bytes"])) > 2 and not _line_is_exact(c)),
        when("a size repeated (several timings of one size)",
             lambda c: len(set(c.a["sizes_bytes"])) < len(c.a["sizes_bytes"])),
        when("sizes not in increasing order", lambda c: list(c.a["sizes_bytes"]) != sorted(c.a["sizes_bytes"])),
        when("integer sizes", lambda c: all(isinstance(x, int) for x in c.a["sizes_bytes"])),
        raises("lengths differ", ValueError, lambda c: len(c.a["sizes_bytes"]) != len(c.a["seconds"])),
        raises("one distinct size", ValueError, lambda c: len(set(c.a["sizes_bytes"])) == 1
               and len(c.a["sizes_bytes"]) == len(c.a["seconds"])),
        raises("a timing <= 0", ValueError, lambda c: min(c.a["seconds"]) <= 0 and len(set(c.a["sizes_bytes"])) > 1),
    ],
    "cost_terms": [
        value("strategy", *_STRATEGIES),
        when("world of 1", lambda c: c.a["world_size"] == 1),
        when("world of 2", lambda c: c.a["world_size"] == 2),
        when("world a power of two > 2", lambda c: c.a["world_size"] > 2 and _pow2(c.a["world_size"])),
        when("world not a power of two", lambda c: not _pow2(c.a["world_size"])),
        when("halving_doubling, world not a power of two",
             lambda c: c.a["strategy"] == "halving_doubling" and not _pow2(c.a["world_size"])),
        when("recursive_doubling, world not a power of two",
             lambda c: c.a["strategy"] == "recursive_doubling" and not _pow2(c.a["world_size"])),
        raises("unknown strategy, world > 1", ValueError, lambda c: c.a["strategy"] not in _STRATEGIES
               and c.a["world_size"] > 1),
        raises("unknown strategy, world of 1 (whatever p)", ValueError, lambda c: c.a["strategy"] not in _STRATEGIES
               and c.a["world_size"] == 1),
        raises("world_size < 1", ValueError, lambda c: c.a["world_size"] < 1),
    ],
    "link_alpha_beta": [
        when("world of 1: None", lambda c: c.a["world_size"] == 1 and c.result is None),
        when("world > 1", lambda c: c.a["world_size"] > 1),
    ],
    "describe_fit": [],
    "bandwidths": [
        when("world of 1 (busbw 0)", lambda c: c.a["world_size"] == 1),
        when("world of 2", lambda c: c.a["world_size"] == 2),
        when("world > 2", lambda c: c.a["world_size"] > 2),
        when("a fractional size or time", lambda c: not float(c.a["size_bytes"]).is_integer()
             or c.a["seconds"] < 1e-3),
    ],
    "sweep": [],
    "format_table": [],
    "main": [],
}

IRRELEVANT = {
    "describe_fit": "given code (no EXERCISE region): formats a fit for the benchmark's table",
    "sweep": "given code (no EXERCISE region): the benchmark's loop over sizes; tests/test_phase1.py's "
             "test_comm_bench_* run it as a program",
    "format_table": "given code (no EXERCISE region): the benchmark's table",
    "main": "given code (no EXERCISE region): the benchmark's command line (test_comm_bench_rejects_bad_arguments)",
    **{f"{fn}: {what}": "given code (the argument check before the EXERCISE region); test_comm_bench_rejects_bad_"
       "arguments runs the program's checks" for fn, what in [
           ("time_collective", "iters = 0"), ("time_collective", "warmup < 0"), ("fit_alpha_beta", "lengths differ"),
           ("fit_alpha_beta", "one distinct size"), ("fit_alpha_beta", "a timing <= 0"), ("cost_terms", "world_size < 1")]},
}
