"""Activation memory and step time with vs without activation checkpointing (exercise 2.3).

    python benchmarks/activation_memory.py                       # 32 blocks, reference checkpointing
    python benchmarks/activation_memory.py --expand 4            # MLP blocks that save 5x their input
    python benchmarks/activation_memory.py --blocks 64 --width 256 --learner --plot mem.png

A stack of n identical blocks runs forward + backward; for each number of segments k the
peak bytes of the tensors autograd holds for backward are measured with saved_tensors_hooks
(`saved_activation_bytes`, parameters excluded) and printed next to the formula
(`predicted_saved_bytes`: max over segments j of j checkpoints + segment j's blocks, about
k*c + (n/k)*A, least at k* = sqrt(n*A/c) capped at n). Linear -> ReLU blocks save as much
as their input (A = c: k* = sqrt(n)); with --expand E, Linear(d, E*d) -> ReLU -> Linear(E*d, d)
-> ReLU blocks save E + 1 times their input (A = (E+1)*c: k* moves towards n, as for a
transformer layer). The time per step is a ratio to the plain stack timed in the same run
(interleaved rounds, median).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run without installing
    sys.path.insert(0, str(REPO_ROOT))

import importlib  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from common.launch import exit_on_user_error  # noqa: E402
from common.measure import predicted_saved_bytes, saved_activation_bytes  # noqa: E402
from _util import OneLineParser, pyplot_or_none  # noqa: E402  (benchmarks/ is sys.path[0])


def build_blocks(n: int, width: int, expand: int | None, device: torch.device) -> list[nn.Module]:
    """He-initialised Linear -> ReLU blocks (expand: Linear(d, e*d) -> ReLU -> Linear(e*d, d) -> ReLU):
    activations keep their scale through a deep stack. (With the default init they shrink ~2x per
    block, and tiny float32 values, denormals, make CPU matmuls crawl.)"""
    torch.manual_seed(0)

    def linear(n_in, n_out):
        layer = nn.Linear(n_in, n_out)
        nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
        nn.init.zeros_(layer.bias)
        return layer

    shape = [width, expand * width, width] if expand else [width, width]
    return [nn.Sequential(*[m for a, b in zip(shape, shape[1:]) for m in (linear(a, b), nn.ReLU())]).to(device)
            for _ in range(n)]


def plain(blocks, x):
    for block in blocks:
        x = block(x)
    return x


def time_step(fn, device: torch.device, iters: int) -> float:
    """Seconds per call of fn (forward + backward), after one warm-up call."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def run(args) -> list[dict]:
    device = torch.device(args.device)
    module = importlib.import_module(("" if args.learner else "solutions.") + "phase2_advanced.checkpointing")
    blocks = build_blocks(args.blocks, args.width, args.expand, device)
    params = [p for b in blocks for p in b.parameters()]
    x = torch.randn(args.batch, args.width, device=device)
    c = args.batch * args.width * 4  # one block output = a checkpoint, float32 bytes
    block = c * (args.expand + 1) if args.expand else c  # what a block saves besides its input

    def step(k):
        def fn():
            for p in params:
                p.grad = None
            y = plain(blocks, x) if k is None else module.checkpoint_sequential(blocks, k, x)
            y.sum().backward()
        return fn

    segments = [None] + [k for k in args.segments if 1 <= k <= args.blocks]
    rows = [{"segments": k, "measured": saved_activation_bytes(step(k), exclude=params),
             "predicted": predicted_saved_bytes(args.blocks, k, c, block), "seconds": []} for k in segments]
    for _ in range(args.repeats):  # interleaved: whatever slows the machine slows every row
        for row in rows:
            row["seconds"].append(time_step(step(row["segments"]), device, args.iters))
    for row in rows:
        row["seconds"] = sorted(row["seconds"])[len(row["seconds"]) // 2]
    return rows


def report(rows: list[dict], args) -> str:
    base = rows[0]
    mib = 2**20
    impl = "your checkpoint_sequential" if args.learner else "reference checkpoint_sequential"
    e = args.expand
    shape = f"Linear({args.width}, {e * args.width}) -> ReLU -> Linear -> ReLU" if e else f"Linear({args.width}, {args.width}) -> ReLU"
    ratio = e + 1 if e else 1  # A / c
    lines = [f"{args.blocks} x ({shape}), batch {args.batch}, float32, {args.device}, {impl}; "
             f"one block output c = {args.batch * args.width * 4 / 1024:g} KiB, a block saves A = {ratio} c",
             f"peak saved-activation bytes (parameters excluded) and time per forward+backward, "
             f"median of {args.repeats} interleaved rounds of {args.iters} steps",
             "",
             f"{'segments':>10} {'measured MiB':>13} {'predicted MiB':>14} {'match':>6} {'vs plain':>9} {'time vs plain':>14}"]
    for row in rows:
        k = "plain" if row["segments"] is None else str(row["segments"])
        match = "yes" if row["measured"] == row["predicted"] else "NO"
        lines.append(f"{k:>10} {row['measured'] / mib:>13.3f} {row['predicted'] / mib:>14.3f} {match:>6} "
                     f"{row['measured'] / base['measured']:>8.2f}x {row['seconds'] / base['seconds']:>13.2f}x")
    best = min(rows[1:], key=lambda r: r["measured"]) if len(rows) > 1 else base
    k_star = math.sqrt(args.blocks * ratio)
    lines += ["", f"least memory at k = {best['segments']} segments; k* = sqrt(n A / c) = sqrt({args.blocks} x {ratio}) "
                  f"= {k_star:.1f}{f', capped at n = {args.blocks}' if k_star > args.blocks else ''}. "
                  f"The formula: about k + {f'{ratio} ' if ratio > 1 else ''}n/k block outputs "
                  f"vs 1 + {f'{ratio} ' if ratio > 1 else ''}n without checkpointing.",
              "Recomputation costs one extra forward: about 4/3 of the plain step time when the matmuls dominate",
              "(forward F, backward ~2F); small layers add per-segment overhead (RNG state copies, a second autograd pass)."]
    return "\n".join(lines)


def plot(rows: list[dict], args) -> None:
    plt = pyplot_or_none()
    if plt is None:
        return
    ks = [r["segments"] for r in rows[1:]]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(ks, [r["measured"] / 2**20 for r in rows[1:]], marker="o", label="measured")
    ax.plot(ks, [r["predicted"] / 2**20 for r in rows[1:]], linestyle="--", label="k checkpoints + one segment")
    ax.axhline(rows[0]["measured"] / 2**20, color="gray", linestyle=":", label="no checkpointing")
    ax.set(xscale="log", xlabel="segments k", ylabel="peak saved activations (MiB)",
           title=f"{args.blocks} {'MLP' if args.expand else 'Linear->ReLU'} blocks, width {args.width}, batch {args.batch}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"plot written to {args.plot}")


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=32, help="identical blocks in the stack (default 32)")
    parser.add_argument("--width", type=int, default=256, help="features per block (default 256)")
    parser.add_argument("--batch", type=int, default=64, help="samples per step (default 64)")
    parser.add_argument("--expand", type=int, metavar="E",
                        help="MLP blocks Linear(d, E*d) -> ReLU -> Linear(E*d, d) -> ReLU, saving E+1 times their input "
                             "(default: Linear -> ReLU blocks, saving as much as their input)")
    parser.add_argument("--segments", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16, 32],
                        help="segment counts to try (default 1 2 4 6 8 16 32; those > --blocks are skipped)")
    parser.add_argument("--iters", type=int, default=10, help="timed steps per measurement (default 10)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds, median kept (default 5)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for torch (default 1: steadier timings on a shared machine)")
    parser.add_argument("--learner", action="store_true", help="time YOUR phase2_advanced/checkpointing.py")
    parser.add_argument("--plot", metavar="PNG", help="memory vs segments plot (needs matplotlib)")
    args = parser.parse_args(argv)
    if min(args.blocks, args.width, args.batch, args.iters, args.repeats, args.threads,
           1 if args.expand is None else args.expand) < 1:
        parser.error("--blocks, --width, --batch, --expand, --iters, --repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    with exit_on_user_error():
        rows = run(args)
    print(report(rows, args))
    if args.plot:
        plot(rows, args)


if __name__ == "__main__":
    main()
