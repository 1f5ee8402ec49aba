"""Graded tests of exercise 1.3, communication overhead (phase1_data_parallel/guidelines.md, section 1.3).

Run them with `python tests/test_phase1.py -k 1_3` (your code) or
`pytest tests/test_phase1.py -k 1_3` (the reference); tests/test_phase1.py collects them.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, given, settings, strategies as st
from torch.overrides import TorchFunctionMode

import grading
from common.launch import run_world
from common.measure import CollectiveLog


SIZES = [1024.0 * 4**k for k in range(8)]  # 1 KiB .. 16 MiB
# Property tests draw their cases from a fixed seed: a grading run is reproducible.
PROPERTY_SETTINGS = dict(derandomize=True, database=None, deadline=None)
STRATEGY_NAMES = ("reduce_broadcast", "gather_sum", "recursive_doubling", "ring", "halving_doubling")


def expected_cost_terms(strategy: str, p: int) -> tuple[float, float]:
    """(latency terms, byte terms) of each algorithm on p ranks, written out independently of the code graded
    (guidelines 1.3, the table): q is the largest power of two <= p; recursive doubling and
    Rabenseifner fold the p - q other ranks in and out (two whole-message steps)."""
    if p == 1:
        return 0, 0
    log_p, q = math.ceil(math.log2(p)), 1 << (p.bit_length() - 1)
    fold = 2 if p > q else 0
    return {
        "reduce_broadcast": (p - 1 + log_p, p - 1 + log_p), "gather_sum": (p - 1, p - 1),
        "recursive_doubling": (math.log2(q) + fold, math.log2(q) + fold), "ring": (2 * (p - 1), 2 * (p - 1) / p),
        "halving_doubling": (2 * math.log2(q) + fold, 2 * (q - 1) / q + fold),
    }[strategy]


def test_1_3_fit_alpha_beta_recovers_the_model(grade):
    mod = grade("1.3").load()
    alpha, beta = mod.fit_alpha_beta(SIZES, [50e-6 + 1e-9 * n for n in SIZES])
    assert alpha == pytest.approx(50e-6, rel=1e-6) and beta == pytest.approx(1e-9, rel=1e-6), \
        f"exact data t = 50us + 1ns/byte * n gave alpha={alpha:.6g}, beta={beta:.6g}"


@pytest.mark.parametrize("sign", [1, -1], ids=["up-first", "down-first"])
def test_1_3_fit_lets_small_sizes_determine_alpha(grade, sign):
    mod = grade("1.3").load()
    # every timing off by 4%, alternately up and down: a 4% wobble at 16 MiB (0.7 ms) is
    # 13x alpha, so a fit that weighs absolute errors loses alpha; relative errors keep it
    times = [(50e-6 + 1e-9 * n) * (1 + 0.04 * sign * (-1) ** i) for i, n in enumerate(SIZES)]
    alpha, beta = mod.fit_alpha_beta(SIZES, times)
    assert alpha == pytest.approx(50e-6, rel=0.1) and beta == pytest.approx(1e-9, rel=0.1), (
        f"timings of 50us + 1ns/byte * n, each 4% off, sizes 1 KiB..16 MiB: the fit gave alpha = {alpha * 1e6:.4g} us, "
        f"beta = {beta * 1e9:.4g} ns/byte; expected both within 10% (weigh each size by its relative error, "
        "so that the small sizes determine alpha)")


LINK_ALPHA, LINK_BETA = 20e-6, 0.25e-9  # one link: 20 us, 4 GB/s


@pytest.mark.parametrize("world", [2, 3, 4, 6, 8])
def test_1_3_link_alpha_beta_per_strategy(grade, world):
    mod = grade("1.3").load()
    counts = {strategy: expected_cost_terms(strategy, world) for strategy in STRATEGY_NAMES}
    for strategy, (a, b) in counts.items():
        times = [a * LINK_ALPHA + b * n * LINK_BETA for n in SIZES]
        found = mod.link_alpha_beta(strategy, world, SIZES, times)
        assert found is not None, f"link_alpha_beta({strategy!r}, world={world}) returned None"
        alpha, beta = found
        assert alpha == pytest.approx(LINK_ALPHA, rel=1e-6) and beta == pytest.approx(LINK_BETA, rel=1e-6), (
            f"{strategy} on {world} ranks, timings generated from link alpha = 20 us, beta = 0.25 ns/byte "
            f"(T = {a:g} alpha + {b:.4g} n beta): recovered alpha = {alpha * 1e6:.4g} us, beta = {beta * 1e9:.4g} ns/byte; "
            f"cost_terms gave {mod.cost_terms(strategy, world)}, expected ({a:g}, {b:.4g})")
    for strategy in STRATEGY_NAMES:
        assert mod.link_alpha_beta(strategy, 1, SIZES, [1e-6] * len(SIZES)) is None, \
            f"link_alpha_beta({strategy!r}, world=1): one rank sends nothing, there is no link to measure: expected None"
    with pytest.raises(ValueError):
        mod.cost_terms("no_such_strategy", world)


def test_1_3_cost_terms_for_any_world_size(grade):
    """For every strategy and p = 1 .. 4096: the table's (a, b); (0, 0) for p = 1; a ValueError
    for any other strategy name, for every p (p = 1 included: a typo is no cost model)."""
    mod = grade("1.3").load()
    for p in [*range(1, 70), 96, 127, 128, 129, 1000, 1024, 1025, 4095, 4096]:
        for strategy in STRATEGY_NAMES:
            got, (a, b) = mod.cost_terms(strategy, p), expected_cost_terms(strategy, p)
            assert len(got) == 2 and got[0] == pytest.approx(a, rel=1e-12) and got[1] == pytest.approx(b, rel=1e-12), (
                f"cost_terms({strategy!r}, {p}) = {got}, expected ({a:g}, {b:.6g}) (guidelines 1.3, the table; "
                f"q = {1 << (p.bit_length() - 1)} is the largest power of two <= p)")
        for bad in ("no_such_strategy", "torch_all_reduce", "Ring", ""):
            try:
                got = mod.cost_terms(bad, p)
            except ValueError:
                continue
            pytest.fail(f"cost_terms({bad!r}, {p}) returned {got}; an unknown strategy must raise ValueError for every "
                        "world size, p = 1 included")


def test_1_3_bandwidths_follow_nccl_tests(grade):
    mod = grade("1.3").load()
    algbw, busbw = mod.bandwidths(8e6, 2e-3, 4)
    assert algbw == pytest.approx(4e9), f"algbw = size / time = 4e9 B/s, got {algbw:.6g}"
    assert busbw == pytest.approx(6e9), f"busbw = algbw * 2(p-1)/p = 6e9 B/s for p=4, got {busbw:.6g}"
    assert mod.bandwidths(8e6, 2e-3, 1)[1] == 0, "a world of one rank moves no bytes: busbw must be 0"
    algbw, busbw = mod.bandwidths(10.0, 4.0, 3)  # numbers that do not divide evenly: 2.5 B/s, 2.5 * 4/3 B/s
    assert algbw == pytest.approx(2.5) and busbw == pytest.approx(10 / 3), \
        f"bandwidths(10 B, 4 s, 3 ranks): expected algbw 2.5, busbw {10 / 3:.6g} B/s; got {algbw:.6g}, {busbw:.6g}"


def test_1_3_bandwidths_and_fit_for_any_numbers(grade):
    """Any size, time and world size: algbw = S/t, busbw = algbw * 2(p-1)/p. Any link (alpha, beta),
    any sizes (ints or floats, unsorted, repeated) spanning the point where alpha = beta * n: a fit
    of exact timings gives them back, and link_alpha_beta gives back the link for every strategy."""
    mod = grade("1.3").load()

    @settings(max_examples=150, **PROPERTY_SETTINGS)
    @given(size=st.floats(1.0, 1e12), seconds=st.floats(1e-7, 1e3), p=st.integers(1, 4096))
    def check_bandwidths(size, seconds, p):
        algbw, busbw = mod.bandwidths(size, seconds, p)
        assert algbw == pytest.approx(size / seconds, rel=1e-9) and busbw == pytest.approx(
            size / seconds * 2 * (p - 1) / p, rel=1e-9, abs=0), (
            f"bandwidths({size!r} B, {seconds!r} s, {p} ranks) = ({algbw!r}, {busbw!r}), expected "
            f"({size / seconds!r}, {size / seconds * 2 * (p - 1) / p!r})")

    @settings(max_examples=100, **PROPERTY_SETTINGS)
    @given(alpha=st.floats(1e-7, 1e-2), beta=st.floats(1e-12, 1e-8), p=st.integers(1, 64),
           strategy=st.sampled_from(STRATEGY_NAMES), ints=st.booleans(), data=st.data())
    def check_fit(alpha, beta, p, strategy, ints, data):
        knee = alpha / beta  # where latency and transfer weigh the same: the sizes must span it
        low = data.draw(st.floats(1.0, knee / 2), label="smallest size")
        high = data.draw(st.floats(knee * 2, knee * 1e4), label="largest size")
        sizes = [low, high] + data.draw(st.lists(st.floats(low, high), max_size=6), label="other sizes")
        sizes = data.draw(st.permutations(sizes), label="order")
        if ints:
            sizes = [round(n) for n in sizes]
        assume(len(set(sizes)) >= 2)
        exact = [alpha + beta * n for n in sizes]
        got = mod.fit_alpha_beta(sizes, exact)
        assert got[0] == pytest.approx(alpha, rel=1e-6) and got[1] == pytest.approx(beta, rel=1e-6), (
            f"fit_alpha_beta(sizes={sizes}, exact timings of alpha={alpha!r} s + beta={beta!r} s/byte * n) = {got}")
        a, b = expected_cost_terms(strategy, p)
        link = mod.link_alpha_beta(strategy, p, sizes, [a * alpha + b * beta * n for n in sizes])
        if p == 1:
            assert link is None, f"link_alpha_beta({strategy!r}, world=1, ...) = {link}: one rank sends nothing, expected None"
        else:
            assert link is not None and link[0] == pytest.approx(alpha, rel=1e-6) and \
                link[1] == pytest.approx(beta, rel=1e-6), (
                    f"link_alpha_beta({strategy!r}, world={p}, sizes={sizes}, timings of a link alpha={alpha!r}, "
                    f"beta={beta!r} through T = {a:g} alpha + {b:.6g} n beta) = {link}")

    grading.stop_hypothesis_at_todo(check_bandwidths)()  # a TODO is reported at once, not shrunk
    grading.stop_hypothesis_at_todo(check_fit)()


class FakeClock:
    """A clock that only moves when the timed function runs: deterministic timings."""

    def __init__(self, step: float):
        self.now, self.step, self.calls = 0.0, step, 0

    def __call__(self) -> float:
        return self.now

    def work(self, tensor) -> None:
        self.calls += 1
        self.now += self.step


# (iters, warmup) of successive calls in one process; None: the argument left out, for its default
# (iters=10, warmup=2), and (10, 2): the defaults spelled out
TIMING_CALLS = [(5, 3), (1, 0), (2, 1), (None, None), (10, 2)]
DEFAULT_ITERS, DEFAULT_WARMUP = 10, 2


def _timing_rank(ref: grading.ModuleRef):
    mod = ref.load()
    out = []
    for iters, warmup in TIMING_CALLS:
        clock = FakeClock(step=1e-3 * (dist.get_rank() + 1))  # rank r takes (r+1) ms per call
        clock.now = 1e3 * dist.get_rank()  # the clocks of different ranks need not agree on the time of day
        given = {k: v for k, v in (("iters", iters), ("warmup", warmup)) if v is not None}
        seconds = mod.time_collective(clock.work, torch.zeros(4), clock=clock, **given)
        out.append((seconds, clock.calls))
    # the default clock (time.perf_counter): no value to expect, but every rank must report the same one
    out.append(mod.time_collective(lambda tensor: None, torch.zeros(4), iters=2, warmup=0))
    return out


def test_1_3_time_collective_reports_the_slowest_rank(grade):
    results = run_world(_timing_rank, 3, args=(grade("1.3"),))
    real = [calls_of_rank[-1] for calls_of_rank in results]
    assert len(set(real)) == 1 and math.isfinite(real[0]) and real[0] >= 0, (
        f"time_collective with its default clock returned {real} on ranks 0..2: every rank must return the same "
        "number (the slowest rank's seconds per call), finite and >= 0")
    for rank, calls_of_rank in enumerate(results):
        for (iters, warmup), (seconds, calls) in zip(TIMING_CALLS, calls_of_rank):
            what = f"rank {rank}, time_collective(iters={iters}, warmup={warmup})"
            if iters is None:
                what = f"rank {rank}, time_collective(fn, tensor, clock=clock) (iters and warmup left to their defaults)"
                iters, warmup = DEFAULT_ITERS, DEFAULT_WARMUP
            assert calls == iters + warmup, f"{what}: fn ran {calls} times, expected warmup + iters = {warmup + iters}"
            assert seconds == pytest.approx(3e-3), (
                f"{what} reported {seconds * 1e3:.4g} ms per call; the slowest rank takes 3 ms per timed "
                "call (warmup excluded), and every rank must report that maximum")


class MeetingClock:
    """Simulated time on one rank: `work` advances it by `step`, and every collective ends,
    on every rank, when the last rank reached it (the clocks meet at their maximum), as
    real collectives do. A rank that arrives late makes the others wait."""

    def __init__(self, step: float, start: float, all_reduce):
        self.now, self.step, self._all_reduce = start, step, all_reduce

    def __call__(self) -> float:
        return self.now

    def meet(self, call=None) -> None:
        t = torch.tensor([self.now], dtype=torch.float64)
        self._all_reduce(t, op=dist.ReduceOp.MAX)
        self.now = t.item()

    def work(self, tensor) -> None:
        self.now += self.step
        self.meet()


def _late_rank_timing(ref: grading.ModuleRef):
    mod = ref.load()
    rank = dist.get_rank()
    # rank r takes (r+1) ms per call; rank 2 reaches time_collective 50 ms after the others
    clock = MeetingClock(step=1e-3 * (rank + 1), start=0.05 if rank == 2 else 0.0, all_reduce=dist.all_reduce)
    with CollectiveLog(names=[*CollectiveLog().names_watched, "monitored_barrier"], on_call=clock.meet, also_in=(mod,)):
        return mod.time_collective(clock.work, torch.zeros(4), iters=4, warmup=0, clock=clock)


def test_1_3_time_collective_starts_the_clock_together(grade):
    results = run_world(_late_rank_timing, 3, args=(grade("1.3"),))
    for rank, seconds in enumerate(results):
        assert seconds == pytest.approx(3e-3), (
            f"rank {rank} reported {seconds * 1e3:.4g} ms per call; every call takes 3 ms (the slowest rank's), "
            "but rank 2 arrived 50 ms late: the ranks that waited for it counted the wait. Start the clock "
            "after all ranks have met (a barrier), not before")


class _LooksLikeCuda(torch.Tensor):
    """A CPU tensor that says it lives on a GPU, to see whether the timer waits for the device."""

    @property
    def is_cuda(self):
        return True

    @property
    def device(self):
        return torch.device("cuda", 0)


class _CudaOnCpu(TorchFunctionMode):
    """Tensors asked for on "cuda" are made on the CPU (there is no GPU here)."""

    @staticmethod
    def _cpu(value):
        if isinstance(value, (torch.device, str)) and str(value).startswith("cuda"):
            return torch.device("cpu")
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.device:
            return func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") == "cuda":  # tensor.cuda()
            return args[0]
        args = tuple(self._cpu(a) for a in args)
        kwargs = {k: self._cpu(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


def _device_timing_rank(ref: grading.ModuleRef):
    mod = ref.load()
    events = []

    def record(name):
        return lambda *args, **kwargs: events.append(name)

    class Stream:
        synchronize = staticmethod(record("synchronize"))

    def clock():
        events.append("clock")
        return float(len(events))

    fakes = {(torch.cuda, "synchronize"): record("synchronize"), (torch.accelerator, "synchronize"): record("synchronize"),
             (torch.cuda, "current_stream"): lambda *args, **kwargs: Stream(), (torch.cuda, "is_available"): lambda: True}
    saved = {key: getattr(*key) for key in fakes}
    tensor = torch.zeros(4).as_subclass(_LooksLikeCuda)
    try:
        for (module, name), fake in fakes.items():
            setattr(module, name, fake)
        with _CudaOnCpu():
            mod.time_collective(record("fn"), tensor, iters=3, warmup=1, clock=clock)
    finally:
        for (module, name), real in saved.items():
            setattr(module, name, real)
    return events


def test_1_3_time_collective_waits_for_the_device(grade):
    events = run_world(_device_timing_rank, 1, args=(grade("1.3"),))[0]
    assert "fn" in events and "clock" in events, f"time_collective must call fn and read the clock; events: {events}"
    last_call = len(events) - 1 - events[::-1].index("fn")
    after = events[last_call + 1:]
    assert "clock" in after, f"the clock must be read after the last timed call; events: {events}"
    assert "synchronize" in after[:after.index("clock")], (
        f"with a CUDA tensor, GPU work is asynchronous: wait for it (torch.cuda.synchronize()) after the last "
        f"timed call and before reading the clock. Order seen: {events}")
    first_clock = events.index("clock")
    before = events[:first_clock]
    warmup_done = len(before) - 1 - before[::-1].index("fn") if "fn" in before else -1
    assert "synchronize" in before[warmup_done + 1:], (
        f"the warm-up's GPU work must be finished before the clock starts (torch.cuda.synchronize() after the "
        f"warm-up calls, before the first clock reading), or the first timed interval holds it. Order seen: {events}")


def test_comm_bench_never_prints_a_negative_bandwidth():
    """Not graded (describe_fit is given, not an exercise): the reference's tables say
    'unreliable' where a fit's beta or alpha is negative, and print no bandwidth."""
    from solutions.phase1_data_parallel.comm_bench import describe_fit

    for alpha, beta in ((1e-5, -1e-9), (1e-5, 0.0), (-1e-5, 1e-9)):
        text = describe_fit(alpha, beta)
        assert "unreliable" in text and "GB/s" not in text, f"describe_fit({alpha}, {beta}) = {text!r}"
    assert "GB/s" in describe_fit(1e-5, 1e-9)


def test_comm_bench_rejects_bad_arguments():
    """Not graded (the checks are given code, outside the exercises): every ValueError the
    docstrings and guidelines 1.3 promise, on every documented kind of bad input."""
    mod = grading.reference("1.3")
    for sizes, seconds in (([1024.0, 2048.0], [1e-3]), ([1024.0], [1e-3]), ([1024.0, 1024.0], [1e-3, 2e-3]),
                           ([], []), ([1024.0, 2048.0], [1e-3, 0.0]), ([1024.0, 2048.0], [-1e-3, 1e-3])):
        with pytest.raises(ValueError):
            mod.fit_alpha_beta(sizes, seconds)
    for iters, warmup in ((0, 2), (-1, 0), (3, -1)):
        with pytest.raises(ValueError):
            mod.time_collective(lambda t: None, torch.zeros(1), iters=iters, warmup=warmup, clock=lambda: 0.0)
    for p in (0, -1):
        with pytest.raises(ValueError):
            mod.cost_terms("ring", p)
