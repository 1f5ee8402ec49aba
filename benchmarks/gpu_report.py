"""One JSON with what a GPU machine says about the trainer: run it where there is a CUDA GPU.

    python benchmarks/gpu_report.py --json gpu_report.json          # about 4 minutes on one H100
    python benchmarks/gpu_report.py --quick --json gpu_report.json  # a smoke run: fewer steps, one pair

What it records (every part runs in a subprocess; a part that fails records its error and
the report goes on):

    device, versions     torch.cuda.get_device_name, capability, memory; torch, torchvision,
                         CUDA, cuDNN, NCCL versions; GPUs visible
    trainer_vs_bare      benchmarks/trainer_overhead.py --cases resnet50_224: ResNet-50 on
                         synthetic 224 px images, AMP and channels_last, the trainer and a bare
                         DDP loop in the same run (alternating pairs): s/step each and the ratio
    trainer_mfu          the trainer's own "train" records (metrics.jsonl) of a ResNet-50 run:
                         samples/s per GPU and MFU as the trainer logs them (monitoring.mfu
                         over monitoring.PEAK_BF16_FLOPS)
    loader               benchmarks/loader_bench.py, the GPU decode path (--decode cuda)
                         among the others: images/s per worker process
    fsdp                 the same ResNet-50 run with --parallel fsdp: samples/s, MFU

Without a CUDA GPU it says so in one line and exits 2. Its first run (one H100, 2026-11-26) is
benchmarks/gpu_runs/2026-11-26_h100.json.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._util import OneLineParser  # noqa: E402

ENV = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _run(args: list[str], timeout: float) -> dict:
    """Run a command; {"ok", "seconds", "stdout" (tail), "error" (stderr tail)}."""
    began = time.perf_counter()
    try:
        proc = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "seconds": timeout, "error": f"timed out after {timeout:.0f} s: {' '.join(args)}"}
    result = {"ok": proc.returncode == 0, "seconds": time.perf_counter() - began, "stdout": proc.stdout[-4000:]}
    if proc.returncode != 0:
        result["error"] = proc.stderr[-4000:]
    return result


def versions() -> dict:
    import torch
    import torchvision

    return {"torch": torch.__version__, "torchvision": torchvision.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
            "python": platform.python_version()}


def device() -> dict:
    import torch

    props = torch.cuda.get_device_properties(0)
    return {"name": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
            "memory_gib": round(props.total_memory / 2**30, 1), "count": torch.cuda.device_count()}


def trainer_vs_bare(steps: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "overhead.json"
        result = _run([sys.executable, "benchmarks/trainer_overhead.py", "--cases", "resnet50_224", "--nproc", "1",
                       "--steps", str(steps), "--warmup", "5", "--repeats", str(repeats), "--json", str(out)],
                      timeout=1200)
        if result["ok"] and out.exists():
            result["raw"] = json.loads(out.read_text())
    return result


def trainer_run(parallel: str, steps: int) -> dict:
    """A ResNet-50 run of the trainer on synthetic 224 px images; its "train" records."""
    with tempfile.TemporaryDirectory() as tmp:
        result = _run([sys.executable, "-m", "solutions.phase4_production.train", "--nproc", "1",
                       "--dataset", "synthetic", "--image-size", "224", "--synthetic-size", "8192",
                       "--model", "resnet50", "--global-batch", "256", "--reference-batch", "256", "--amp", "bf16",
                       "--channels-last", "on", "--workers", "4", "--max-steps", str(steps), "--log-every", "5",
                       "--checkpoint-every", str(10 ** 6), "--progress", "false", "--parallel", parallel,
                       "--output-dir", f"{tmp}/run"], timeout=1200)
        metrics = Path(tmp) / "run" / "metrics.jsonl"
        if metrics.exists():
            records = [json.loads(line) for line in metrics.read_text().splitlines()]
            train = [r for r in records if r.get("event") == "train"][1:]  # the first window holds the warm-up
            result["samples_per_s"] = [r["samples_per_s"] for r in train]
            result["mfu"] = [r.get("mfu") for r in train]
            result["peak_allocated_bytes"] = max((r.get("peak_allocated_bytes") or 0 for r in train), default=None)
    return result


def loader(images: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "loader.json"
        result = _run([sys.executable, "benchmarks/loader_bench.py", "--images", str(images), "--rounds", "1",
                       "--json", str(out)], timeout=900)
        if result["ok"] and out.exists():
            result["medians"] = json.loads(out.read_text())["medians"]
    return result


PARTS = ("trainer_vs_bare", "trainer_mfu", "loader", "fsdp")


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="gpu_report.json", help="where the report goes")
    parser.add_argument("--quick", action="store_true", help="fewer steps and images (a smoke run)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which parts, comma-separated ({', '.join(PARTS)})")
    parser.add_argument("--steps", type=int, help="trainer steps per run (default 45; 20 with --quick)")
    parser.add_argument("--repeats", type=int, help="trainer/bare pairs (default 3; 1 with --quick)")
    args = parser.parse_args(argv)
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    import torch

    if not torch.cuda.is_available():
        parser.exit(2, "gpu_report.py: error: no CUDA GPU is visible here; run it on a GPU machine (it measures "
                       "the GPU paths)\n")
    steps, repeats, images = (20, 1, 64) if args.quick else (45, 3, 512)
    steps, repeats = args.steps or steps, args.repeats or repeats
    report = {"device": device(), "versions": versions(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
              "settings": {"quick": args.quick, "steps": steps, "repeats": repeats, "images": images}}
    parts = {"trainer_vs_bare": lambda: trainer_vs_bare(steps, repeats),
             "trainer_mfu": lambda: trainer_run("ddp", steps),
             "loader": lambda: loader(images),
             "fsdp": lambda: trainer_run("fsdp", steps)}
    for name in args.parts.split(","):
        part = parts[name]
        print(f"{name} ...", flush=True)
        report[name] = part()
        print(f"{name}: {'ok' if report[name]['ok'] else 'FAILED'} ({report[name]['seconds']:.0f} s)", flush=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")  # a partial report survives a crash
    print(summary(report))
    print(f"report written to {args.json}")


def summary(report: dict) -> str:
    """The report's numbers in a few lines (the JSON holds everything)."""
    lines = [f"{report['device']['name']}, torch {report['versions']['torch']}, "
             f"torchvision {report['versions']['torchvision']}, CUDA {report['versions']['cuda']}"]
    for name in PARTS:
        part = report.get(name)
        if part is None:
            continue
        if not part["ok"]:
            lines.append(f"{name}: FAILED: {(part.get('error') or '').strip().splitlines()[-1:]}")
        elif "samples_per_s" in part:
            rates, mfu = part["samples_per_s"], [m for m in part["mfu"] if m is not None]
            lines.append(f"{name}: {statistics.median(rates):.0f} samples/s (median of {len(rates)} windows), "
                         f"MFU {statistics.median(mfu) if mfu else float('nan'):.1%}, "
                         f"peak allocated {(part['peak_allocated_bytes'] or 0) / 2**30:.1f} GiB")
        else:
            lines.append(f"{name}:\n{part['stdout'].strip()[-1500:]}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
