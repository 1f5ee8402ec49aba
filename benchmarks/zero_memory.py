"""Per-rank memory (between steps AND at the peak) and traffic of DP and ZeRO stages 1-3 (exercise 2.4).

    python benchmarks/zero_memory.py                         # world sizes 1, 2, 4; ~3.2M parameters
    python benchmarks/zero_memory.py --worlds 2 3 --width 512 --layers 8 --learner

For each world size a world of ranks (common.launch.run_world) trains the same MLP two
Adam steps with each stage (stages 0-2 wrap torch.optim.Adam; torch.optim.Adam steps stage
3's shards, ZeroStage3 wrapping the model). During the second step every rank samples
`common.measure.training_memory` (the model's parameters, their .grad, what the optimizer
keeps) at every collective it calls and at the end of backward (CollectiveLog's on_call),
and after the step; it also counts the elements it sends (ring model of the calls it
makes, `ring_elements_sent`). The table shows rank 0: bytes after the step next to
`zero_state_bytes` (the formula, padding and stage 1's whole-parameter shares included), the
PEAK and where it happened, the ratio to DP, and the traffic per step. Activations are not
counted (exercise 2.3).
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
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common.distributed import current_device  # noqa: E402
from common.launch import exit_on_user_error, run_world  # noqa: E402
from common.measure import CollectiveLog, PeakBytes, ring_elements_sent, training_memory  # noqa: E402
from solutions.phase2_advanced.zero import layer_numels, zero_state_bytes  # noqa: E402
from _util import OneLineParser, save_outputs  # noqa: E402  (benchmarks/ is sys.path[0])

NAMES = {0: "DP (stage 0)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
CLASSES = {0: "DataParallelOptimizer", 1: "ZeroStage1", 2: "ZeroStage2", 3: "ZeroStage3"}


def build(width: int, layers: int, classes: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers - 1):
        mods += [nn.Linear(width, width), nn.ReLU()]
    mods.append(nn.Linear(width, classes))
    return nn.Sequential(*mods)


def bench_rank(module_name: str, width: int, layers: int, batch: int) -> dict:
    mod = importlib.import_module(module_name)
    device = current_device()
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(dist.get_rank())
    inputs = torch.randn(batch, width, generator=gen).to(device)
    targets = torch.randint(0, 10, (batch,), generator=gen).to(device)
    out = {}
    for stage, name in CLASSES.items():
        model = build(width, layers, 10).to(device)
        if stage == 3:  # a module wrapper: the optimizer steps its parameters, this rank's shards
            model = mod.ZeroStage3(model)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        else:
            optimizer = getattr(mod, name)(model.parameters(), torch.optim.Adam, lr=1e-3)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        # the second step, measured whole: stage 3 gathers in forward and backward, not in step()
        optimizer.zero_grad()
        peak = PeakBytes(lambda: training_memory(model, optimizer))
        with CollectiveLog(on_call=lambda call: peak.sample(call.name)) as log:
            F.cross_entropy(model(inputs), targets).backward()
            peak.sample("end of backward")
            optimizer.step()
        out[stage] = {"between_steps": peak.sample("after step"), "peak": peak.peak, "peak_where": peak.where,
                      "sent": sum(ring_elements_sent(call, world) for call in log.calls)}
        del optimizer, model, peak
    return out


def run(args) -> dict:
    module_name = ("" if args.learner else "solutions.") + "phase2_advanced.zero"
    model = build(args.width, args.layers, 10)
    units = layer_numels(model)
    results = {"psi": sum(units), "units": units, "worlds": {}}
    for world in args.worlds:
        with exit_on_user_error():
            ranks = run_world(bench_rank, world, args=(module_name, args.width, args.layers, args.batch),
                              timeout=args.timeout)
        results["worlds"][world] = {
            stage: {**ranks[0][stage], "formula": zero_state_bytes(stage, model, world),
                    "max_peak_total": max(r[stage]["peak"]["total"] for r in ranks)}
            for stage in CLASSES}
    return results


def report(r: dict, args) -> str:
    psi, mb = r["psi"], 1e6
    impl = "your zero/" if args.learner else "reference zero/"
    lines = [f"MLP {args.layers} x Linear(width {args.width}), Psi = {psi:,} fp32 parameters in {len(r['units'])} units "
             f"(the largest {max(r['units']) / psi:.0%}), Adam, {impl}, rank 0",
             "after the step: params (stage 3: its shards) + grads + optimizer-held (stage 2's slices, Adam state), "
             "measured by training_memory vs zero_state_bytes;",
             "peak: the most held at any collective or at the end of backward (activations not counted), and the "
             "gradients then (stage 3: its shards' and a gathered unit's); comm: elements sent per step (ring model) "
             "/ Psi", ""]
    lines.append(f"{'N':>3} {'stage':<13} {'params MB':>10} {'grads MB':>9} {'optim MB':>9} {'total MB':>9} "
                 f"{'=formula':>8} {'B/Psi':>6} {'vs DP':>6} {'peak B/Psi':>11} {'of it grads':>12} {'peak at':<22} "
                 f"{'comm/Psi':>9}")
    for world, stages in r["worlds"].items():
        dp = stages[0]["between_steps"]["total"]
        for stage, row in stages.items():
            m, f, p = row["between_steps"], row["formula"], row["peak"]
            ok = "=" if all(m[k] == f[k] for k in f) else "NO"
            lines.append(f"{world:>3} {NAMES[stage]:<13} {m['params'] / mb:>10.2f} {m['grads'] / mb:>9.2f} "
                         f"{m['optimizer'] / mb:>9.2f} {m['total'] / mb:>9.2f} {ok:>8} {m['total'] / psi:>6.2f} "
                         f"{m['total'] / dp:>5.2f}x {p['total'] / psi:>11.2f} {p['grads'] / psi:>12.2f} "
                         f"{row['peak_where']['total']:<22} {row['sent'] / psi:>9.2f}")
        lines.append("")
    lines += ["bytes per parameter between steps, and what each stage divides by N, by precision regime:",
              "  fp32, or autocast (fp32 params and grads, 2.2):  4 params + 4 grads + 8 Adam = 16;"
              "  ZeRO-1 4+4+8/N, ZeRO-2 4+12/N, ZeRO-3 16/N",
              "    (autocast also holds a 2-byte copy of each weight it casts, cached while the autocast region runs and kept "
              "for backward where saved: up to +2 at the peak)",
              "  the ZeRO paper's (fp16 params and grads + K = 12 of fp32 master weights and Adam):  2 + 2 + 12 = 16;"
              "  ZeRO-1 2+2+12/N, ZeRO-2 2+14/N, ZeRO-3 16/N",
              "comm: DP all-reduce 2(N-1)/N; ZeRO-1 here all-reduce + a broadcast per parameter from its owner",
              "2(N-1)/N + 1 (a broadcast counts its whole message); ZeRO-2 reduce-scatter +",
              "all-gather 2(N-1)/N, as DP; ZeRO-3 all-gather x2 + reduce-scatter 3(N-1)/N = 1.5x DP.",
              "", "the same Psi in the two regimes, MB per rank (formulas, no padding):"]
    for n in r["worlds"]:
        fp32 = {"DP": 16, "ZeRO-1": 8 + 8 / n, "ZeRO-2": 4 + 12 / n, "ZeRO-3": 16 / n}
        paper = {"DP": 16, "ZeRO-1": 4 + 12 / n, "ZeRO-2": 2 + 14 / n, "ZeRO-3": 16 / n}
        lines.append(f"  N={n}: fp32/autocast " + ", ".join(f"{k} {v * psi / mb:.2f}" for k, v in fp32.items())
                     + ";  paper's fp16 " + ", ".join(f"{k} {v * psi / mb:.2f}" for k, v in paper.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="world sizes (default 1 2 4)")
    parser.add_argument("--width", type=int, default=1024, help="hidden width (default 1024: ~3.2M parameters with 4 layers)")
    parser.add_argument("--layers", type=int, default=4, help="Linear layers (default 4)")
    parser.add_argument("--batch", type=int, default=8, help="samples per rank (default 8)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a world is declared hung")
    parser.add_argument("--learner", action="store_true", help="measure YOUR phase2_advanced/zero/")
    parser.add_argument("--json", metavar="PATH", help="write the raw numbers as JSON")
    args = parser.parse_args(argv)
    if min(args.worlds) < 1 or args.width < 1 or args.layers < 1 or args.batch < 1:
        parser.error("need --worlds >= 1, --width >= 1, --layers >= 1, --batch >= 1")
    results = run(args)
    print(report(results, args))
    save_outputs(results, args.json)


if __name__ == "__main__":
    main()
