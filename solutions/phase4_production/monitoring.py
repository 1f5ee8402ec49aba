"""4.5 Monitoring and profiling: where a step's time goes, how fast it runs, who is slow.

One rank's training loop, instrumented (every call below is cheap enough for every step):

    timer = StepTimer(device)
    stragglers = StragglerDetector(every=50)          # collective: every rank calls update()
    metrics = MetricsWriter("run/metrics.jsonl", rank)
    with training_profiler("run/traces", rank, wait=10, warmup=2, active=3) as prof:
        for step in range(steps):
            timer.start()
            with timer.phase("data"):
                x, y = next(batches)
            with timer.phase("forward"):
                loss = loss_fn(model(x), y)
            with timer.phase("backward"):
                loss.backward()
            with timer.phase("optimizer"):
                optimizer.step(); optimizer.zero_grad()
            times = timer.stop(samples=len(x))        # seconds; the parts sum to times["step"]
            report = stragglers.update(times)         # None, except every 50 steps
            metrics.write(step, **times, **memory_stats(device))
            prof.step()

Units: seconds, samples, bytes, FLOP (floating-point operations, one multiply-add = 2)
and FLOP/s. Nothing here prints: the trainer decides what to show.
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from common.distributed import current_device

PHASES = ("data", "forward", "backward", "comm", "optimizer")
"""The phases a step is split into; `StepTimer.stop` adds "other" (the rest) and "step"."""

# ------------------------------------------------------------------ step timer


def _profiling() -> bool:
    """Whether a torch.profiler is recording in this process (a private query; torch 2.14.1 has it)."""
    enabled = getattr(torch._C._autograd, "_profiler_enabled", None)
    return enabled() if enabled is not None else True


class StepTimer:
    """The time of one training step, split into phases that sum to it exactly.

        timer.start(); with timer.phase("forward"): ...; times = timer.stop(samples=32)
        times == {"data": s, "forward": s, "backward": s, "comm": s, "optimizer": s,
                  "other": s, "step": s, "samples": 32, "samples_per_s": 32 / step}

    "step" runs from start() to stop(); each phase is the sum of its `phase()` blocks
    (a phase may be entered several times, phases may not nest); "other" is what no phase
    covered (step - sum of phases), so the parts always add up to "step".

    On a CUDA device kernels run asynchronously: a host clock read right after a launch
    sees the launch, not the work. The contract on CUDA: time with CUDA events
    (torch.cuda.Event(enable_timing=True): record(), synchronize(), query(),
    elapsed_time()) read after a synchronisation, or synchronise
    (torch.cuda.synchronize(), torch.cuda.current_stream().synchronize()) before every
    read of the host clock. stop() waits for the device once, so a timed step costs one
    synchronisation. On CPU: time.perf_counter().

    Communication inside DDP's backward overlaps the backward: only its exposed part costs
    time, the wait after this rank's last gradient is ready (for the last buckets, and for
    slower ranks). Split it off with mark() and add_span() (the production trainer marks the
    last gradient with a post-accumulate-grad hook). Bracket explicit collectives (a manual
    gradient all-reduce, a loss all-reduce) with phase("comm").
    """

    def __init__(self, device: torch.device | str | None = None, phases: tuple[str, ...] = PHASES):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.phases = tuple(phases)
        self.on_cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._begin: Any = None
        self._spans: list[tuple[str, Any, Any]] = []
        self._open: str | None = None

    def _mark(self) -> Any:
        """A point in time on the device's timeline, for `_seconds`."""
        # EXERCISE 4.5: on CUDA a recorded torch.cuda.Event(enable_timing=True), never a bare host clock; on CPU time.perf_counter()
        if self.on_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()
        # END EXERCISE

    def _seconds(self, begin: Any, end: Any) -> float:
        """Seconds from mark `begin` to mark `end`; called by stop() after the device finished."""
        # EXERCISE 4.5: the time between two of _mark's marks, in seconds (Event.elapsed_time is in milliseconds)
        if self.on_cuda:
            return begin.elapsed_time(end) / 1e3
        return end - begin
        # END EXERCISE

    def mark(self) -> Any:
        """A point on the device's timeline, for add_span (a CUDA event, or a host clock)."""
        return self._mark()

    def add_span(self, name: str, begin: Any, end: Any) -> None:
        """Count the time from mark `begin` to mark `end` as phase `name`: for a phase that
        ends inside one call (DDP's backward: compute, then the wait for the all-reduce)."""
        if name not in self.phases:
            raise ValueError(f"unknown phase {name!r}; the phases are {self.phases}")
        if self._begin is None or self._open is not None:
            raise RuntimeError("StepTimer.add_span() outside a step, or inside a phase")
        self._spans.append((name, begin, end))

    def start(self) -> None:
        """Begin a step (before the data is fetched: waiting for data is part of the step)."""
        self._spans, self._open = [], None
        self._begin = self._mark()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the block's time as `name`; also a span of that name in profiler traces."""
        if name not in self.phases:
            raise ValueError(f"unknown phase {name!r}; the phases are {self.phases}")
        if self._begin is None:
            raise RuntimeError("StepTimer.phase() outside a step: call start() first")
        if self._open is not None:
            raise RuntimeError(f"phase {name!r} inside phase {self._open!r}: phases may not nest "
                               "(nested time would be counted twice)")
        self._open = name
        begin = self._mark()
        # a profiler span only while a profiler records: record_function costs ~10 us even when idle
        span = torch.profiler.record_function(name) if _profiling() else nullcontext()
        try:
            with span:
                yield
        finally:
            self._spans.append((name, begin, self._mark()))
            self._open = None

    def stop(self, samples: int = 0) -> dict[str, float]:
        """End the step; return its breakdown (see the class docstring)."""
        if self._begin is None:
            raise RuntimeError("StepTimer.stop() without start()")
        # EXERCISE 4.5: wait for the device, then step = begin..end, each phase = the sum of its spans, other = the rest
        end = self._mark()
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
        step = self._seconds(self._begin, end)
        times = {name: 0.0 for name in self.phases}
        for name, begin, finish in self._spans:
            times[name] += self._seconds(begin, finish)
        times["other"] = step - sum(times[name] for name in self.phases)
        times["step"] = step
        # END EXERCISE
        self._begin = None
        times["samples"] = samples
        times["samples_per_s"] = samples / step if step > 0 else 0.0
        return times


# ------------------------------------------------------ throughput and MFU

# FLOP of one training step (forward + backward) per 224x224 image, counted with
# training_flops() (torch.utils.flop_counter.FlopCounterMode, torch 2.14.1, torchvision 0.29.1;
# for ViT the attention as counted for the GPU kernels: guidelines 4.5, MFU).
FLOPS_PER_SAMPLE = {
    "resnet50": 24.30e9,   # forward 8.18e9 (torchvision lists 4.09 "GFLOPS": multiply-adds)
    "vit_b_16": 105.87e9,  # forward 35.13e9, attention included; 6 * params * 197 tokens ~ 101e9 omits it
}

# Dense (no 2:4 sparsity) bf16 tensor-core peak per GPU, FLOP/s, from NVIDIA's datasheets
# (they print the sparse figure, twice these). First match wins: specific names first.
PEAK_BF16_FLOPS = (
    (("H100", "PCIE"), 756e12),
    (("H100", "NVL"), 835e12),
    (("H100",), 989e12),          # SXM5 ("NVIDIA H100 80GB HBM3")
    (("H200", "NVL"), 835e12),
    (("H200",), 989e12),          # SXM
    (("GH200",), 989e12),
    (("A100",), 312e12),          # SXM4 and PCIe
    (("L40S",), 362e12),
    (("L40",), 181e12),
    (("L4",), 121e12),
    (("A10G",), 70e12),
    (("A10",), 125e12),
)


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU named like torch.cuda.get_device_name() returns
    ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"); None for a GPU not in the table.
    The row used is the first of PEAK_BF16_FLOPS whose every part is a whole token of the
    name, ignoring case; tokens are the runs of letters and digits ("A100-SXM4-40GB":
    A100, SXM4, 40GB), so "L4" does not match "NVIDIA L40" nor "H200" "NVIDIA GH200"."""
    # EXERCISE 4.5: the first row of PEAK_BF16_FLOPS each part of which is a whole token of the name (letters, digits, any case); re.findall
    tokens = set(re.findall(r"[A-Z0-9]+", device_name.upper()))
    for parts, flops in PEAK_BF16_FLOPS:
        if all(part.upper() in tokens for part in parts):
            return flops
    return None
    # END EXERCISE


def mfu(samples_per_s: float, flops_per_sample: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s / peak FLOP/s, in [0, 1] for honest inputs.
    Per rank: that rank's samples/s and one GPU's peak; global: the global samples/s and
    world_size * peak (the same ratio when the ranks are balanced)."""
    # EXERCISE 4.5: the useful FLOP per second the model did, over what the hardware could do
    return samples_per_s * flops_per_sample / peak_flops_per_s
    # END EXERCISE


def training_flops(model: torch.nn.Module, example: torch.Tensor) -> int:
    """FLOP of forward + backward of `model` on `example` (a batch of one, say), as
    FlopCounterMode counts them: matrix products, convolutions and attention (2 per
    multiply-add), not element-wise ops, norms or the optimizer."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(example).float().sum().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


# --------------------------------------------------------------- stragglers


class StragglerDetector:
    """Per-rank phase times gathered every `every` steps, each rank scored against the median.
    Each report covers its window only, the `every` steps since the previous report: the
    sums start again from zero after every report (means and rates below are per window).

        report = detector.update(times)   # times: StepTimer.stop()'s dict; collective
        report is None, except every `every`-th call:
        {"step": calls so far,
         "busy_s": [rank's mean busy seconds per step],   # busy = step - comm
         "scores": [busy_s[r] / median(busy_s)],
         "median_s": median(busy_s),
         "samples_per_s": all ranks' samples / the slowest rank's time (global),
         "rank_samples_per_s": [samples_r / time_r],
         "phases": {phase: [rank's mean seconds]},
         "stragglers": [{"rank", "host", "score", "busy_s", "excess_s", "phase"}]}

    A rank is a straggler when BOTH hold: busy_s > median * (1 + threshold) and busy_s -
    median > min_excess_s (the floor keeps scheduler noise on millisecond steps from naming
    anyone; the ratio keeps a small wobble of long steps from naming anyone). "phase" is the
    key of "phases" ("other" too, never "comm") where it lost the most time against the median.
    Busy time leaves out "comm": time in a collective is waiting for the slowest rank, so it is
    the others' slowness.
    The median, not the mean: one very slow rank drags the mean up and hides a second one.
    "host" is socket.gethostname() on that rank, gathered once at construction. On the hot
    path: one all_gather of a small float64 tensor every `every` steps.
    """

    def __init__(self, every: int = 50, threshold: float = 0.2, min_excess_s: float = 0.0,
                 phases: tuple[str, ...] = PHASES, group: dist.ProcessGroup | None = None,
                 device: torch.device | None = None):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every, self.threshold, self.min_excess_s = every, threshold, min_excess_s
        self.fields = (*phases, "other", "step", "samples")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.device = device if device is not None else current_device(group)
        self.hosts: list[str] = [""] * self.world_size
        dist.all_gather_object(self.hosts, socket.gethostname(), group=group)
        self._sums = torch.zeros(len(self.fields), dtype=torch.float64)
        self._calls = 0

    def update(self, times: dict[str, float]) -> dict[str, Any] | None:
        """Add one step's times; every `every` calls, gather and return the report."""
        self._sums += torch.tensor([float(times.get(f, 0.0)) for f in self.fields], dtype=torch.float64)
        self._calls += 1
        if self._calls % self.every:
            return None
        window, self._sums = self._sums.to(self.device), torch.zeros_like(self._sums)
        gathered = [torch.empty_like(window) for _ in range(self.world_size)]
        dist.all_gather(gathered, window, group=self.group)
        per_rank = torch.stack(gathered).cpu().tolist()  # [world][field], sums over the window
        return self._report(per_rank)

    def _report(self, per_rank: list[list[float]]) -> dict[str, Any]:
        col = {f: [row[i] for row in per_rank] for i, f in enumerate(self.fields)}
        comm = col.get("comm", [0.0] * len(per_rank))
        busy = [(s - c) / self.every for s, c in zip(col["step"], comm)]
        phases = {f: [v / self.every for v in col[f]] for f in self.fields if f not in ("step", "samples")}
        # EXERCISE 4.5: rank busy times against the median rank: name those past both thresholds (host, worst phase); global, per-rank samples/s
        median = statistics.median(busy)
        scores = [b / median if median > 0 else 1.0 for b in busy]
        stragglers = []
        for rank, b in enumerate(busy):
            if b > median * (1 + self.threshold) and b - median > self.min_excess_s:
                worst = max((f for f in phases if f != "comm"),
                            key=lambda f: phases[f][rank] - statistics.median(phases[f]))
                stragglers.append({"rank": rank, "host": self.hosts[rank], "score": scores[rank],
                                   "busy_s": b, "excess_s": b - median, "phase": worst})
        slowest = max(col["step"])  # the window's wall time: every rank waits for the slowest
        global_rate = sum(col["samples"]) / slowest if slowest > 0 else 0.0
        rank_rates = [n / s if s > 0 else 0.0 for n, s in zip(col["samples"], col["step"])]
        # END EXERCISE
        return {"step": self._calls, "busy_s": busy, "scores": scores, "median_s": median,
                "samples_per_s": global_rate, "rank_samples_per_s": rank_rates,
                "phases": phases, "stragglers": stragglers}


# ------------------------------------------------------------------- memory


def memory_stats(device: torch.device | str | None = None) -> dict[str, int]:
    """Peak memory of this process, in bytes. On a CUDA device, that device's (not the current
    one's): {"peak_allocated_bytes" (tensors), "peak_reserved_bytes" (the caching allocator's
    segments)} since the last torch.cuda.reset_peak_memory_stats; otherwise {"peak_rss_bytes"}
    (the high-water mark of the resident set, whole process, since this program started: on
    Linux VmHWM, which an exec starts afresh, unlike ru_maxrss; it does not drop when memory
    is freed, unlike the current resident set, VmRSS)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    # EXERCISE 4.5: torch.cuda.max_memory_allocated/reserved of `device` on CUDA; else the peak RSS in bytes (_peak_rss_bytes: VmHWM)
    if device.type == "cuda":
        return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    return {"peak_rss_bytes": _peak_rss_bytes()}
    # END EXERCISE


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as status:  # Linux: VmHWM, the high-water mark, in kB
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # POSIX; ru_maxrss is KiB on Linux, bytes on macOS

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


# ------------------------------------------------------------------ metrics


class MetricsWriter:
    """Metrics as JSON lines: one object per write(), {"rank", "step", "time", **fields}.

    `path` may hold "{rank}": one file per rank, the safe choice (lines that several
    processes append to one file are not guaranteed to stay whole on every file system). Values
    that are 0-d tensors become numbers. With `tensorboard_dir`, numeric fields also go to
    TensorBoard as scalars, SummaryWriter(log_dir=tensorboard_dir).add_scalar(tag, value, step)
    of torch.utils.tensorboard, when the `tensorboard` package is installed (a warning, once, when
    it is not), tagged `<event>/<field>` when the record has an `event` field (`train/loss`,
    `eval/accuracy`, `checkpoint/seconds`: one chart per kind of record, so a save's seconds
    never share a chart with a step's), else `<field>`; on ranks other than 0, `/rank<rank>`
    is appended.
    """

    def __init__(self, path: str | os.PathLike, rank: int | None = None,
                 tensorboard_dir: str | os.PathLike | None = None):
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        self.path = Path(str(path).format(rank=rank))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self._board = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                warnings.warn("tensorboard is not installed: metrics go to JSON lines only "
                              "(pip install tensorboard)", stacklevel=2)
            else:
                self._board = SummaryWriter(log_dir=str(tensorboard_dir))

    def write(self, step: int, **fields: Any) -> dict[str, Any]:
        """Append one line; return the object written."""
        # EXERCISE 4.5: one JSON object per line with rank, step, time and the fields (tensors as numbers); numeric fields to TensorBoard too
        record = {"rank": self.rank, "step": int(step), "time": time.time()}
        for key, value in fields.items():
            record[key] = value.item() if isinstance(value, torch.Tensor) else value
        self._file.write(json.dumps(record) + "\n")
        if self._board is not None:
            prefix = f"{record['event']}/" if isinstance(record.get("event"), str) else ""
            suffix = f"/rank{self.rank}" if self.rank else ""
            for key, value in record.items():
                if key not in ("rank", "step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._board.add_scalar(f"{prefix}{key}{suffix}", value, int(step))
        return record
        # END EXERCISE

    def close(self) -> None:
        self._file.close()
        if self._board is not None:
            self._board.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------- profiler


def training_profiler(folder: str | os.PathLike, rank: int = 0, wait: int = 10, warmup: int = 2,
                      active: int = 3, repeat: int = 1) -> torch.profiler.profile:
    """A torch.profiler.profile that records `active` steps after `wait` skipped and
    `warmup` (recorded, discarded) ones, `repeat` times (0: until the end), and writes
    each recorded cycle to `folder` as a Chrome/Perfetto trace of its own,
    rank<rank>.<time_ns>.pt.trace.json (one file per cycle and per rank: a later cycle,
    or another rank writing to the same folder, never overwrites one). Call prof.step() at the end of every training
    step (the steps appear as ProfilerStep#<n> spans). CPU activity, plus CUDA when
    available."""
    # EXERCISE 4.5: torch.profiler.profile with a schedule(wait, warmup, active, repeat) and an on_trace_ready that writes the trace
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=repeat),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(folder), worker_name=f"rank{rank}"),
    )
    # END EXERCISE
