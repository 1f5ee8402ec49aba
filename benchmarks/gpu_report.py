"""One JSON with what a GPU machine says about the trainer: run it where there is a CUDA GPU.

    python benchmarks/gpu_report.py --json gpu_report.json          # about 9 minutes on one H200
    python benchmarks/gpu_report.py --quick --json gpu_report.json  # a smoke run: fewer steps, one pair
    python benchmarks/gpu_report.py --parts compiled,vit,loader_jpeg --json out.json

What it records (every part runs in a subprocess; a part that fails records its error and
the report goes on):

    device, versions     torch.cuda.get_device_name, capability, memory; torch, torchvision,
                         CUDA, cuDNN, NCCL versions; GPUs visible
    trainer_vs_bare      benchmarks/trainer_overhead.py --cases resnet50_224: ResNet-50 on
                         synthetic 224 px images, AMP and channels_last, the trainer and a bare
                         DDP loop in the same run (alternating pairs): s/step each and the ratio
    compiled             the same with --compile: the trainer's --compile against
                         torch.compile(DDP(model)) and, on one GPU, torch.compile(model) alone
    trainer_mfu          the trainer's own "train" records (metrics.jsonl) of a ResNet-50 run:
                         samples/s per GPU and MFU as the trainer logs them (monitoring.mfu
                         over monitoring.PEAK_BF16_FLOPS), eager and --compile
    vit                  the same for one GPU's share of the ViT-B/16 recipe
                         (recipes/imagenet_vit_b16_8gpu.toml: 512 per GPU in 4 micro-batches,
                         every regulariser), synthetic images, eager and --compile
    loader               benchmarks/loader_bench.py, the GPU decode path (--decode cuda)
                         among the others: images/s per worker process
    loader_jpeg          the trainer's whole input pipeline (--benchmark-loader) over real
                         JPEG files written here (500x375, quality 90), --decode tensor and
                         cuda with 8 and 16 workers: images/s delivered to the GPU, to set
                         beside what a compiled step consumes
    fsdp                 the ResNet-50 run with --parallel fsdp: samples/s, MFU

Without a CUDA GPU it says so in one line and exits 2. Runs: benchmarks/gpu_runs/*.json.
"""

from __future__ import annotations

import json
import os
import platform
import re
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


RESNET50 = ["--dataset", "synthetic", "--image-size", "224", "--synthetic-size", "8192", "--model", "resnet50",
            "--global-batch", "256", "--reference-batch", "256", "--amp", "bf16", "--channels-last", "on",
            "--workers", "8"]
VIT_B16 = ["--config", "solutions/phase4_production/recipes/imagenet_vit_b16_8gpu.toml", "--dataset", "synthetic",
           "--data-root", ".", "--synthetic-size", "32768", "--global-batch", "512", "--amp", "bf16"]  # 1 GPU of 8


def trainer_run(flags: list[str], steps: int) -> dict:
    """A run of the trainer on one GPU; its "train" records (the first window, which holds the
    warm-up and any compilation, left out)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = _run([sys.executable, "-m", "solutions.phase4_production.train", "--nproc", "1", *flags,
                       "--max-steps", str(steps), "--log-every", "5", "--checkpoint-every", str(10 ** 6),
                       "--progress", "false", "--output-dir", f"{tmp}/run"], timeout=1200)
        metrics = Path(tmp) / "run" / "metrics.jsonl"
        if metrics.exists():
            records = [json.loads(line) for line in metrics.read_text().splitlines()]
            train = [r for r in records if r.get("event") == "train"][1:]
            result["samples_per_s"] = [r["samples_per_s"] for r in train]
            result["mfu"] = [r.get("mfu") for r in train]
            result["peak_allocated_bytes"] = max((r.get("peak_allocated_bytes") or 0 for r in train), default=None)
    return result


def eager_and_compiled(flags: list[str], steps: int) -> dict:
    runs = {"eager": trainer_run(flags, steps), "compiled": trainer_run([*flags, "--compile"], steps)}
    return {"ok": all(r["ok"] for r in runs.values()), "seconds": sum(r["seconds"] for r in runs.values()), **runs}


def compiled_pair(steps: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "overhead.json"
        result = _run([sys.executable, "benchmarks/trainer_overhead.py", "--cases", "resnet50_224", "--nproc", "1",
                       "--compile", "--steps", str(steps), "--warmup", "10", "--repeats", str(repeats), "--json",
                       str(out)], timeout=1800)
        if result["ok"] and out.exists():
            raw = json.loads(out.read_text())["resnet50_224"]
            result["summary"] = {k: v for k, v in raw.items() if k not in ("bare", "trainer", "bare_plain")}
    return result


def loader(images: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "loader.json"
        result = _run([sys.executable, "benchmarks/loader_bench.py", "--images", str(images), "--rounds", "1",
                       "--json", str(out)], timeout=900)
        if result["ok"] and out.exists():
            result["medians"] = json.loads(out.read_text())["medians"]
    return result


def loader_jpeg(images: int, batches: int) -> dict:
    """--benchmark-loader over `images` real JPEGs (written by 16 processes), ResNet-50's batch
    of 256 at 224 px: images/s into the GPU per (decode, workers)."""
    from concurrent.futures import ProcessPoolExecutor

    from benchmarks.loader_bench import write_jpegs

    began = time.perf_counter()
    result: dict = {"ok": True, "rates": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root, chunk = Path(tmp) / "jpeg", -(-images // 16)
        with ProcessPoolExecutor(16) as pool:
            list(pool.map(write_jpegs, [root] * 16, [min(chunk, images - k) for k in range(0, images, chunk)],
                          [500] * 16, [375] * 16, range(0, images, chunk)))
        write_jpegs(root, 0, 500, 375)  # the val split, from whole files
        for decode in ("tensor", "cuda"):
            for workers in (8, 16):
                run = _run([sys.executable, "-m", "solutions.phase4_production.train", "--nproc", "1", "--dataset",
                            "imagenet", "--data-root", str(root), "--image-size", "224", "--global-batch", "256",
                            "--decode", decode, "--workers", str(workers), "--benchmark-loader", str(batches),
                            "--output-dir", f"{tmp}/run"], timeout=600)
                rate = re.search(r"([\d,.]+) images/s", run.get("stdout", ""))
                result["rates"][f"{decode}, {workers} workers"] = float(rate.group(1).replace(",", "")) if rate \
                    else run.get("error", "")[-300:]
                result["ok"] = result["ok"] and run["ok"]
    result["seconds"] = time.perf_counter() - began
    return result


PARTS = ("trainer_vs_bare", "compiled", "trainer_mfu", "vit", "loader", "loader_jpeg", "fsdp")


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
             "compiled": lambda: compiled_pair(steps, repeats),
             "trainer_mfu": lambda: eager_and_compiled(RESNET50, steps),
             "vit": lambda: eager_and_compiled(VIT_B16, steps),
             "loader": lambda: loader(images),
             "loader_jpeg": lambda: loader_jpeg(images * 4, 30 if args.quick else 60),
             "fsdp": lambda: trainer_run([*RESNET50, "--parallel", "fsdp"], steps)}
    for name in args.parts.split(","):
        part = parts[name]
        print(f"{name} ...", flush=True)
        report[name] = part()
        print(f"{name}: {'ok' if report[name]['ok'] else 'FAILED'} ({report[name]['seconds']:.0f} s)", flush=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")  # a partial report survives a crash
    print(summary(report))
    print(f"report written to {args.json}")


def _rates(run: dict) -> str:
    rates, mfu = run["samples_per_s"], [m for m in run["mfu"] if m is not None]
    return (f"{statistics.median(rates):.0f} samples/s (median of {len(rates)} windows), MFU "
            f"{statistics.median(mfu) if mfu else float('nan'):.1%}, peak allocated "
            f"{(run['peak_allocated_bytes'] or 0) / 2**30:.1f} GiB")


def summary(report: dict) -> str:
    """The report's numbers in a few lines (the JSON holds everything)."""
    lines = [f"{report['device']['name']}, torch {report['versions']['torch']}, "
             f"torchvision {report['versions']['torchvision']}, CUDA {report['versions']['cuda']}"]
    for name in PARTS:
        part = report.get(name)
        if part is None:
            continue
        runs = {"": part} if "eager" not in part else {" eager": part["eager"], " compiled": part["compiled"]}
        for label, run in runs.items():
            if not run["ok"]:
                lines.append(f"{name}{label}: FAILED: {(run.get('error') or '').strip().splitlines()[-1:]}")
            elif "samples_per_s" in run:
                lines.append(f"{name}{label}: {_rates(run)}")
            elif "rates" in run:
                lines.append(f"{name}: " + "; ".join(f"{k}: {v:,.0f} images/s" if isinstance(v, float) else
                                                     f"{k}: {v}" for k, v in run["rates"].items()))
            else:
                lines.append(f"{name}{label}:\n{run['stdout'].strip()[-1500:]}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
