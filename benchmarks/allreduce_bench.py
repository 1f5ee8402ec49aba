"""Your all-reduce strategies vs the reference's vs dist.all_reduce, timed side by side.

    python benchmarks/allreduce_bench.py --nproc 2 --max-kib 1024 --plot bw.png --json bw.json

Every rank times every implementation at every message size in the same run, with the
reference `time_collective` (exercise 1.3), so your 1.3 need not be finished. Your
strategies (phase1_data_parallel/allreduce.py, exercise 1.2) that still raise the TODO
are skipped; one that disagrees with dist.all_reduce is flagged and not timed. The fit
gives each implementation's line T = A + B*bytes and, divided by its algorithm's cost
terms, the link's alpha and 1/beta (reference `link_alpha_beta`, 1.3).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run without installing; spawned ranks re-run this
    sys.path.insert(0, str(REPO_ROOT))

import importlib  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common.distributed import current_device  # noqa: E402
from common.launch import exit_on_user_error, run_world  # noqa: E402
from solutions.phase1_data_parallel.allreduce import STRATEGIES as REFERENCE  # noqa: E402
from solutions.phase1_data_parallel.comm_bench import (  # noqa: E402
    TORCH_ALL_REDUCE_MODEL, bandwidths, cost_terms, describe_fit, fit_alpha_beta, time_collective)
from _util import OneLineParser, fmt_size, learner_status, pyplot_or_none, save_outputs  # noqa: E402  (benchmarks/ is sys.path[0])

BASELINE = "dist.all_reduce"
LEARNER_MODULE = "phase1_data_parallel.allreduce"


def bench_rank(sizes: list[int], iters: int, repeats: int, learner: str) -> dict | None:
    """Runs on every rank; rank 0 returns {seconds: {impl: [s per size]}, notes: [...], ...}."""
    fns, notes = {}, []
    try:
        learner_strategies = importlib.import_module(learner).STRATEGIES
    except Exception as exc:  # noqa: BLE001 - a half-edited file must not stop the benchmark
        learner_strategies = {}
        notes.append(f"learner: could not load {learner} ({type(exc).__name__}: {exc})")
    for name, fn in learner_strategies.items():
        status = learner_status(fn)
        if status == "ok":
            fns[f"learner/{name}"] = fn
        else:
            notes.append(f"learner/{name}: " + ("TODO (not implemented yet)" if status == "TODO"
                                                else "WRONG RESULT (differs from dist.all_reduce; not timed)"))
    fns.update({f"reference/{name}": fn for name, fn in REFERENCE.items()})
    fns[BASELINE] = lambda t: dist.all_reduce(t)
    seconds = {name: [] for name in fns}
    for size in sizes:
        tensor = torch.zeros(max(size // 4, 1), dtype=torch.float32, device=current_device())
        rounds = [[time_collective(fn, tensor, iters=iters) for fn in fns.values()] for _ in range(repeats)]
        for name, times in zip(fns, zip(*rounds)):  # interleaved rounds; keep the median
            seconds[name].append(sorted(times)[len(times) // 2])
    if dist.get_rank() != 0:
        return None
    return {"world_size": dist.get_world_size(), "backend": dist.get_backend(), "iters": iters,
            "repeats": repeats, "sizes_bytes": sizes, "seconds": seconds, "notes": notes}


def algorithm_of(name: str) -> str:
    """The cost model behind an implementation's name: 'learner/ring' -> 'ring'."""
    return TORCH_ALL_REDUCE_MODEL if name == BASELINE else name.split("/", 1)[-1]


def derive(result: dict) -> dict:
    """Add busbw/algbw per size and the alpha-beta fits per implementation (for the JSON too).

    fit[name]: the collective's line (A in us, B in s/byte) and the link's alpha (us) and
    1/beta (GB/s) = A/a, b/B with the algorithm's cost terms (a, b); `reliable` is False
    when A < 0 or B <= 0, and the link numbers are then None, never a negative bandwidth."""
    sizes, world = result["sizes_bytes"], result["world_size"]
    result["busbw_GBps"], result["algbw_GBps"], result["fit"] = {}, {}, {}
    for name, secs in result["seconds"].items():
        bws = [bandwidths(n, t, world) for n, t in zip(sizes, secs)]
        result["algbw_GBps"][name] = [a / 1e9 for a, _ in bws]
        result["busbw_GBps"][name] = [b / 1e9 for _, b in bws]
        if len(sizes) >= 2:
            big_a, big_b = fit_alpha_beta(sizes, secs)
            try:
                a, b = cost_terms(algorithm_of(name), world)
            except ValueError:  # a strategy of the learner's own: no cost model to divide by
                a, b = 0.0, 0.0
            reliable = big_a >= 0 and big_b > 0 and a > 0 and b > 0
            result["fit"][name] = {"A_us": big_a * 1e6, "B_s_per_byte": big_b, "a": a, "b": b, "reliable": reliable,
                                   "link_alpha_us": big_a / a * 1e6 if reliable else None,
                                   "link_inv_beta_GBps": b / big_b / 1e9 if reliable else None}
    return result


def format_report(r: dict) -> str:
    sizes, names = r["sizes_bytes"], list(r["seconds"])
    width = max(len(n) for n in names) + 2
    head = f"{'':<{width}}" + "".join(f"{fmt_size(n):>10}" for n in sizes)
    lines = [f"all-reduce, {r['world_size']} ranks, {r['backend']}, float32, "
             f"median of {r['repeats']} interleaved rounds of {r['iters']} calls per point",
             *r["notes"], "", "latency (us)", head]
    lines += [f"{n:<{width}}" + "".join(f"{t * 1e6:>10.1f}" for t in r["seconds"][n]) for n in names]
    lines += ["", "busbw (GB/s) = size/time * 2(p-1)/p", head]
    lines += [f"{n:<{width}}" + "".join(f"{b:>10.3f}" for b in r["busbw_GBps"][n]) for n in names]
    lines += ["", "alpha-beta fit (relative least squares): collective T = A + B*bytes = a*alpha + b*bytes*beta;",
              "the link's alpha = A/a and 1/beta = b/B, with (a, b) from the algorithm's cost model"]
    if not r["fit"]:
        lines.append("  (needs at least two message sizes)")
    for n, f in r["fit"].items():
        if f["a"] == 0:
            text = "n/a (one rank sends nothing)" if r["world_size"] == 1 else "n/a (no cost model for it)"
        else:
            text = describe_fit(f["A_us"] / 1e6 / f["a"], f["B_s_per_byte"] / f["b"])
        lines.append(f"  {n:<{width}} (a={f['a']:g}, b={f['b']:.3g})  link {text}")
    lines += ["", f"ratios, measured side by side in this run (time / time of {BASELINE}):"]
    base = r["seconds"][BASELINE]
    for n in names[:-1]:
        t = r["seconds"][n]
        last = f", {t[-1] / base[-1]:.2g}x at {fmt_size(sizes[-1])}" if len(sizes) > 1 else ""
        lines.append(f"  {n}: {t[0] / base[0]:.2g}x {BASELINE} at {fmt_size(sizes[0])}{last}")
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    plt = pyplot_or_none()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, bws in r["busbw_GBps"].items():
        ax.plot(r["sizes_bytes"], bws, marker="o", label=name, linestyle="--" if name == BASELINE else "-")
    ax.set(xscale="log", xlabel="message size (bytes)", ylabel="busbw (GB/s)",
           title=f"all-reduce, {r['world_size']} ranks, {r['backend']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None, learner: str = LEARNER_MODULE) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start (default 2)")
    parser.add_argument("--min-kib", type=int, default=1, help="smallest message (default 1 KiB)")
    parser.add_argument("--max-kib", type=int, default=4096, help="largest message (default 4096 KiB)")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per point (default 10)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds, median kept (default 3)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the world is declared hung")
    parser.add_argument("--plot", metavar="PNG", help="busbw vs size plot (needs matplotlib)")
    parser.add_argument("--json", metavar="PATH", help="write the raw numbers as JSON")
    args = parser.parse_args(argv)
    if args.nproc < 1 or args.iters < 1 or args.repeats < 1 or args.timeout <= 0:
        parser.error("need --nproc >= 1, --iters >= 1, --repeats >= 1 and --timeout > 0")
    if args.min_kib < 1 or args.max_kib < args.min_kib:
        parser.error("need 1 <= --min-kib <= --max-kib")
    sizes, kib = [], args.min_kib
    while kib <= args.max_kib:
        sizes.append(kib * 1024)
        kib *= 4
    with exit_on_user_error():
        results = run_world(bench_rank, args.nproc, args=(sizes, args.iters, args.repeats, learner), timeout=args.timeout)
    result = derive(results[0])
    print(format_report(result))
    save_outputs(result, args.json, args.plot, plot)


if __name__ == "__main__":
    main()
