"""Per-rank bytes of parameters, gradients and Adam state for DP and ZeRO stages 1-3 (exercise 2.4).

    python benchmarks/zero_memory.py                         # world sizes 1, 2, 4; ~3.2M parameters
    python benchmarks/zero_memory.py --worlds 2 3 --width 512 --learner

For each world size a world of ranks (common.launch.run_world) trains the same MLP one
Adam step with each stage, then every rank reports `state_bytes()` (the storages it
really holds between steps) and the elements it sent in collectives during the step
(counted by wrapping dist.all_reduce / reduce_scatter_tensor / all_gather_into_tensor,
with the ring cost model: all-reduce 2(N-1)/N x size, reduce-scatter and all-gather
(N-1)/N x the full size). The table shows rank 0's bytes next to `zero_state_bytes`
(the formula, padding included) and the ratio to plain DP; the largest rank differs
from rank 0 by nothing (equal shards).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
for _p in (REPO_ROOT / "tests", REPO_ROOT):  # run without installing; spawned ranks re-run this
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import json  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import grading  # noqa: E402
from common.distributed import current_device  # noqa: E402
from common.launch import exit_on_user_error, run_world  # noqa: E402
from solutions.phase2_advanced.zero import layer_numels, zero_state_bytes  # noqa: E402
from _util import OneLineParser  # noqa: E402  (benchmarks/ is sys.path[0])

NAMES = {0: "DP (stage 0)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
CLASSES = {0: "DataParallelAdam", 1: "ZeroStage1", 2: "ZeroStage2", 3: "ZeroStage3"}


def build(width: int, layers: int, classes: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers - 1):
        mods += [nn.Linear(width, width), nn.ReLU()]
    mods.append(nn.Linear(width, classes))
    return nn.Sequential(*mods)


class _Counter:
    """Elements this rank sends, ring model, for the three collectives ZeRO uses."""

    def __init__(self):
        self.sent = 0.0
        self.real = {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")}

    def __enter__(self):
        n = dist.get_world_size()
        frac = (n - 1) / n
        real = self.real

        def all_reduce(tensor, *a, **k):
            self.sent += 2 * frac * tensor.numel()
            return real["all_reduce"](tensor, *a, **k)

        def reduce_scatter_tensor(output, input, *a, **k):
            self.sent += frac * input.numel()
            return real["reduce_scatter_tensor"](output, input, *a, **k)

        def all_gather_into_tensor(output, input, *a, **k):
            self.sent += frac * output.numel()
            return real["all_gather_into_tensor"](output, input, *a, **k)

        dist.all_reduce, dist.reduce_scatter_tensor, dist.all_gather_into_tensor = \
            all_reduce, reduce_scatter_tensor, all_gather_into_tensor
        return self

    def __exit__(self, *exc):
        for name, fn in self.real.items():
            setattr(dist, name, fn)


def bench_rank(ref: grading.ModuleRef, width: int, layers: int, batch: int) -> dict:
    mod = ref.load()
    device = current_device()
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    inputs = torch.randn(batch, width, generator=gen).to(device)
    targets = torch.randint(0, 10, (batch,), generator=gen).to(device)
    out = {}
    for stage, name in CLASSES.items():
        model = build(width, layers, 10).to(device)
        optimizer = getattr(mod, name)(model, lr=1e-3)
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        # the second step, counted whole: stage 3 gathers in forward and backward, not in step()
        with _Counter() as counter:
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
        out[stage] = {"bytes": optimizer.state_bytes(), "sent": counter.sent}
        del optimizer, model
    return out


def run(args) -> dict:
    ref = grading.ModuleRef("2.4", "learner" if args.learner else "solution", str(REPO_ROOT))
    model = build(args.width, args.layers, 10)
    units = layer_numels(model)
    results = {"psi": sum(units), "units": units, "worlds": {}}
    for world in args.worlds:
        with exit_on_user_error():
            ranks = run_world(bench_rank, world, args=(ref, args.width, args.layers, args.batch), timeout=args.timeout)
        results["worlds"][world] = {
            stage: {"measured": ranks[0][stage]["bytes"],
                    "max_total": max(r[stage]["bytes"]["total"] for r in ranks),
                    "formula": zero_state_bytes(stage, units, world),
                    "sent_per_rank": ranks[0][stage]["sent"]}
            for stage in CLASSES}
    return results


def report(r: dict, args) -> str:
    psi, mb = r["psi"], 1e6
    impl = "your zero.py" if args.learner else "reference zero.py"
    lines = [f"MLP {args.layers} x Linear(width {args.width}), Psi = {psi:,} fp32 parameters, Adam, {impl}",
             "bytes rank 0 holds between steps (params + grads + Adam state), measured by state_bytes() vs "
             "zero_state_bytes(); comm = elements sent per rank in one step (ring model) / Psi", ""]
    head = (f"{'N':>3} {'stage':<13} {'params MB':>10} {'grads MB':>9} {'Adam MB':>8} {'total MB':>9} "
            f"{'formula MB':>11} {'match':>6} {'bytes/Psi':>10} {'vs DP':>6} {'comm/Psi':>9}")
    lines.append(head)
    for world, stages in r["worlds"].items():
        dp = stages[0]["measured"]["total"]
        for stage, row in stages.items():
            m, f = row["measured"], row["formula"]
            ok = "yes" if all(m[k] == f[k] for k in f) and row["max_total"] == m["total"] else "NO"
            lines.append(f"{world:>3} {NAMES[stage]:<13} {m['params'] / mb:>10.2f} {m['grads'] / mb:>9.2f} "
                         f"{m['optimizer'] / mb:>8.2f} {m['total'] / mb:>9.2f} {f['total'] / mb:>11.2f} {ok:>6} "
                         f"{m['total'] / psi:>10.2f} {m['total'] / dp:>5.2f}x {row['sent_per_rank'] / psi:>9.2f}")
        lines.append("")
    lines += ["fp32 Adam formulas: DP 16 Psi; ZeRO-1 4+4+8/N; ZeRO-2 4+12/N; ZeRO-3 16/N (x Psi, up to padding).",
              "comm: DP all-reduce 2(N-1)/N; ZeRO-1 here all-reduce + all-gather 3(N-1)/N (a reduce-scatter would do:",
              "that is ZeRO-2, 2(N-1)/N, same as DP); ZeRO-3 all-gather x2 + reduce-scatter 3(N-1)/N = 1.5x DP.",
              "",
              "the ZeRO paper's mixed-precision count for the same Psi (fp16 params + grads, K = 12 bytes of fp32",
              "master weights + Adam state), in MB per rank:"]
    for world in r["worlds"]:
        n = world
        mp = {"DP": 16 * psi, "P_os": 4 * psi + 12 * psi / n, "P_os+g": 2 * psi + 14 * psi / n, "P_os+g+p": 16 * psi / n}
        lines.append(f"  N={n}: " + ", ".join(f"{k} {v / mb:.2f}" for k, v in mp.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="world sizes (default 1 2 4)")
    parser.add_argument("--width", type=int, default=1024, help="hidden width (default 1024: ~3.2M parameters with 4 layers)")
    parser.add_argument("--layers", type=int, default=4, help="Linear layers (default 4)")
    parser.add_argument("--batch", type=int, default=8, help="samples per rank (default 8)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a world is declared hung")
    parser.add_argument("--learner", action="store_true", help="measure YOUR phase2_advanced/zero.py")
    parser.add_argument("--json", metavar="PATH", help="write the raw numbers as JSON")
    args = parser.parse_args(argv)
    if min(args.worlds) < 1 or args.width < 1 or args.layers < 1 or args.batch < 1:
        parser.error("need --worlds >= 1, --width >= 1, --layers >= 1, --batch >= 1")
    results = run(args)
    print(report(results, args))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"raw numbers written to {args.json}")


if __name__ == "__main__":
    main()
