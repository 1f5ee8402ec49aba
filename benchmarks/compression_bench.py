"""Gradient compression as DDP comm hooks: bytes sent and step time vs plain DDP, side by side.

    python benchmarks/compression_bench.py                         # 2 ranks, MLP 1024-1024-1024-10
    python benchmarks/compression_bench.py --ratios 0.001 0.01 0.1 --ranks 1 2 4 --json c.json --plot c.png
    python benchmarks/compression_bench.py --width 64 --steps 1 --rounds 1 --ratios 0.1 --ranks 1   # smoke run

Every rank trains one copy of the model per variant (same weights, same batches); the
variants take turns (round-robin, `--steps` timed steps each per round, median over
rounds), so a machine whose load changes slows them alike. A step is zero_grad + forward +
backward (with the hook) + SGD step; its time is the slowest rank's. Compression starts at
iteration 2 (DDP rebuilds its buckets after iteration 0) and the timed steps come after it.

    plain DDP                  no hook: DDP's built-in all-reduce (the baseline)
    torch fp16_compress_hook   the bucket cast to float16, all-reduced, cast back
    top-k R (reference)        solutions/phase4_production/compression.py, error feedback on
    PowerSGD r (reference)     the same file's powersgd_hook (bitwise torch's)
    torch powerSGD_hook r      torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook

bytes/step: what this rank hands to collectives in one compressed step (common.measure.CollectiveLog);
ratio = plain DDP's bytes / the variant's. On gloo every variant gets one bucket (torch's
powerSGD_hook issues collectives from gloo's threads, unsafe with several buckets).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run without installing; spawned ranks re-run this
    sys.path.insert(0, str(REPO_ROOT))

import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from common.distributed import current_device  # noqa: E402
from common.launch import exit_on_user_error, run_world  # noqa: E402
from common.measure import CollectiveLog  # noqa: E402
from common.models import MLP  # noqa: E402
from solutions.phase4_production.compression import (  # noqa: E402
    PowerSGDState, TopKState, powersgd_hook, topk_hook)
from _util import OneLineParser, fmt_size, pyplot_or_none, save_outputs  # noqa: E402  (benchmarks/ is sys.path[0])

BASELINE = "plain DDP"
START = 2  # first compressed iteration


def _variants(ratios: list[float], ranks: list[int]) -> dict:
    """name -> a function returning (state, hook), or None for no hook."""
    variants = {BASELINE: None, "torch fp16_compress_hook": lambda: (None, default_hooks.fp16_compress_hook)}
    for ratio in ratios:
        variants[f"top-k {ratio:g} (reference)"] = lambda ratio=ratio: (TopKState(ratio=ratio, start_iter=START), topk_hook)
    for r in ranks:
        variants[f"PowerSGD {r} (reference)"] = lambda r=r: (
            PowerSGDState(matrix_approximation_rank=r, start_powerSGD_iter=START), powersgd_hook)
        variants[f"torch powerSGD_hook {r}"] = lambda r=r: (
            torch_powersgd.PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=START),
            torch_powersgd.powerSGD_hook)
    return variants


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_rank(width: int, layers: int, batch: int, steps: int, rounds: int, ratios: list[float],
               ranks: list[int]) -> dict | None:
    """Runs on every rank; rank 0 returns {seconds: {variant: median s/step}, bytes: {...}, ...}."""
    device = current_device()
    one_bucket = 10_000 if dist.get_backend() == "gloo" else 25
    models, optimizers = {}, {}
    for name, make in _variants(ratios, ranks).items():
        torch.manual_seed(0)
        model = DDP(MLP(64, 10, hidden=(width,) * layers).to(device), bucket_cap_mb=one_bucket)
        if make is not None:
            model.register_comm_hook(*make())
        models[name], optimizers[name] = model, torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(batch, 64, generator=gen).to(device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)

    def step(name: str) -> None:
        optimizers[name].zero_grad(set_to_none=True)
        F.cross_entropy(models[name](x), y).backward()
        optimizers[name].step()

    sent = {}
    for name in models:  # warm-up: the plain iterations, then one compressed step, logged
        for _ in range(START):
            step(name)
        with CollectiveLog() as log:
            step(name)
        sent[name] = log.bytes()
    # DDP's built-in all-reduce runs in C++, unseen by CollectiveLog: its buckets hold every gradient.
    sent[BASELINE] = sum(p.numel() * p.element_size() for p in models[BASELINE].parameters())
    per_round = {name: [] for name in models}
    for _ in range(rounds):
        for name in models:
            _sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                step(name)
            _sync(device)
            elapsed = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
            per_round[name].append(elapsed.item())
    if dist.get_rank() != 0:
        return None
    numel = sum(p.numel() for p in models[BASELINE].parameters())
    return {"world_size": dist.get_world_size(), "backend": dist.get_backend(), "device": str(device),
            "width": width, "layers": layers, "parameters": numel, "batch_per_rank": batch, "steps": steps,
            "rounds": rounds, "bytes_per_step": sent,
            "seconds": {name: statistics.median(times) for name, times in per_round.items()}}


def derive(result: dict) -> dict:
    base_bytes, base_s = result["bytes_per_step"][BASELINE], result["seconds"][BASELINE]
    result["compression_ratio"] = {n: base_bytes / b if b else float("inf") for n, b in result["bytes_per_step"].items()}
    result["time_ratio"] = {n: s / base_s for n, s in result["seconds"].items()}
    return result


def format_report(r: dict) -> str:
    names = list(r["seconds"])
    width = max(len(n) for n in names) + 2
    lines = [f"gradient compression, {r['world_size']} ranks, {r['backend']} on {r['device']}: MLP 64-"
             f"{'-'.join([str(r['width'])] * r['layers'])}-10 ({r['parameters']:,} parameters, "
             f"{fmt_size(4 * r['parameters'])} of float32 gradients), batch {r['batch_per_rank']} per rank, "
             f"median of {r['rounds']} interleaved rounds of {r['steps']} steps", "",
             f"{'variant':<{width}}{'bytes/step':>14}{'ratio':>10}{'ms/step':>10}{'time / plain':>14}"]
    for n in names:
        lines.append(f"{n:<{width}}{r['bytes_per_step'][n]:>14,}{r['compression_ratio'][n]:>9.1f}x"
                     f"{r['seconds'][n] * 1e3:>10.2f}{r['time_ratio'][n]:>13.2f}x")
    lines += ["", "bytes/step: this rank's messages in one compressed step (all_gather: its own input); "
                  "ratio = plain DDP's bytes / the variant's;",
              "time / plain < 1 only where the bytes saved cost more than the compression's compute "
              "(a slow link, a big model)."]
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    plt = pyplot_or_none()
    if plt is None:
        return
    names = list(r["seconds"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.barh(names, [r["compression_ratio"][n] for n in names])
    left.set(xscale="log", xlabel="compression ratio (plain bytes / bytes sent)")
    right.barh(names, [r["time_ratio"][n] for n in names])
    right.axvline(1.0, color="k", linestyle="--", linewidth=1)
    right.set(xlabel="step time / plain DDP")
    right.set_yticklabels([])
    fig.suptitle(f"{r['world_size']} ranks, {r['backend']}, {r['parameters']:,} parameters")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start (default 2)")
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the MLP (default 1024)")
    parser.add_argument("--layers", type=int, default=2, help="hidden layers of the MLP (default 2)")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step (default 32)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant and round (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds, median kept (default 3)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.001, 0.01, 0.1], help="top-k ratios")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="PowerSGD ranks")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the world is declared hung")
    parser.add_argument("--plot", metavar="PNG", help="compression ratio and step time plot (needs matplotlib)")
    parser.add_argument("--json", metavar="PATH", help="write the raw numbers as JSON")
    args = parser.parse_args(argv)
    if min(args.nproc, args.width, args.layers, args.batch, args.steps, args.rounds) < 1 or args.timeout <= 0:
        parser.error("need --nproc, --width, --layers, --batch, --steps, --rounds >= 1 and --timeout > 0")
    if not all(0 < x <= 1 for x in args.ratios) or min(args.ranks) < 1:
        parser.error("need every --ratios in (0, 1] and every --ranks >= 1")
    with exit_on_user_error():
        results = run_world(bench_rank, args.nproc, args=(args.width, args.layers, args.batch, args.steps,
                                                          args.rounds, args.ratios, args.ranks), timeout=args.timeout)
    result = derive(results[0])
    print(format_report(result))
    save_outputs(result, args.json, args.plot, plot)


if __name__ == "__main__":
    main()
