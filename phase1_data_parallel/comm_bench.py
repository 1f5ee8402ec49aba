"""Exercise 1.3: measure what communication costs, and fit the alpha-beta model.

One message of n bytes over one link:   t(n) = alpha + beta * n
    alpha: latency (s)     beta: inverse link bandwidth (s/byte)

A collective made of such messages costs T(n) = a * alpha + b * n * beta, where the
counts (a, b) depend on the algorithm and the world size p (`cost_terms`). Fitting a
line T = A + B * n to timings therefore gives A = a * alpha and B = b * beta: the
*link's* alpha and beta come from dividing by the algorithm's counts (`link_alpha_beta`).

Run it (2 ranks, sizes 1 KiB .. 4 MiB):

    python -m solutions.phase1_data_parallel.comm_bench --nproc 2

Production tools: nccl-tests (all_reduce_perf) and torch.profiler; the numbers they
print, algbw and busbw, are defined below.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Callable

import torch
import torch.distributed as dist

from common.distributed import current_device

from .allreduce import STRATEGIES

# what dist.all_reduce is modelled as: gloo's all-reduce is a ring, and so is NCCL's for large messages
TORCH_ALL_REDUCE_MODEL = "ring"


def time_collective(
    fn: Callable[[torch.Tensor], object],
    tensor: torch.Tensor,
    iters: int = 10,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds per call of `fn(tensor)`, as seen by the slowest rank. Call on every rank.

    `warmup` untimed calls first (connections, allocations); then all ranks start the
    clock together and time `iters` calls. For a CUDA tensor (`tensor.is_cuda`), wait for
    the device (`torch.cuda.synchronize()`) before reading the clock: CUDA calls return
    before the work is done. Returns the same value on every rank: the maximum over ranks
    of (elapsed / iters), because a collective is only as fast as its slowest participant.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    raise NotImplementedError("TODO 1.3: every rank returns the slowest rank's seconds per timed call, timed by the guidelines' five rules (section 1.3)")


def fit_alpha_beta(sizes_bytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Fit seconds = alpha + beta * size; returns (alpha, beta).

    Minimises the *relative* residuals sum_i ((alpha + beta * n_i - t_i) / t_i)^2, so a
    1 KiB message timed in microseconds weighs as much as a 4 MiB one timed in
    milliseconds: the small sizes determine alpha, the large ones beta. (Plain least
    squares lets a 1% wobble at the largest size swamp alpha, even make it negative.)
    """
    if len(sizes_bytes) != len(seconds):
        raise ValueError(f"got {len(sizes_bytes)} sizes but {len(seconds)} timings")
    if len(set(sizes_bytes)) < 2:
        raise ValueError("need timings for at least two different message sizes to fit alpha and beta")
    if min(seconds) <= 0:
        raise ValueError(f"timings must be positive, got {min(seconds)}")
    raise NotImplementedError("TODO 1.3: the (alpha, beta) of the docstring's weighted least squares, in float64; pointer: torch.linalg.lstsq")


def cost_terms(strategy: str, world_size: int) -> tuple[float, float]:
    """(a, b) such that an all-reduce of n bytes costs a * alpha + b * n * beta on p ranks.

    `strategy`: a key of STRATEGIES (1.2; reduce_broadcast with gloo's binomial-tree
    broadcast), "ring" (reduce-scatter + all-gather) or "halving_doubling" (Rabenseifner;
    for p not a power of two, the p - q ranks above the largest power of two q fold
    into ranks 0..p-q-1 first and get the result back at the end, as in recursive
    doubling: two more whole-message steps). (0, 0) for p = 1: nothing is sent.
    ValueError for any other strategy, whatever p.
    """
    p = world_size
    if p < 1:
        raise ValueError(f"world_size must be >= 1, got {p}")
    raise NotImplementedError('TODO 1.3: count latencies (a) and n-byte transfers (b) on the critical path (table of section 1.3); ValueError: unknown strategy')


def link_alpha_beta(strategy: str, world_size: int, sizes_bytes: list[float],
                    seconds: list[float]) -> tuple[float, float] | None:
    """The link's (alpha, beta) behind timings of `strategy`: the fit divided by the
    strategy's (a, b). None where they cannot be recovered (p = 1: nothing was sent)."""
    a, b = cost_terms(strategy, world_size)
    if a == 0 or b == 0:
        return None
    alpha, beta = fit_alpha_beta(sizes_bytes, seconds)
    return alpha / a, beta / b


def describe_fit(alpha: float, beta: float) -> str:
    """'alpha = .. us, 1/beta = .. GB/s', or why the numbers are not a result."""
    if beta <= 0 or alpha < 0:
        return (f"unreliable fit ({'beta <= 0' if beta <= 0 else 'alpha < 0'}: the noise is larger than the "
                "size effect here; raise --iters or the sizes)")
    return f"alpha = {alpha * 1e6:9.2f} us   1/beta = {1 / beta / 1e9:8.3f} GB/s"


def bandwidths(size_bytes: float, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s, as nccl-tests defines them for all-reduce.

    algbw = size / time. busbw = algbw * 2(p-1)/p: the traffic each link of a ring
    carries, comparable to the hardware's link bandwidth whatever the world size.
    """
    raise NotImplementedError("TODO 1.3: the docstring's two numbers; busbw is 0 for a single rank")


def sweep(sizes_bytes: list[int], iters: int = 10, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per call of every strategy (and dist.all_reduce) at every size; every rank."""
    fns = dict(STRATEGIES, torch_all_reduce=dist.all_reduce)
    results: dict[str, list[float]] = {name: [] for name in fns}
    for size in sizes_bytes:
        # zeros: the sum of zeros stays zero, however many calls reduce the tensor in place
        tensor = torch.zeros(max(size // 4, 1), dtype=torch.float32, device=current_device())
        for name, fn in fns.items():
            results[name].append(time_collective(fn, tensor, iters=iters, warmup=warmup))
    return results


def format_table(sizes_bytes: list[int], results: dict[str, list[float]], world_size: int) -> str:
    """Latency and bus bandwidth per size, then per strategy the fitted line and the link's alpha, beta."""
    names = list(results)
    lines = [f"{'size':>10} " + " ".join(f"{n:>22}" for n in names)]
    for i, size in enumerate(sizes_bytes):
        cells = []
        for name in names:
            t = results[name][i]
            cells.append(f"{t * 1e6:9.1f}us {bandwidths(size, t, world_size)[1] / 1e9:7.3f}GB/s")
        lines.append(f"{size:>10} " + " ".join(f"{c:>22}" for c in cells))
    lines.append(f"alpha-beta fit per collective: T = a*alpha + b*bytes*beta, (a, b) from the strategy's "
                 f"cost model on {world_size} ranks; shown: the link's alpha and 1/beta")
    for name in names:
        model = TORCH_ALL_REDUCE_MODEL if name == "torch_all_reduce" else name
        link = link_alpha_beta(model, world_size, sizes_bytes, results[name])
        a, b = cost_terms(model, world_size)
        text = describe_fit(*link) if link else "n/a (one rank sends nothing)"
        lines.append(f"  {name:<20} (a={a:g}, b={b:.3g}) {text}")
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
