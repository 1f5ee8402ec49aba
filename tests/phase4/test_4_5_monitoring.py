"""Graded tests of exercise 4.5, monitoring and profiling (phase4_production/guidelines.md, section 4.5).

Run them with `python tests/test_phase4.py -k 4_5` (your code) or
`pytest tests/test_phase4.py -k 4_5` (the reference); tests/test_phase4.py collects them.

No test here asserts how long anything took on this machine. Step-time breakdowns run on
a fake clock (and a fake CUDA device whose kernels take a known time on a fake stream), so
the expected times are exact; the straggler test injects a delay on chosen ranks, much
longer than a step, and asserts WHO is named, never how long; the straggler rule's two
thresholds and its windows are checked on given step times (no clock at all).
"""

from __future__ import annotations

import functools
import glob
import gzip
import json
import math
import os
import socket
import statistics
import sys
import time
import types
import warnings

import pytest
import torch
import torch.distributed as dist

import grading
from compare import assert_no_problems
from common.launch import run_world

PHASE_NAMES = ("data", "forward", "backward", "comm", "optimizer")

# ------------------------------------------------------------ a fake clock and GPU


class FakeGPU:
    """A host clock that moves only when told, and one CUDA stream that runs launched
    "kernels" asynchronously: launch() returns at once (the host clock barely moves) and
    the kernel ends `seconds` after the stream's previous work. Synchronising moves the
    host clock to the stream's end, as a real cudaDeviceSynchronize waits for it."""

    LAUNCH_S = 1e-6

    def __init__(self) -> None:
        self.host = 1000.0
        self.stream_end = 1000.0

    def host_work(self, seconds: float) -> None:  # CPU-side work, e.g. a slow data loader
        self.host += seconds

    def launch(self, seconds: float) -> None:
        self.stream_end = max(self.host, self.stream_end) + seconds
        self.host += self.LAUNCH_S

    def synchronize(self, *args, **kwargs) -> None:
        self.host = max(self.host, self.stream_end)


def _install_fake_clock(monkeypatch, gpu: FakeGPU, module) -> None:
    """Every host clock a timer might read (time.perf_counter, monotonic, time and their
    _ns forms, also where the graded module imported them by name) reads gpu.host."""
    seconds, nanos = (lambda: gpu.host), (lambda: int(round(gpu.host * 1e9)))
    for name in ("perf_counter", "monotonic", "time"):
        original = getattr(time, name)
        original_ns = getattr(time, name + "_ns")
        monkeypatch.setattr(time, name, seconds)
        monkeypatch.setattr(time, name + "_ns", nanos)
        for attr, value in list(vars(module).items()):
            if value is original:
                monkeypatch.setattr(module, attr, seconds)
            elif value is original_ns:
                monkeypatch.setattr(module, attr, nanos)


def _install_fake_cuda(monkeypatch, gpu: FakeGPU) -> None:
    """torch.cuda as a timer on CUDA may use it (StepTimer's docstring): Event(enable_timing=True)
    with record/synchronize/query/elapsed_time, synchronize(), current_stream().synchronize()."""

    class FakeEvent:
        def __init__(self, enable_timing: bool = False, **kwargs) -> None:
            if not enable_timing:
                raise RuntimeError("fake CUDA: an Event made without enable_timing=True cannot be timed")
            self.t = None

        def record(self, stream=None) -> None:  # the GPU reaches the event after the queued work
            self.t = max(gpu.host, gpu.stream_end)

        def query(self) -> bool:
            return self.t is not None and self.t <= gpu.host

        def synchronize(self) -> None:
            gpu.host = max(gpu.host, self.t)

        def wait(self, stream=None) -> None:
            pass

        def elapsed_time(self, end: "FakeEvent") -> float:
            if self.t is None or end.t is None:
                raise RuntimeError("fake CUDA: elapsed_time between events that were never recorded")
            if not (self.query() and end.query()):
                raise RuntimeError("fake CUDA: both events must be completed before calculating elapsed time "
                                   "(cudaErrorNotReady): synchronise first")
            return (end.t - self.t) * 1e3

    class FakeStream:
        def synchronize(self) -> None:
            gpu.synchronize()

        def record_event(self, event=None):
            event = event or FakeEvent(enable_timing=True)
            event.record(self)
            return event

        def wait_stream(self, other) -> None:
            pass

    stream = FakeStream()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", gpu.synchronize)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: stream)


# One step: (where, seconds). "outside" is host work in no phase; a GPU phase launches a kernel.
STEP_PLAN = [("outside", 0.002), ("data", 0.030), ("forward", 0.040), ("backward", 0.080),
             ("comm", 0.015), ("comm", 0.005), ("optimizer", 0.010), ("outside", 0.001)]


def _run_planned_step(timer, gpu: FakeGPU, on_gpu: bool, samples: int = 8) -> dict:
    timer.start()
    for where, seconds in STEP_PLAN:
        if where == "outside":
            gpu.host_work(seconds)
            continue
        with timer.phase(where):
            if where == "data" or not on_gpu:
                gpu.host_work(seconds)  # the loader (and, on CPU, compute) keeps the host busy
            else:
                gpu.launch(seconds)
    return timer.stop(samples=samples)


def _expected_times(overlapped: bool = False) -> dict:
    """overlapped: the last host work ran while the device still worked through its queue
    (events); without overlap (a timer that synchronises at every mark) it adds to the step."""
    expected = {name: 0.0 for name in PHASE_NAMES}
    for where, seconds in STEP_PLAN:
        if where != "outside":
            expected[where] += seconds
    expected["step"] = sum(seconds for _, seconds in STEP_PLAN)
    if overlapped:
        expected["step"] -= STEP_PLAN[-1][1]
    expected["other"] = expected["step"] - sum(expected[name] for name in PHASE_NAMES)
    return expected


def _breakdown_problems(times: dict, expected: dict, what: str, tol: float) -> list[str]:
    problems = []
    for key in (*PHASE_NAMES, "other", "step"):
        if key not in times:
            problems.append(f"{what}: no {key!r} in the times returned by stop() (keys {sorted(times)})")
        elif not math.isclose(times[key], expected[key], rel_tol=0, abs_tol=tol):
            problems.append(f"{what}: {key!r} = {times[key] * 1e3:.3f} ms, expected {expected[key] * 1e3:.3f} ms")
    if all(key in times for key in (*PHASE_NAMES, "other", "step")):
        total = sum(times[key] for key in (*PHASE_NAMES, "other"))
        if not math.isclose(total, times["step"], rel_tol=1e-9, abs_tol=1e-12):
            problems.append(f"{what}: the parts sum to {total * 1e3:.6f} ms but the step took "
                            f"{times['step'] * 1e3:.6f} ms (a gap or a double count)")
    return problems


def _timed_cpu_step(timer, model, opt) -> dict:
    """One real training step of `model` on a random batch of 8, timed phase by phase;
    returns timer.stop()'s breakdown."""
    timer.start()
    with timer.phase("data"):
        x = torch.randn(8, 16)
    with timer.phase("forward"):
        loss = model(x).square().mean()
    with timer.phase("backward"):
        loss.backward()
    with timer.phase("optimizer"):
        opt.step()
        opt.zero_grad()
    return timer.stop(samples=8)


def test_4_5_breakdown_sums_to_the_step(grade, monkeypatch):
    mod = grade("4.5").load()
    problems = []
    # 1) real clock, real model on CPU: the parts sum to the step, none negative.
    model, timer = torch.nn.Linear(16, 4), mod.StepTimer("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        times = _timed_cpu_step(timer, model, opt)
        total = sum(times[key] for key in (*PHASE_NAMES, "other"))
        if not math.isclose(total, times["step"], rel_tol=1e-9, abs_tol=1e-12):
            problems.append(f"real CPU step {step}: parts sum to {total:.9f} s, the step took {times['step']:.9f} s")
        negative = [key for key in (*PHASE_NAMES, "step") if times[key] < 0] + \
                   (["other"] if times["other"] < -1e-6 * max(times["step"], 1e-9) else [])
        if negative:
            problems.append(f"real CPU step {step}: negative times for {negative}: {times}")
    # a step in which no phase was entered: all of it is "other"
    timer.start()
    times = timer.stop()
    if any(times[key] != 0 for key in PHASE_NAMES) or not math.isclose(times["other"], times["step"], rel_tol=1e-9,
                                                                       abs_tol=1e-12):
        problems.append(f"a step with no phase entered: {times}; every phase 0 and 'other' the whole step")
    # 2) fake clock: a slow loader is data wait; host work outside any phase is "other".
    gpu = FakeGPU()
    _install_fake_clock(monkeypatch, gpu, mod)
    timer = mod.StepTimer("cpu")
    expected = _expected_times()
    for step in range(2):
        times = _run_planned_step(timer, gpu, on_gpu=False)
        problems += _breakdown_problems(times, expected, f"CPU step {step} (fake clock)", tol=1e-6)
        if "samples_per_s" in times and not math.isclose(times["samples_per_s"], 8 / expected["step"], rel_tol=1e-4):
            problems.append(f"CPU step {step}: samples_per_s = {times['samples_per_s']:.3f}, expected 8 samples / "
                            f"{expected['step']:.3f} s = {8 / expected['step']:.3f}")
    assert_no_problems(problems, "StepTimer's breakdown (phases in ms; a 30 ms loader, comm entered twice, "
                                 "3 ms of work in no phase):")


def test_4_5_gpu_time_is_measured_on_the_device(grade, monkeypatch):
    """On a (fake) CUDA device kernels are queued: a host clock around a launch sees ~0."""
    mod = grade("4.5").load()
    gpu = FakeGPU()
    _install_fake_clock(monkeypatch, gpu, mod)
    _install_fake_cuda(monkeypatch, gpu)
    timer = mod.StepTimer(torch.device("cuda", 0))
    problems = []
    for step in range(2):
        times = _run_planned_step(timer, gpu, on_gpu=True)
        problems += min((_breakdown_problems(times, _expected_times(overlapped), f"CUDA step {step}", tol=1e-4)
                         for overlapped in (True, False)), key=len)
        if gpu.host < gpu.stream_end:
            problems.append(f"CUDA step {step}: stop() returned before the device finished the step's work")
    assert_no_problems(problems, "StepTimer on a CUDA device whose kernels run asynchronously (forward 40 ms, "
                                 "backward 80 ms, ... queued on the stream; launches return at once): time with "
                                 "CUDA events, or synchronise before reading a host clock:")


# --------------------------------------------------------------------- stragglers

WINDOW = 2  # steps per straggler report
# name -> (delay per step for some ranks, threshold, min_excess_s); a world of 4 ranks on hosts node0, node1
SCENARIOS = {
    "nobody slow": ({}, 0.5, 0.1),
    "rank 2 slow": ({2: 0.25}, 0.5, 0.1),
    "ranks 1 and 3 slow": ({1: 0.25, 3: 0.9}, 0.5, 0.05),  # rank 3 drags a mean above rank 1
}


def _host_of(rank: int) -> str:
    return f"node{rank // 2}"


def _straggler_rank(ref: grading.ModuleRef):
    mod = ref.load()
    rank = dist.get_rank()
    fake_host = _host_of(rank)
    socket.gethostname = lambda: fake_host  # this process only: ranks 0,1 on node0, ranks 2,3 on node1
    for attr, value in list(vars(mod).items()):
        if getattr(value, "__name__", None) == "gethostname" and callable(value):
            setattr(mod, attr, socket.gethostname)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    timer = mod.StepTimer("cpu")

    def train_step(delay: float, batch: int, data_delay: float = 0.0) -> dict:
        timer.start()
        with timer.phase("data"):
            if data_delay:
                time.sleep(data_delay)  # a slow loader on every rank: the largest phase, but nobody's excess
            x = torch.randn(batch, 8)
        with timer.phase("forward"):
            if delay:
                time.sleep(delay)  # the injected slowness: this rank's forward is slow
            loss = model(x).square().mean()
        with timer.phase("backward"):
            loss.backward()
        with timer.phase("comm"):
            for p in model.parameters():
                dist.all_reduce(p.grad)
        with timer.phase("optimizer"):
            opt.step()
            opt.zero_grad()
        return timer.stop(samples=batch)

    train_step(0.0, 4)  # warm-up, not reported
    out = {}
    for name, (delays, threshold, min_excess) in SCENARIOS.items():
        detector = mod.StragglerDetector(every=WINDOW, threshold=threshold, min_excess_s=min_excess)
        steps, reports = [], []
        for i in range(WINDOW):
            times = train_step(delays.get(rank, 0.0), batch=4 + rank)
            steps.append({k: times[k] for k in ("step", "comm", "samples")})
            reports.append(detector.update(times))
        out[name] = (steps, reports)
    detector = mod.StragglerDetector(every=WINDOW, threshold=0.2, min_excess_s=0.05)
    reports = [detector.update(train_step(_PHASE_DELAY if rank == _PHASE_RANK else 0.0, 4, _DATA_DELAY))
               for _ in range(WINDOW)]
    out["phase"] = reports[-1]
    # Given times (no clock): the rule's two thresholds one at a time, and consecutive windows.
    out["rules"] = {}
    for name, (busy, _) in _RULE_CASES.items():
        detector = mod.StragglerDetector(every=1, threshold=_RULE_THRESHOLD, min_excess_s=_RULE_MIN_EXCESS_S)
        out["rules"][name] = detector.update(_given_times(busy[rank], samples=4))
    detector = mod.StragglerDetector(every=WINDOW, threshold=_RULE_THRESHOLD, min_excess_s=_RULE_MIN_EXCESS_S)
    out["windows"] = [detector.update(_given_times(busy[rank], samples)) for busy, samples in _WINDOW_STEPS]
    times = _given_times(_OTHER_BUSY_S, samples=4)
    if rank == _OTHER_RANK:  # its excess is in no phase: "other"
        times.update(forward=_OTHER_BUSY_S + _OTHER_FORWARD_S, other=_OTHER_S,
                     step=times["step"] + _OTHER_FORWARD_S + _OTHER_S)
    detector = mod.StragglerDetector(every=1, threshold=_RULE_THRESHOLD, min_excess_s=_RULE_MIN_EXCESS_S)
    out["other"] = detector.update(times)
    return out


# StragglerDetector's rule: busy > median * (1 + threshold) AND busy - median > min_excess_s.
_RULE_THRESHOLD, _RULE_MIN_EXCESS_S = 0.5, 0.1
_RULE_CASES = {  # name -> (busy seconds per step of ranks 0..3, the ranks to name)
    "ratio passes, excess does not": ([0.1, 0.18, 0.1, 0.1], []),  # 1.8x the median, but only 0.08 s more
    "excess passes, ratio does not": ([1.0, 1.0, 1.3, 1.0], []),  # 0.3 s more, but only 1.3x
    "both pass": ([0.2, 0.2, 0.2, 0.5], [3]),  # 2.5x and 0.3 s more
    "neither passes": ([1.0, 1.05, 1.0, 1.0], []),
}
_GIVEN_COMM_S = 0.25  # every rank's time in the collective: waiting, never busy
# Two windows of WINDOW steps: rank 3 three times slower in the first, everyone equal (and
# twice the samples) in the second; each report is about its own window only.
_WINDOW_STEPS = [([1.0, 1.0, 1.0, 3.0], 4)] * WINDOW + [([1.0, 1.0, 1.0, 1.0], 8)] * WINDOW


def _given_times(busy: float, samples: int) -> dict:
    """A step as StepTimer.stop() reports it, with the busy time in "forward"."""
    times = {name: 0.0 for name in PHASE_NAMES}
    times.update(forward=busy, comm=_GIVEN_COMM_S, other=0.0, step=busy + _GIVEN_COMM_S, samples=samples)
    times["samples_per_s"] = samples / times["step"]
    return times


# Given times: rank _OTHER_RANK spends _OTHER_S outside every phase ("other") and _OTHER_FORWARD_S more in forward
# than the others, whose busy time is _OTHER_BUSY_S: it lost the most time in "other".
_OTHER_RANK, _OTHER_BUSY_S, _OTHER_S, _OTHER_FORWARD_S = 1, 0.5, 0.6, 0.2

# The phase test: "data" takes _DATA_DELAY on every rank (each rank's largest phase), rank
# _PHASE_RANK's forward _PHASE_DELAY more: it lost its time in "forward", not in "data".
_DATA_DELAY, _PHASE_DELAY, _PHASE_RANK = 0.3, 0.15, 2


@functools.lru_cache(maxsize=4)
def _straggler_world(ref: grading.ModuleRef):
    return run_world(_straggler_rank, 4, args=(ref,))


def _reports(results, name: str) -> list[dict]:
    problems = []
    for rank, per_rank in enumerate(results):
        _, reports = per_rank[name]
        if any(r is not None for r in reports[:-1]):
            problems.append(f"{name}: rank {rank} got a report before step {WINDOW} (every={WINDOW})")
        if not isinstance(reports[-1], dict):
            problems.append(f"{name}: rank {rank} got {reports[-1]!r} at step {WINDOW}, not a report (every={WINDOW})")
    assert_no_problems(problems)
    return [per_rank[name][1][-1] for per_rank in results]


def test_4_5_straggler_is_named_with_rank_and_host(grade):
    results = _straggler_world(grade("4.5"))
    problems = []
    for name, (delays, _, _) in SCENARIOS.items():
        for rank, report in enumerate(_reports(results, name)):
            named = sorted((s.get("rank"), s.get("host")) for s in report.get("stragglers", []))
            expected = sorted((r, _host_of(r)) for r in delays)
            if named != expected:
                problems.append(f"{name}: rank {rank}'s report names {named or 'nobody'} as (rank, host) of the "
                                f"stragglers, expected {expected or 'nobody'}")
    assert_no_problems(problems, "StragglerDetector in a world of 4 (ranks 0,1 on node0, ranks 2,3 on node1; a "
                                 "slow rank's forward sleeps; everyone then waits for it in the gradient all-reduce):")


def test_4_5_throughput_per_rank_and_global(grade):
    results = _straggler_world(grade("4.5"))
    problems = []
    for name in SCENARIOS:
        steps = [per_rank[name][0] for per_rank in results]
        samples = [sum(s["samples"] for s in rank_steps) for rank_steps in steps]
        seconds = [sum(s["step"] for s in rank_steps) for rank_steps in steps]
        expected_global = sum(samples) / max(seconds)
        expected_ranks = [n / s for n, s in zip(samples, seconds)]
        for rank, report in enumerate(_reports(results, name)):
            got = report.get("samples_per_s")
            if got is None or not math.isclose(got, expected_global, rel_tol=1e-6):
                problems.append(f"{name}: rank {rank}'s global samples_per_s = {got}, expected {expected_global:.3f} "
                                f"(all ranks' {sum(samples)} samples / the slowest rank's {max(seconds):.4f} s)")
            got_ranks = report.get("rank_samples_per_s")
            if got_ranks is None or len(got_ranks) != 4 or not all(
                    math.isclose(g, e, rel_tol=1e-6) for g, e in zip(got_ranks, expected_ranks)):
                problems.append(f"{name}: rank {rank}'s rank_samples_per_s = {got_ranks}, expected "
                                f"{[round(e, 3) for e in expected_ranks]} (each rank's samples / its own time)")
    assert_no_problems(problems, "throughput in the straggler reports (ranks process 4, 5, 6, 7 samples a step):")


# ------------------------------------------------------------------- MFU, memory


def test_4_5_mfu_and_peak_lookup(grade):
    mod = grade("4.5").load()
    problems = []
    names = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
             "NVIDIA H200": 989e12, "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-PCIE-40GB": 312e12,
             "NVIDIA L4": 121e12, "NVIDIA L40S": 362e12, "NVIDIA L40": 181e12, "NVIDIA A10": 125e12,
             "NVIDIA A10G": 70e12, "NVIDIA GH200 480GB": 989e12, "Tesla T4": None, "NVIDIA GeForce GTX 1080": None}
    for name, peak in names.items():
        got = mod.peak_flops(name)
        if (got is None) != (peak is None) or (peak is not None and not math.isclose(got, peak, rel_tol=0.02)):
            problems.append(f"peak_flops({name!r}) = {got}, expected {peak} (dense bf16, PEAK_BF16_FLOPS)")
    # Whole tokens: with rows whose parts are substrings of other GPUs' names, each name finds its own row.
    table = ((("H200",), 1.0), (("GH200",), 2.0), (("L4",), 3.0), (("L40",), 4.0), (("A100", "PCIE"), 5.0),
             (("A100",), 6.0))
    original = mod.PEAK_BF16_FLOPS
    try:
        mod.PEAK_BF16_FLOPS = table
        for name, want in (("NVIDIA GH200 480GB", 2.0), ("NVIDIA H200", 1.0), ("NVIDIA L40", 4.0), ("NVIDIA L4", 3.0),
                           ("nvidia l40", 4.0), ("NVIDIA A100-PCIE-40GB", 5.0), ("NVIDIA A100-SXM4-80GB", 6.0),
                           ("NVIDIA L40S", None), ("NVIDIA H20", None)):
            got = mod.peak_flops(name)
            if got != want:
                problems.append(f"with PEAK_BF16_FLOPS = {table}: peak_flops({name!r}) = {got}, expected {want} "
                                "(a part must be a whole token of the name: 'L4' is not in 'NVIDIA L40', 'H200' "
                                "not in 'NVIDIA GH200 480GB')")
    finally:
        mod.PEAK_BF16_FLOPS = original
    for rate, flops, peak in ((1000.0, 24.3e9, 989e12), (250.0, 101e9, 312e12), (1.0, 1.0, 4.0)):
        got, expected = mod.mfu(rate, flops, peak), rate * flops / peak
        if not math.isclose(got, expected, rel_tol=1e-9):
            problems.append(f"mfu({rate} samples/s, {flops:g} FLOP/sample, peak {peak:g} FLOP/s) = {got}, expected {expected}")
    assert_no_problems(problems, "MFU = samples/s * FLOP per sample / peak FLOP/s:")


def test_4_5_memory_stats(grade, monkeypatch):
    mod = grade("4.5").load()
    big = torch.ones(2**24)  # 64 MiB, touched
    got = mod.memory_stats("cpu").get("peak_rss_bytes")
    if sys.platform.startswith("linux"):
        with open("/proc/self/status") as status:
            truth = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    else:
        import resource
        truth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    default = mod.memory_stats().get("peak_rss_bytes")  # device left out: the current device, the CPU here
    del big
    if not torch.cuda.is_available():
        assert default is not None and math.isclose(default, truth, rel_tol=0.1), (
            f"memory_stats() (device left out, no GPU: the CPU) = {default}, expected peak_rss_bytes near {truth}")
    assert got is not None and math.isclose(got, truth, rel_tol=0.1), (
        f"memory_stats('cpu')['peak_rss_bytes'] = {got}, but this process's peak resident set is {truth} bytes "
        "(in bytes: ru_maxrss is in KiB on Linux)")
    _install_two_fake_gpus(monkeypatch)
    problems = []
    for device, index in ((torch.device("cuda", 0), 0), ("cuda:1", 1), (torch.device("cuda", 1), 1),
                          (torch.device("cuda"), _CURRENT_GPU)):
        got = mod.memory_stats(device)
        want = {"peak_allocated_bytes": _GPU_PEAKS[index][0], "peak_reserved_bytes": _GPU_PEAKS[index][1]}
        if {k: got.get(k) for k in want} != want:
            problems.append(f"memory_stats({device!r}) = {got}; expected cuda:{index}'s {want} (torch.cuda."
                            "max_memory_allocated / max_memory_reserved of that device)")
    assert_no_problems(problems, f"two (fake) GPUs, cuda:{_CURRENT_GPU} the current one, each with its own peaks "
                                 f"{_GPU_PEAKS}:")


_GPU_PEAKS = {0: (123 << 20, 456 << 20), 1: (789 << 20, 1011 << 20)}  # (allocated, reserved) per device
_CURRENT_GPU = 0


def _install_two_fake_gpus(monkeypatch) -> None:
    """torch.cuda's peak queries answer for two fake devices (None, an index, "cuda:i", a torch.device; "cuda" and
    None mean the current one), however they are asked: max_memory_allocated/reserved or memory_stats."""
    def index(device=None) -> int:
        if device is None or isinstance(device, int):
            return _CURRENT_GPU if device is None else device
        device = torch.device(device)
        return _CURRENT_GPU if device.index is None else device.index

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(_GPU_PEAKS))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: _CURRENT_GPU)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: _GPU_PEAKS[index(device)][0])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: _GPU_PEAKS[index(device)][1])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {
        "allocated_bytes.all.peak": _GPU_PEAKS[index(device)][0], "reserved_bytes.all.peak": _GPU_PEAKS[index(device)][1]})


def test_4_5_peak_rss_is_this_programs_high_water_mark(grade, monkeypatch):
    """On Linux the peak is VmHWM, this program's: ru_maxrss also keeps the peak of a program this process was
    exec'ed from (guidelines 4.5). getrusage here answers as it would after an exec from a program 4 GiB large."""
    if not sys.platform.startswith("linux"):
        pytest.skip("VmHWM is Linux's")
    import resource

    mod = grade("4.5").load()
    real = resource.getrusage

    def after_an_exec(who):
        usage = list(real(who))
        usage[2] = max(usage[2], 4 << 20)  # ru_maxrss, KiB: 4 GiB
        return resource.struct_rusage(usage)

    monkeypatch.setattr(resource, "getrusage", after_an_exec)
    got = mod.memory_stats("cpu").get("peak_rss_bytes")
    truth = _resident_kib("VmHWM") * 1024
    assert got is not None and math.isclose(got, truth, rel_tol=0.1), (
        f"memory_stats('cpu')['peak_rss_bytes'] = {got}, this program's peak resident set (VmHWM) is {truth} bytes; "
        "ru_maxrss reads 4 GiB here, as after an exec from a larger program: read VmHWM on Linux")


# ------------------------------------------------------------ metrics and traces


def test_4_5_json_lines_carry_rank_step_and_fields(grade, tmp_path):
    mod = grade("4.5").load()
    board = tmp_path / "board"
    with warnings.catch_warnings():  # "tensorboard is not installed" is fine: it is an optional extra
        warnings.simplefilter("ignore")
        writer = mod.MetricsWriter(tmp_path / "metrics_{rank}.jsonl", rank=3, tensorboard_dir=board)
    written = [dict(loss=torch.tensor(0.25), step_s=0.125, samples_per_s=512.0, phase="train"),
               dict(loss=torch.tensor(0.5), step_s=0.25, samples_per_s=256.0, phase="train")]
    for step, fields in zip((10, 11), written):
        writer.write(step, **fields)
    writer.close()
    path = tmp_path / "metrics_3.jsonl"
    assert path.exists(), f"no {path.name}: MetricsWriter must write to its path with {{rank}} filled in " \
                          f"(found {sorted(p.name for p in tmp_path.iterdir())})"
    lines = path.read_text().splitlines()
    assert len(lines) == 2, f"{path.name} holds {len(lines)} lines after 2 writes: one JSON object per line"
    problems = []
    for line, step, fields in zip(lines, (10, 11), written):
        try:
            record = json.loads(line)
        except ValueError as e:
            problems.append(f"line {line!r} is not JSON: {e}")
            continue
        expected = {"rank": 3, "step": step, "loss": fields["loss"].item(), "step_s": fields["step_s"],
                    "samples_per_s": fields["samples_per_s"], "phase": "train"}
        for key, value in expected.items():
            if record.get(key) != value:
                problems.append(f"step {step}: {key} = {record.get(key)!r} in the JSON line, expected {value!r}")
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        pass  # optional extra: without it, JSON lines only
    else:
        if not list(board.glob("**/events.out.tfevents.*")):
            problems.append(f"tensorboard is installed but {board} holds no event file")
    assert_no_problems(problems, "MetricsWriter's JSON lines:")


class _FakeSummaryWriter:
    """torch.utils.tensorboard.SummaryWriter, recording its scalars (the tensorboard package may be missing)."""

    def __init__(self, log_dir=None, *args, **kwargs):
        self.log_dir, self.scalars, self.closed = log_dir, [], False
        _FakeSummaryWriter.made.append(self)

    def add_scalar(self, tag, scalar_value, global_step=None, *args, **kwargs):
        self.scalars.append((tag, float(scalar_value), global_step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_4_5_tensorboard_tags_name_the_event_and_the_rank(grade, tmp_path, monkeypatch):
    """With a (fake) tensorboard installed, each numeric field is a scalar tagged `<event>/<field>` for a record with
    an `event` field, else `<field>`, with `/rank<r>` appended on ranks other than 0, at the record's step."""
    board = types.ModuleType("torch.utils.tensorboard")
    board.SummaryWriter, _FakeSummaryWriter.made = _FakeSummaryWriter, []
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", board)
    monkeypatch.setitem(sys.modules, "tensorboard", sys.modules.get("tensorboard") or types.ModuleType("tensorboard"))
    mod = grade("4.5").load()
    writes = [(7, dict(loss=torch.tensor(0.5), phase="train")), (8, dict(event="checkpoint", seconds=1.5, path="a")),
              (9, dict(event="train", loss=0.25, samples_per_s=512))]
    problems = []
    for rank in (0, 2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            writer = mod.MetricsWriter(tmp_path / f"m{rank}" / "metrics_{rank}.jsonl", rank=rank,
                                       tensorboard_dir=tmp_path / f"board{rank}")
        for step, fields in writes:
            writer.write(step, **fields)
        writer.close()
        suffix = f"/rank{rank}" if rank else ""
        want = {(f"loss{suffix}", 0.5, 7), (f"checkpoint/seconds{suffix}", 1.5, 8), (f"train/loss{suffix}", 0.25, 9),
                (f"train/samples_per_s{suffix}", 512.0, 9)}
        got = {scalar for w in _FakeSummaryWriter.made for scalar in w.scalars}
        _FakeSummaryWriter.made = []
        stray = [tag for tag, _, _ in got if tag not in {t for t, _, _ in want}
                 and any(name in tag for name in ("loss", "seconds", "samples_per_s"))]
        if not want <= got or stray:
            problems.append(f"rank {rank}: the scalars (tag, value, step) {sorted(got)}; expected {sorted(want)}")
    assert_no_problems(problems, "MetricsWriter's TensorBoard scalars, writes at steps 7 (loss, no event), 8 (event "
                                 "'checkpoint': seconds) and 9 (event 'train': loss, samples_per_s):")


def test_4_5_straggler_phase_is_where_it_lost_time(grade):
    results = _straggler_world(grade("4.5"))
    problems = []
    for rank, per_rank in enumerate(results):
        report = per_rank["phase"]
        if not isinstance(report, dict):
            problems.append(f"rank {rank} got {report!r} at step {WINDOW}, not a report (every={WINDOW})")
            continue
        found = {s.get("rank"): s.get("phase") for s in report.get("stragglers", [])}
        if set(found) != {_PHASE_RANK}:
            problems.append(f"rank {rank}'s report names ranks {sorted(found)} as stragglers, expected "
                            f"[{_PHASE_RANK}] (threshold 0.2, min_excess_s 0.05)")
        elif found[_PHASE_RANK] != "forward":
            problems.append(f"rank {rank}'s report gives the straggler's phase as {found[_PHASE_RANK]!r}; it lost its "
                            f"time in 'forward' ({_PHASE_DELAY} s more than the others), while 'data' ({_DATA_DELAY} s) "
                            "is as long on every rank")
    assert_no_problems(problems, "a straggler's \"phase\" is the phase where it lost the most time against the median "
                                 "rank, not its largest phase:")


def test_4_5_straggler_phase_can_be_other(grade):
    """Given times (no clock): a rank whose excess lies mostly in "other" (time no phase covered: logging, .item(),
    Python overhead) is named with phase "other", a part of the breakdown like any phase."""
    results = _straggler_world(grade("4.5"))
    problems = []
    for rank, per_rank in enumerate(results):
        report = per_rank["other"]
        if not isinstance(report, dict):
            problems.append(f"rank {rank} got {report!r} from update() with every=1, not a report")
            continue
        found = {s.get("rank"): s.get("phase") for s in report.get("stragglers", [])}
        if found != {_OTHER_RANK: "other"}:
            problems.append(f"rank {rank}'s report names (rank, phase) {sorted(found.items())}, expected "
                            f"[({_OTHER_RANK}, 'other')]")
    assert_no_problems(problems, f"rank {_OTHER_RANK} busy {_OTHER_BUSY_S + _OTHER_FORWARD_S + _OTHER_S:g} s a step: "
                                 f"{_OTHER_S} s in \"other\" and {_OTHER_FORWARD_S} s more in forward than the others "
                                 f"({_OTHER_BUSY_S} s busy); its phase is where it lost the most against the median:")


def test_4_5_straggler_needs_both_thresholds(grade):
    """Given step times (no clock): a rank is named only when BOTH hold, busy > median * (1 +
    threshold) and busy - median > min_excess_s; one of the two alone names nobody."""
    results = _straggler_world(grade("4.5"))
    problems = []
    for name, (busy, expected) in _RULE_CASES.items():
        for rank, per_rank in enumerate(results):
            report = per_rank["rules"][name]
            if not isinstance(report, dict):
                problems.append(f"{name}: rank {rank} got {report!r} from update() with every=1, not a report")
                continue
            named = sorted(s.get("rank") for s in report.get("stragglers", []))
            if named != expected:
                problems.append(f"{name}: busy seconds per step {busy}, median {statistics.median(busy)}: rank "
                                f"{rank}'s report names {named or 'nobody'}, expected {expected or 'nobody'}")
    assert_no_problems(problems, f"StragglerDetector(threshold={_RULE_THRESHOLD}, min_excess_s={_RULE_MIN_EXCESS_S}) "
                                 "names a rank only when busy > median * (1 + threshold) AND busy - median > "
                                 "min_excess_s:")


def test_4_5_straggler_report_covers_its_window_only(grade):
    """Two windows of WINDOW steps with given times: rank 3 three times slower in the first,
    every rank equal (with twice the samples) in the second. Each report holds the means and
    rates of its own window: the sums start again after each report."""
    results = _straggler_world(grade("4.5"))
    problems = []
    for index in range(2):
        steps = _WINDOW_STEPS[index * WINDOW:(index + 1) * WINDOW]
        busy = [sum(b[r] for b, _ in steps) / WINDOW for r in range(4)]
        seconds = [sum(b[r] + _GIVEN_COMM_S for b, _ in steps) for r in range(4)]
        samples = sum(n for _, n in steps)
        want = {"busy_s": busy, "rank_samples_per_s": [samples / t for t in seconds],
                "samples_per_s": 4 * samples / max(seconds), "forward": busy}
        named = [3] if index == 0 else []
        for rank, per_rank in enumerate(results):
            reports = per_rank["windows"]
            report = reports[(index + 1) * WINDOW - 1]
            what = f"window {index + 1} (steps {index * WINDOW + 1}..{(index + 1) * WINDOW}), rank {rank}'s report"
            if not isinstance(report, dict):
                problems.append(f"{what}: {report!r}, not a report (every={WINDOW})")
                continue
            got = {"busy_s": report.get("busy_s"), "rank_samples_per_s": report.get("rank_samples_per_s"),
                   "samples_per_s": report.get("samples_per_s"),
                   "forward": (report.get("phases") or {}).get("forward")}
            for key, value in want.items():
                values = value if isinstance(value, list) else [value]
                found = got[key] if isinstance(got[key], list) else [got[key]]
                if len(found) != len(values) or not all(
                        isinstance(g, (int, float)) and math.isclose(g, w, rel_tol=1e-9) for g, w in zip(found, values)):
                    problems.append(f"{what}: {key} = {got[key]}, expected {value} (this window's steps only)")
            names = sorted(s.get("rank") for s in report.get("stragglers", []))
            if names != named:
                problems.append(f"{what}: names {names or 'nobody'} as stragglers, expected {named or 'nobody'}")
    assert_no_problems(problems, f"StragglerDetector(every={WINDOW}), two consecutive windows of given step times "
                                 f"(busy seconds per step {[b for b, _ in _WINDOW_STEPS[::WINDOW]]}, samples "
                                 f"{[n for _, n in _WINDOW_STEPS[::WINDOW]]}, {_GIVEN_COMM_S} s of comm a step):")


def _resident_kib(field: str) -> int | None:
    """VmRSS / VmHWM of this process from /proc (Linux), in KiB."""
    try:
        with open("/proc/self/status") as status:
            return next((int(line.split()[1]) for line in status if line.startswith(field + ":")), None)
    except OSError:
        return None


def test_4_5_peak_rss_never_drops(grade):
    """A peak is a high-water mark: after a large buffer is freed (and the resident set
    shrinks), memory_stats must still report what it reported while the buffer was held
    (to within 8 MiB: Linux keeps RSS counters exact to a few pages only, so even VmHWM
    may read some KiB lower later), and at least the resident set of that moment."""
    mod = grade("4.5").load()
    size = 128 << 20
    big = torch.ones(size // 4)  # 128 MiB, every page touched
    rss_held = _resident_kib("VmRSS")
    held = mod.memory_stats("cpu").get("peak_rss_bytes")
    del big
    rss_freed = _resident_kib("VmRSS")
    freed = mod.memory_stats("cpu").get("peak_rss_bytes")
    problems = []
    if held is None or freed is None:
        problems.append(f"memory_stats('cpu') has no 'peak_rss_bytes' (got {held!r}, then {freed!r})")
    else:
        if held - freed > size // 16:  # the kernel's counters are exact to a few pages only, even VmHWM's
            problems.append(f"peak_rss_bytes dropped from {held} to {freed} bytes when a {size >> 20} MiB buffer was "
                            "freed: that is the current resident set (VmRSS), not its peak (VmHWM, or ru_maxrss)")
        if rss_held is not None and freed < rss_held * 1024 * 0.99:
            problems.append(f"peak_rss_bytes = {freed} after the buffer was freed, below the {rss_held * 1024} bytes "
                            "resident while it was held (/proc/self/status VmRSS)")
    if rss_held is not None and rss_freed is not None and not problems:
        assert rss_held - rss_freed > (size >> 10) // 2, (
            f"test setup: freeing {size >> 20} MiB did not shrink the resident set ({rss_held} KiB, then {rss_freed} "
            "KiB): the property cannot be observed here")
    assert_no_problems(problems, f"memory_stats('cpu') while a {size >> 20} MiB buffer is held, then after it is freed:")


def test_4_5_profiler_writes_one_trace_per_cycle(grade, tmp_path):
    """Cycles of (warmup=1, active=1) over 8 steps: rank 0 with repeat=3 writes three traces, one per cycle, each
    with its own recorded step; rank 1 with repeat=0 (until the end) four, the last cycle included; rank 1's
    profiler, writing to the same folder after rank 0's, leaves rank 0's three traces as they were."""
    mod = grade("4.5").load()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    timer = mod.StepTimer("cpu")
    folder = tmp_path / "traces"
    problems, written = [], {}

    def traces() -> dict[str, tuple]:
        return {f: (os.stat(f).st_ino, os.stat(f).st_size, os.stat(f).st_mtime_ns)
                for f in glob.glob(str(folder / "**" / "*.json*"), recursive=True)}

    repeats = {0: 3, 1: 0}
    for rank, repeat in repeats.items():
        before = traces()
        with mod.training_profiler(folder, rank=rank, wait=0, warmup=1, active=1, repeat=repeat) as prof:
            for _ in range(8):
                _timed_cpu_step(timer, model, opt)
                prof.step()
        after = traces()
        written[rank] = sorted(f for f, key in after.items() if before.get(f) != key)
        changed = sorted(os.path.relpath(f, folder) for f, key in before.items() if after.get(f) != key)
        if changed:
            problems.append(f"rank {rank}'s profiler overwrote or removed {changed}, written before it (by rank "
                            f"{rank - 1}): each rank's traces need names of their own")
        steps = sorted(tuple(_profiler_steps(f)) for f in written[rank])
        want = [(f"ProfilerStep#{n}",) for n in (1, 3, 5, 7)][:repeat or None]
        if steps != want:
            problems.append(f"rank {rank}: 8 steps with wait=0, warmup=1, active=1, repeat={repeat} left "
                            f"{len(written[rank])} new trace(s) {[os.path.relpath(f, folder) for f in written[rank]]} "
                            f"recording the steps {steps}; expected {len(want)} traces, one per cycle, recording {want} "
                            "(each cycle its own file: a name that repeats overwrites the earlier cycles"
                            + ("; repeat=0 cycles until the end)" if not repeat else ")"))
    assert_no_problems(problems, "training_profiler with repeat=3 for rank 0, then repeat=0 (until the end) for rank 1, "
                                 "in the same folder:")


def _profiler_steps(path: str) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    return sorted({e.get("name", "") for e in events if isinstance(e, dict)
                   and str(e.get("name", "")).startswith("ProfilerStep#")})


def test_4_5_profiler_trace_named_by_rank(grade, tmp_path):
    mod = grade("4.5").load()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    timer = mod.StepTimer("cpu")
    folder = tmp_path / "traces"
    with mod.training_profiler(folder, rank=3, wait=0, warmup=1, active=1, repeat=1) as prof:
        for _ in range(3):
            _timed_cpu_step(timer, model, opt)
            prof.step()
    files = sorted(os.path.relpath(f, folder) for f in glob.glob(str(folder / "**" / "*.json*"), recursive=True))
    assert files, f"training_profiler(rank=3) wrote no trace (.json) under {folder}"
    wrong = [f for f in files if not os.path.basename(f).startswith("rank3.")]
    assert not wrong, (f"training_profiler(rank=3) wrote {wrong}; the docstring names each trace "
                       "rank<rank>.<time_ns>.pt.trace.json, so that the traces of the ranks of one run can be "
                       "told apart (torch.profiler.tensorboard_trace_handler's worker_name)")


def test_4_5_profiler_trace_holds_the_scheduled_steps(grade, tmp_path):
    mod = grade("4.5").load()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    timer = mod.StepTimer("cpu")
    folder = tmp_path / "traces"
    with mod.training_profiler(folder, rank=1, wait=1, warmup=1, active=2, repeat=1) as prof:
        for _ in range(6):
            _timed_cpu_step(timer, model, opt)
            prof.step()
    files = sorted(glob.glob(str(folder / "**" / "*.json*"), recursive=True))
    assert len(files) == 1, (f"after 6 steps with wait=1, warmup=1, active=2, repeat=1 the profiler should have "
                             f"written one trace (a .json Chrome/Perfetto trace) under {folder}; found {files}")
    opener = gzip.open if files[0].endswith(".gz") else open
    with opener(files[0], "rt") as f:
        events = json.load(f)
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    names = {e.get("name", "") for e in events if isinstance(e, dict)}
    steps = sorted(n for n in names if n.startswith("ProfilerStep#"))
    problems = []
    if steps != ["ProfilerStep#2", "ProfilerStep#3"]:
        problems.append(f"the trace holds the spans {steps or 'no ProfilerStep#'}; the schedule (wait=1, warmup=1, "
                        "active=2) records steps 2 and 3 only")
    model_ops = names & {"aten::linear", "aten::addmm", "aten::mm", "aten::matmul"}
    if not model_ops:
        problems.append(f"the trace holds none of the model's matrix products (aten::linear/addmm/mm); "
                        f"{len(names)} span names, e.g. {sorted(names)[:8]}")
    assert_no_problems(problems, f"profiler trace {os.path.basename(files[0])}:")
