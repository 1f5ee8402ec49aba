"""Exercise 1.3: measure what communication costs, and fit the alpha-beta model.

    time(n bytes) = alpha + beta * n        alpha: latency (s), 1/beta: bandwidth (B/s)

Run it (2 ranks, sizes 1 KiB .. 4 MiB):

    python -m solutions.phase1_data_parallel.comm_bench --nproc 2

Production tools: nccl-tests (all_reduce_perf) and torch.profiler; the numbers they
print, algbw and busbw, are defined below.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.distributed as dist

from common.distributed import current_device

from .allreduce import STRATEGIES


def time_collective(
    fn: Callable[[torch.Tensor], object],
    tensor: torch.Tensor,
    iters: int = 10,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds per call of `fn(tensor)`, as seen by the slowest rank. Call on every rank.

    `warmup` untimed calls first (connections, allocations), then a barrier so all ranks
    start together, then `iters` timed calls. Returns the same value on every rank:
    the maximum over ranks of (elapsed / iters), because a collective is only as fast
    as its slowest participant.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    # EXERCISE 1.3: warmup calls, dist.barrier(), time `iters` calls with `clock`, then take the max over ranks with dist.all_reduce(op=MAX)
    for _ in range(warmup):
        fn(tensor)
    dist.barrier()
    start = clock()
    for _ in range(iters):
        fn(tensor)
    if tensor.is_cuda:
        torch.cuda.synchronize()
    per_call = torch.tensor([(clock() - start) / iters], dtype=torch.float64, device=tensor.device)
    dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
    return per_call.item()
    # END EXERCISE


def fit_alpha_beta(sizes_bytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least-squares fit of seconds = alpha + beta * size. Returns (alpha, beta)."""
    if len(sizes_bytes) != len(seconds):
        raise ValueError(f"got {len(sizes_bytes)} sizes but {len(seconds)} timings")
    if len(set(sizes_bytes)) < 2:
        raise ValueError("need timings for at least two different message sizes to fit alpha and beta")
    # EXERCISE 1.3: solve the least-squares problem [1, n] @ [alpha, beta] = t (torch.linalg.lstsq, or the closed form for a line)
    n = torch.tensor(sizes_bytes, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    design = torch.stack([torch.ones_like(n), n], dim=1)
    alpha, beta = torch.linalg.lstsq(design, t.unsqueeze(1)).solution.squeeze(1).tolist()
    return alpha, beta
    # END EXERCISE


def bandwidths(size_bytes: float, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s, as nccl-tests defines them for all-reduce.

    algbw = size / time. busbw = algbw * 2(p-1)/p: the traffic each link of a ring
    carries, comparable to the hardware's link bandwidth whatever the world size.
    """
    # EXERCISE 1.3: algbw = size/time; busbw = algbw * 2 * (p - 1) / p
    algbw = size_bytes / seconds
    return algbw, algbw * 2 * (world_size - 1) / world_size
    # END EXERCISE


def sweep(sizes_bytes: list[int], iters: int = 10, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per call of every strategy (and dist.all_reduce) at every size; every rank."""
    fns = dict(STRATEGIES, torch_all_reduce=dist.all_reduce)
    results: dict[str, list[float]] = {name: [] for name in fns}
    for size in sizes_bytes:
        tensor = torch.ones(max(size // 4, 1), dtype=torch.float32, device=current_device())
        for name, fn in fns.items():
            results[name].append(time_collective(fn, tensor, iters=iters, warmup=warmup))
    return results


def format_table(sizes_bytes: list[int], results: dict[str, list[float]], world_size: int) -> str:
    """Latency and bus bandwidth per size, then the fitted alpha and 1/beta per strategy."""
    names = list(results)
    lines = [f"{'size':>10} " + " ".join(f"{n:>22}" for n in names)]
    for i, size in enumerate(sizes_bytes):
        cells = []
        for name in names:
            t = results[name][i]
            cells.append(f"{t * 1e6:9.1f}us {bandwidths(size, t, world_size)[1] / 1e9:7.3f}GB/s")
        lines.append(f"{size:>10} " + " ".join(f"{c:>22}" for c in cells))
    lines.append("alpha-beta fit:  time = alpha + beta * bytes")
    for name in names:
        alpha, beta = fit_alpha_beta(sizes_bytes, results[name])
        bw = f"{1 / beta / 1e9:.3f} GB/s" if beta > 0 else "n/a"
        lines.append(f"  {name:<20} alpha = {alpha * 1e6:8.1f} us   1/beta = {bw}")
    return "\n".join(lines)


def _bench_rank(sizes: list[int], iters: int) -> str:
    return format_table(sizes, sweep(sizes, iters=iters), dist.get_world_size())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start (ignored under torchrun)")
    parser.add_argument("--min-kib", type=int, default=1)
    parser.add_argument("--max-kib", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the run is declared hung")
    args = parser.parse_args(argv)
    if args.nproc < 1 or args.iters < 1 or args.min_kib < 1 or args.max_kib < args.min_kib:
        parser.error("need --nproc >= 1, --iters >= 1 and 1 <= --min-kib <= --max-kib")
    sizes, kib = [], args.min_kib
    while kib <= args.max_kib:
        sizes.append(kib * 1024)
        kib *= 4
    from common.launch import run_or_join

    table = run_or_join(_bench_rank, args.nproc, args=(sizes, args.iters), timeout=args.timeout)
    if table is not None:
        print(table)


if __name__ == "__main__":
    main()
