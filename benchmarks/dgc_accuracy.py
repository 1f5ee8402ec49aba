"""Top-k under momentum: the trainer's test accuracy with and without DGC's momentum correction.

    python benchmarks/dgc_accuracy.py                                  # the default digits run, top-k 1 %
    python benchmarks/dgc_accuracy.py --ratio 0.001 --seeds 0 1 2 --json dgc.json
    python benchmarks/dgc_accuracy.py --arms dense dgc --max-steps 4   # smoke run

Each arm is the trainer's default run (`python -m solutions.phase4_production.train`: ResNet-18,
bundled digits, 2 CPU ranks, 3 epochs, SGD nesterov 0.9, weight decay 5e-4, compression from
step 10), one after the other in one process, changing only the compression:

    dense          --compression none: plain DDP, the reference
    topk           --compression topk: error feedback on the GRADIENT, momentum in the optimizer
    dgc            --compression dgc: momentum correction (the hook accumulates the VELOCITY) and
                   factor masking; the optimizer has no momentum (the same --topk-ratio as topk)
    topk+warmup    topk with --topk-warmup: the fraction sent falls from 0.25 to --ratio
    dgc+warmup     dgc with the same warm-up

Accuracy and loss are the trainer's test-set numbers after the last epoch; with several
--seeds, each arm runs once per seed (weights, data order and augmentation all follow the
seed) and the table shows each and the mean. Extra trainer flags go after `--`.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run without installing; spawned ranks re-run this
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from common.launch import exit_on_user_error, run_world  # noqa: E402
from solutions.phase4_production.trainer.config import parse_config  # noqa: E402
from solutions.phase4_production.trainer.loop import train  # noqa: E402
from _util import OneLineParser, save_outputs  # noqa: E402  (benchmarks/ is sys.path[0])

ARMS = {
    "dense": ["--compression", "none"],
    "topk": ["--compression", "topk"],
    "dgc": ["--compression", "dgc"],
    "topk+warmup": ["--compression", "topk", "--topk-warmup", "{warmup}"],
    "dgc+warmup": ["--compression", "dgc", "--topk-warmup", "{warmup}"],
}


def run_arm(flags: list[str], nproc: int, timeout: float) -> dict:
    """One trainer run in a fresh world; rank 0's summary (accuracy, test_loss, seconds)."""
    cfg = parse_config(flags, raise_errors=True)
    summary = run_world(train, nproc, args=(cfg,), timeout=timeout)[0]
    return {"accuracy": summary["accuracy"], "test_loss": summary["test_loss"], "seconds": summary["seconds"],
            "steps": summary["step"]}


def format_report(r: dict) -> str:
    seeds = r["seeds"]
    width = max(len(a) for a in r["runs"]) + 2
    head = "".join(f"{'seed ' + str(s):>10}" for s in seeds)
    lines = [f"top-k under momentum: the trainer's default run ({r['nproc']} ranks, torch {r['torch']}), "
             f"--topk-ratio {r['ratio']:g}, warm-up arms over {r['warmup']} steps; test accuracy after the last "
             f"epoch{' (--max-steps ' + str(r['max_steps']) + ')' if r['max_steps'] else ''}", "",
             f"{'arm':<{width}}{head}{'mean':>10}{'test loss':>11}{'s/run':>8}"]
    for arm, runs in r["runs"].items():
        accs = [run["accuracy"] for run in runs]
        lines.append(f"{arm:<{width}}" + "".join(f"{a:>10.2%}" for a in accs) + f"{statistics.mean(accs):>10.2%}"
                     f"{statistics.mean(run['test_loss'] for run in runs):>11.4f}"
                     f"{statistics.mean(run['seconds'] for run in runs):>8.0f}")
    lines += ["", "topk delays gradients and lets the optimizer's momentum act on what arrives; dgc delays the "
                  "velocity (momentum inside the hook) and masks the momentum of what it sent (guidelines 4.4)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratio", type=float, default=0.01, help="--topk-ratio of every sparse arm (default 0.01)")
    parser.add_argument("--warmup", type=int, default=22,
                        help="--topk-warmup steps of the warm-up arms (default 22: one digits epoch)")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="arms to run (default all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="--seed of each run (default 0)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop each run early (smoke runs)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2, the trainer's default on a CPU)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before a run is declared hung")
    parser.add_argument("--json", metavar="PATH", help="write the raw numbers as JSON")
    args = parser.parse_args(argv)
    if not 0 < args.ratio <= 1 or args.warmup < 0 or args.nproc < 1 or min(args.seeds) < 0 \
            or (args.max_steps is not None and args.max_steps < 1):
        parser.error("need --ratio in (0, 1], --warmup >= 0, --nproc >= 1, --seeds >= 0, --max-steps >= 1")
    runs: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    with tempfile.TemporaryDirectory(prefix="dgc_accuracy_") as tmp, exit_on_user_error():
        for seed in args.seeds:
            for arm in args.arms:
                flags = [f.format(warmup=args.warmup) for f in ARMS[arm]]
                flags += ["--topk-ratio", str(args.ratio), "--seed", str(seed), "--progress", "false",
                          "--output-dir", str(Path(tmp) / f"{arm}-{seed}"), "--device", "cpu", *extra]
                if args.max_steps:
                    flags += ["--max-steps", str(args.max_steps)]
                began = time.perf_counter()
                runs[arm].append(run_arm(flags, args.nproc, args.timeout))
                print(f"{arm}, seed {seed}: test accuracy {runs[arm][-1]['accuracy']:.2%} "
                      f"({time.perf_counter() - began:.0f} s)", flush=True)
    result = {"nproc": args.nproc, "torch": torch.__version__, "ratio": args.ratio, "warmup": args.warmup,
              "seeds": args.seeds, "max_steps": args.max_steps, "extra_flags": extra, "runs": runs}
    print()
    print(format_report(result))
    save_outputs(result, args.json)


if __name__ == "__main__":
    main()
