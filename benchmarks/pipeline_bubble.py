"""Pipeline bubble and activation memory: GPipe vs 1F1B, measured side by side.

    python benchmarks/pipeline_bubble.py                          # 4 ranks, m = 1, 2, 4, 8, 16
    python benchmarks/pipeline_bubble.py --simulate-ms 20         # sleeps instead of matmuls
    python benchmarks/pipeline_bubble.py --plot timeline.png      # measured timelines (matplotlib)

Every rank is one stage of the same model (equal Linear+Tanh layers per stage) and runs
the reference executor (exercise 2.6) on its row of each schedule, under a
common.measure.StageRecorder: it records when each forward/backward computed
(time.perf_counter(), waits excluded) and the bytes the stage holds for its micro-batches
(saved activations, outputs, send buffers alive). A stage's idle fraction is
1 - (its compute time) / (the whole step's wall-clock span, first rank in to last rank
out). Theory, with F and B equal on every stage: (p-1)/(m+p-1) for both schedules.
Memory: peak bytes held on stage 0, and that peak in units of what one forward leaves
held (GPipe: m, 1F1B: at most p, whatever m). Runs of GPipe and 1F1B are interleaved, and
the median of --repeats runs is kept.

Read the idle fractions with the machine in mind: with fewer free cores than ranks,
stages that should compute at the same time share a core, and with tiny layers the
transfer latency dominates; --simulate-ms replaces compute by sleeps, which measures the
schedule itself. On GPUs the executor's timestamps see kernel launches, not kernel
execution: use torch.profiler there.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run without installing; spawned ranks re-run this
    sys.path.insert(0, str(REPO_ROOT))

import os  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from common.distributed import current_device  # noqa: E402
from common.launch import exit_on_user_error, run_world  # noqa: E402
from common.measure import StageRecorder, render_timeline  # noqa: E402
from solutions.phase2_advanced.model_split import PipelineStage  # noqa: E402
from solutions.phase2_advanced.pipeline import (  # noqa: E402
    bubble_fraction, gpipe_schedule, max_in_flight, one_f_one_b_schedule, run_pipeline, time_grid)
from _util import OneLineParser, pyplot_or_none  # noqa: E402  (benchmarks/ is sys.path[0])

SCHEDULES = {"GPipe": gpipe_schedule, "1F1B": one_f_one_b_schedule}


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps `ms` and whose backward sleeps 2 * ms: a stand-in for compute
    that does not compete for CPU cores (so the schedule, not the machine, decides the timing)."""

    @staticmethod
    def forward(ctx, x, ms):
        ctx.ms = ms
        time.sleep(ms / 1000)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.ms / 1000)
        return grad, None


class SleepLayer(nn.Module):
    def __init__(self, ms: float):
        super().__init__()
        self.ms = ms
        self.scale = nn.Parameter(torch.ones(()))  # something to receive a gradient

    def forward(self, x):
        return _Sleep.apply(x * self.scale, self.ms)


def build_layers(num_stages: int, layers_per_stage: int, width: int, simulate_ms: float) -> list[nn.Module]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if simulate_ms > 0:
            return [SleepLayer(simulate_ms / layers_per_stage) for _ in range(num_stages * layers_per_stage)]
        layers: list[nn.Module] = []
        for _ in range(num_stages * layers_per_stage):
            layers += [nn.Linear(width, width), nn.Tanh()]
        return layers


def bench_rank(microbatch_counts: list[int], microbatch_size: int, width: int, layers_per_stage: int,
               repeats: int, simulate_ms: float) -> dict:
    """One stage per rank; returns this stage's measurements for every (schedule, m, repeat)."""
    torch.set_num_threads(1)  # ranks share the machine's cores
    rank, world = dist.get_rank(), dist.get_world_size()
    device = current_device()
    stage = PipelineStage(build_layers(world, layers_per_stage, width, simulate_ms), rank, world, device=device)
    gen = torch.Generator().manual_seed(rank)
    runs = []
    for m in microbatch_counts:
        inputs = [torch.randn(microbatch_size, width, generator=gen) for _ in range(m)] if rank == 0 else None
        targets = [torch.randn(microbatch_size, width, generator=gen) for _ in range(m)] if rank == world - 1 else None
        for repeat in range(repeats + 1):  # run 0 warms up (allocations, first messages) and is dropped
            for name, schedule_fn in SCHEDULES.items():
                actions = schedule_fn(world, m)[rank]
                stage.zero_grad(set_to_none=True)
                dist.barrier()
                with StageRecorder(stage, exclude=inputs or ()) as recorder:
                    start = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes of one machine
                    run_pipeline(actions, stage, inputs, targets, lambda out, y: (out - y).pow(2).mean())
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    stop = time.perf_counter()
                dist.barrier()
                if repeat:
                    trace = [(c.kind, j, c.start, c.end) for c, (_, j) in zip(recorder.computes, actions)]
                    runs.append({"schedule": name, "m": m, "repeat": repeat, "start": start, "stop": stop,
                                 "trace": trace, "peak_bytes": recorder.peak_bytes,
                                 "one_forward_bytes": recorder.held_after_forward[0]})
    return {"rank": rank, "runs": runs, "backend": dist.get_backend()}


def summarize(results: list[dict], microbatch_counts: list[int], repeats: int) -> list[dict]:
    """Per (schedule, m): median over repeats of each stage's idle fraction, plus peaks and theory."""
    p = len(results)
    rows = []
    for m in microbatch_counts:
        for name in SCHEDULES:
            idle_runs, fb_ratios, spans = [], [], []
            for repeat in range(1, repeats + 1):
                runs = [next(r for r in res["runs"] if (r["schedule"], r["m"], r["repeat"]) == (name, m, repeat))
                        for res in results]
                span = max(r["stop"] for r in runs) - min(r["start"] for r in runs)
                spans.append(span)
                idle_runs.append([1 - sum(e - s for _, _, s, e in r["trace"]) / span for r in runs])
                f = [e - s for r in runs for k, _, s, e in r["trace"] if k == "F"]
                b = [e - s for r in runs for k, _, s, e in r["trace"] if k == "B"]
                fb_ratios.append(sum(b) / len(b) / (sum(f) / len(f)))
            median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            idle = [median([run[s] for run in idle_runs]) for s in range(p)]
            last = [next(r for r in res["runs"] if (r["schedule"], r["m"]) == (name, m)) for res in results]
            peak = []
            for r in last:  # in-flight count over the executed order, from the trace
                count, best = 0, 0
                for kind, _, _, _ in sorted(r["trace"], key=lambda ev: ev[2]):
                    count += 1 if kind == "F" else -1
                    best = max(best, count)
                peak.append(best)
            actions = SCHEDULES[name](p, m)
            assert peak == [max_in_flight(a) for a in actions], "trace order differs from the schedule"
            rows.append({"schedule": name, "m": m, "idle": idle, "mean_idle": sum(idle) / p,
                         "grid_bubble": bubble_fraction(time_grid(actions)), "theory": (p - 1) / (m + p - 1),
                         "peak_in_flight": peak, "peak_bytes": [r["peak_bytes"] for r in last],
                         "held_in_forwards": [r["peak_bytes"] / max(r["one_forward_bytes"], 1) for r in last],
                         "span_s": median(spans), "b_over_f": median(fb_ratios)})
    return rows


def format_report(rows: list[dict], p: int, header: str) -> str:
    idle_w, peak_w = 7 * p, 4 * p
    lines = [header, "",
             f"{'':3}  {'':9}{'idle fraction (measured)':>{idle_w}}{'':37}  {'in flight':>{peak_w}}",
             f"{'m':>3}  {'schedule':<9}" + "".join(f"{'s' + str(s):>7}" for s in range(p))
             + f"{'mean':>7}{'theory':>8}{'grid':>7}{'step ms':>10}{'B/F':>5}  "
             + "".join(f"{'s' + str(s):>4}" for s in range(p)) + f"{'s0 MiB':>9}{'s0 held/F':>10}"]
    for r in rows:
        lines.append(f"{r['m']:>3}  {r['schedule']:<9}" + "".join(f"{x:>7.2f}" for x in r["idle"])
                     + f"{r['mean_idle']:>7.2f}{r['theory']:>8.2f}{r['grid_bubble']:>7.2f}"
                     + f"{r['span_s'] * 1e3:>10.1f}{r['b_over_f']:>5.1f}  "
                     + "".join(f"{n:>4}" for n in r["peak_in_flight"])
                     + f"{r['peak_bytes'][0] / 2**20:>9.2f}{r['held_in_forwards'][0]:>10.2f}")
    by = {(r["schedule"], r["m"]): r for r in rows}
    lines += ["", "side by side (same run): 1F1B / GPipe"]
    for m in sorted({r["m"] for r in rows}):
        g, o = by[("GPipe", m)], by[("1F1B", m)]
        lines.append(f"  m={m:<3} step time {o['span_s'] / g['span_s']:.2f}x   mean idle {o['mean_idle']:.2f} vs "
                     f"{g['mean_idle']:.2f}   stage-0 bytes held {o['peak_bytes'][0] / max(g['peak_bytes'][0], 1):.2f}x")
    return "\n".join(lines)


def plot(results: list[dict], m: int, path: str) -> None:
    plt = pyplot_or_none()
    if plt is None:
        return
    fig, axes = plt.subplots(len(SCHEDULES), 1, figsize=(11, 1.5 + 0.6 * len(results) * len(SCHEDULES)), squeeze=False)
    for ax, name in zip(axes[:, 0], SCHEDULES):
        runs = [next(r for r in res["runs"] if (r["schedule"], r["m"]) == (name, m)) for res in results]
        t0 = min(r["start"] for r in runs)
        for s, r in enumerate(runs):
            for kind, j, start, end in r["trace"]:
                ax.barh(s, (end - start) * 1e3, left=(start - t0) * 1e3, edgecolor="white",
                        color="tab:blue" if kind == "F" else "tab:orange")
                ax.text((start + end) / 2 * 1e3 - t0 * 1e3, s, f"{kind}{j}", ha="center", va="center",
                        color="white", fontsize=6)
        ax.set(title=f"{name}, p={len(runs)}, m={m} (measured)", xlabel="ms", ylabel="stage")
        ax.set_yticks(range(len(runs)))
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="ranks = pipeline stages (default 4)")
    parser.add_argument("--microbatches", default="1,2,4,8,16", help="micro-batch counts m (default 1,2,4,8,16)")
    parser.add_argument("--microbatch-size", type=int, default=64, help="samples per micro-batch (default 64)")
    parser.add_argument("--width", type=int, default=1024, help="Linear width (default 1024)")
    parser.add_argument("--layers-per-stage", type=int, default=2, help="Linear+Tanh pairs per stage (default 2)")
    parser.add_argument("--simulate-ms", type=float, default=0.0,
                        help="replace the layers by sleeps: F takes this many ms per stage, B twice that")
    parser.add_argument("--repeats", type=int, default=3, help="runs per point, median kept (default 3)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the world is declared hung")
    parser.add_argument("--plot", metavar="PNG", help="measured timelines of both schedules at the largest m")
    args = parser.parse_args(argv)
    try:
        counts = sorted({int(x) for x in args.microbatches.split(",")})
    except ValueError:
        parser.error(f"--microbatches must be comma-separated integers, got {args.microbatches!r}")
    if (args.nproc < 1 or min(counts) < 1 or args.microbatch_size < 1 or args.width < 1
            or args.layers_per_stage < 1 or args.repeats < 1 or args.simulate_ms < 0):
        parser.error("need --nproc, --microbatches, --microbatch-size, --width, --layers-per-stage, --repeats >= 1")
    p = args.nproc
    with exit_on_user_error():
        results = run_world(bench_rank, p, args=(counts, args.microbatch_size, args.width, args.layers_per_stage,
                                                 args.repeats, args.simulate_ms), timeout=args.timeout)
    model = (f"sleeps of {args.simulate_ms:g} ms (F) / {2 * args.simulate_ms:g} ms (B) per stage" if args.simulate_ms
             else f"{args.layers_per_stage} x [Linear({args.width}) + Tanh] per stage, micro-batch {args.microbatch_size}")
    header = (f"pipeline of {p} stages ({results[0]['backend']}): {model}; median of {args.repeats} interleaved runs\n"
              "idle = 1 - compute / step span (measured);  theory = (p-1)/(m+p-1);  grid = the same from the "
              "unit-time grid\nB/F = backward time / forward time;  in flight = peak micro-batches forwarded and not yet "
              "backwarded (executed order);\ns0 MiB = the most bytes stage 0 held at once (saved activations, outputs, "
              "send buffers alive); s0 held/F = the same in units of what one forward leaves held")
    print(format_report(summarize(results, counts, args.repeats), p, header))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if results[0]["backend"] == "gloo" and not args.simulate_ms and cores and cores < p:
        print(f"note: {p} ranks on {cores} CPU cores: stages that should overlap share cores, so the measured idle "
              "is not the schedule's; --simulate-ms 20 measures the schedule alone")
    m_show = min(max(counts), 8)
    for name, fn in SCHEDULES.items():
        print(f"\n{name}, p={p}, m={m_show} (unit-time grid, bubble {bubble_fraction(time_grid(fn(p, m_show))):.2f}):")
        print(render_timeline(time_grid(fn(p, m_show))))
    if args.plot:
        plot(results, max(counts), args.plot)


if __name__ == "__main__":
    main()
