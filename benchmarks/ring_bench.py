"""Your ring all-reduce vs the reference ring vs dist.all_reduce, busbw side by side (exercise 3.1).

    python benchmarks/ring_bench.py                          # 2 and 4 ranks, 1 KiB .. 64 MiB
    python benchmarks/ring_bench.py --nproc 2 --max-kib 1024 --plot ring.png --json ring.json

For each world size, every rank times every implementation at every message size in the
same run, interleaved round by round, with the reference `time_collective` (1.3). Your
`ring_all_reduce` (phase3_multi_node/ring.py) is timed once it no longer raises its TODO
and agrees with dist.all_reduce on a test tensor; otherwise it is listed and skipped.
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
from solutions.phase1_data_parallel.comm_bench import bandwidths, time_collective  # noqa: E402
from solutions.phase3_multi_node.ring import ring_all_reduce as reference_ring  # noqa: E402
from _util import OneLineParser, fmt_size, learner_status, pyplot_or_none, save_outputs  # noqa: E402  (benchmarks/ is sys.path[0])

BASELINE = "dist.all_reduce"
LEARNER_MODULE = "phase3_multi_node.ring"
TARGET = {2: 0.9, 4: 0.7}  # the reference's busbw / the baseline's, at >= 16 MiB (issue 7)


def iters_for(size: int, iters: int) -> int:
    """Fewer calls for large messages (at least 3), so the defaults finish in about a minute."""
    return max(3, min(iters, (16 << 20) // size))


def bench_rank(sizes: list[int], iters: int, repeats: int, learner: str) -> dict | None:
    """Runs on every rank; rank 0 returns {"seconds": {impl: [s per size]}, "notes": [...], ...}."""
    fns, notes = {}, []
    try:
        status = learner_status(importlib.import_module(learner).ring_all_reduce)
    except Exception as exc:  # noqa: BLE001 - a half-edited file must not stop the benchmark
        status = f"could not load {learner} ({type(exc).__name__}: {exc})"
    if status == "ok":
        fns["learner ring"] = importlib.import_module(learner).ring_all_reduce
    else:
        notes.append("learner ring: " + {"TODO": "TODO (not implemented yet)",
                                         "WRONG RESULT": "WRONG RESULT (differs from dist.all_reduce; not timed)"}
                     .get(status, status))
    fns["reference ring"] = reference_ring
    fns[BASELINE] = dist.all_reduce
    seconds = {name: [] for name in fns}
    for size in sizes:
        # zeros: a sum of zeros stays zero, however many calls reduce the tensor in place
        tensor = torch.zeros(max(size // 4, 1), dtype=torch.float32, device=current_device())
        n = iters_for(size, iters)
        rounds = [[time_collective(fn, tensor, iters=n) for fn in fns.values()] for _ in range(repeats)]
        for name, times in zip(fns, zip(*rounds)):  # interleaved rounds; keep the best: other jobs only add time
            seconds[name].append(min(times))
    if dist.get_rank() != 0:
        return None
    world = dist.get_world_size()
    busbw = {name: [bandwidths(s, t, world)[1] / 1e9 for s, t in zip(sizes, secs)] for name, secs in seconds.items()}
    return {"world_size": world, "backend": dist.get_backend(), "repeats": repeats, "sizes_bytes": sizes,
            "iters": [iters_for(s, iters) for s in sizes], "seconds": seconds, "busbw_GBps": busbw, "notes": notes}


def format_report(r: dict) -> str:
    sizes, names, world = r["sizes_bytes"], list(r["seconds"]), r["world_size"]
    width = max(len(n) for n in names) + 16
    head = f"{'':<{width}}" + "".join(f"{fmt_size(n):>9}" for n in sizes)
    lines = [f"all-reduce, {world} ranks, {r['backend']}, float32, best of {r['repeats']} interleaved rounds",
             *r["notes"], "", "busbw (GB/s) = size/time * 2(p-1)/p", head]
    lines += [f"{n:<{width}}" + "".join(f"{b:>9.3f}" for b in r["busbw_GBps"][n]) for n in names]
    base = r["seconds"][BASELINE]
    lines += ["", f"busbw / busbw of {BASELINE} (= its time / this time), measured side by side; above 1: faster", head]
    lines += [f"{n + ' / baseline':<{width}}" + "".join(f"{g / t:>9.2f}" for t, g in zip(r["seconds"][n], base))
              for n in names if n != BASELINE]
    big = [i for i, s in enumerate(sizes) if s >= 16 << 20]
    if big and world in TARGET:
        ratios = [base[i] / r["seconds"]["reference ring"][i] for i in big]
        lines.append(f"reference ring at >= 16 MiB: {min(ratios):.2f}x..{max(ratios):.2f}x the baseline's busbw "
                     f"(target >= {TARGET[world]}x with {world} ranks)")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    plt = pyplot_or_none()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        for name, bws in r["busbw_GBps"].items():
            ax.plot(r["sizes_bytes"], bws, marker="o", label=f"{name}, {r['world_size']} ranks",
                    linestyle="--" if name == BASELINE else "-")
    ax.set(xscale="log", xlabel="message size (bytes)", ylabel="busbw (GB/s)", title="ring all-reduce vs dist.all_reduce")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None, learner: str = LEARNER_MODULE) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4], help="world sizes, one world each (default 2 4)")
    parser.add_argument("--min-kib", type=int, default=1, help="smallest message (default 1 KiB)")
    parser.add_argument("--max-kib", type=int, default=65536, help="largest message (default 65536 KiB = 64 MiB)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per point, fewer above 1 MiB (default 20)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds, the fastest kept (default 5)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a world is declared hung")
    parser.add_argument("--plot", metavar="PNG", help="busbw vs size plot (needs matplotlib)")
    parser.add_argument("--json", metavar="PATH", help="write the raw numbers as JSON")
    args = parser.parse_args(argv)
    if min(args.nproc) < 1 or args.iters < 1 or args.repeats < 1 or args.timeout <= 0:
        parser.error("need --nproc >= 1, --iters >= 1, --repeats >= 1 and --timeout > 0")
    if args.min_kib < 1 or args.max_kib < args.min_kib:
        parser.error("need 1 <= --min-kib <= --max-kib")
    sizes, kib = [], args.min_kib
    while kib <= args.max_kib:
        sizes.append(kib * 1024)
        kib *= 4
    results = []
    for world in args.nproc:
        with exit_on_user_error():
            results.append(run_world(bench_rank, world, args=(sizes, args.iters, args.repeats, learner),
                                     timeout=args.timeout)[0])
        print(format_report(results[-1]), end="\n\n", flush=True)
    save_outputs(results, args.json, args.plot, plot)


if __name__ == "__main__":
    main()
