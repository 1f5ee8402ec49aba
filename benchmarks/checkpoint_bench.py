"""What an atomic, verified checkpoint costs: save and load time and size, side by side.

    python benchmarks/checkpoint_bench.py                       # ResNet-18 + Adam state, 3 rounds
    python benchmarks/checkpoint_bench.py --model tiny --rounds 1   # a smoke run (seconds)
    python benchmarks/checkpoint_bench.py --dir /mnt/nvme/tmp --json ckpt.json --plot ckpt.png

One process, one state (the model's state_dict and the optimizer's, after one Adam step so
its moments exist), saved and loaded by three methods that take turns (round-robin, the
median over --rounds):

    torch.save          torch.save to the final name, torch.load: no fsync, no checksum
    atomic_save         the reference of exercise 4.1: sha256 footer, temp file, fsync,
                        rename, fsync the folder; load_verified checks the digest first
    dcp.save            torch.distributed.checkpoint.save into a folder (one .distcp file
                        per rank + a .metadata commit file), dcp.load in place

Times are reported in seconds and as ratios to torch.save; sizes in MiB. Where the page
cache absorbs the writes, fsync is what makes a save wait for the disk: run it with --dir
on the file system your checkpoints go to.

Then the training stall per save, with the trainer's writer (checkpoint_writer.py) in the
training thread (sync: the step waits for atomic_save) and in the background (async: the
step waits for a CPU copy of the state). A loop of fixed compute steps saves every
--save-every steps; stall per save = (loop time with saves - loop time without) / saves,
which also counts what the writer thread takes from the loop (the GIL, memory bandwidth,
cores). All three loops run in turns, the median over --rounds.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run without installing
    sys.path.insert(0, str(REPO_ROOT))

import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from solutions.phase4_production.checkpoint import CheckpointManager, atomic_save, load_verified  # noqa: E402
from solutions.phase4_production.trainer.checkpoint_writer import BackgroundWriter  # noqa: E402
from _util import OneLineParser, pyplot_or_none, save_outputs  # noqa: E402  (benchmarks/ is sys.path[0])

BASELINE = "torch.save"


def build_state(model_name: str) -> tuple[dict, int]:
    """({"model": state_dict, "optimizer": state_dict}, parameters) after one Adam step."""
    torch.manual_seed(0)
    if model_name == "resnet18":
        from torchvision.models import resnet18
        model, x = resnet18(num_classes=1000), torch.randn(2, 3, 64, 64)
    else:
        model, x = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)), torch.randn(4, 256)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    F.mse_loss(model(x), torch.zeros_like(model(x))).backward()
    optimizer.step()
    params = sum(p.numel() for p in model.parameters())
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, params


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _dcp_template(state: dict) -> dict:
    """dcp.load fills a state dict in place: one of the same structure, other values."""
    return {"model": {k: torch.empty_like(v) for k, v in state["model"].items()},
            "optimizer": {"state": {i: {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v
                                        for k, v in s.items()} for i, s in state["optimizer"]["state"].items()},
                          "param_groups": state["optimizer"]["param_groups"]}}


def methods(folder: Path, state: dict) -> dict:
    """name -> (save(state) -> path, load(path) -> state)."""
    def dcp_load(path):
        template = _dcp_template(state)
        dcp.load(template, checkpoint_id=str(path))
        return template

    return {
        BASELINE: (lambda s: (torch.save(s, folder / "plain.pt"), folder / "plain.pt")[1],
                   lambda p: torch.load(p, weights_only=True)),
        "atomic_save": (lambda s: (atomic_save(s, folder / "atomic.pt"), folder / "atomic.pt")[1],
                        lambda p: load_verified(p)),
        "dcp.save": (lambda s: (dcp.save(s, checkpoint_id=str(folder / "dcp")), folder / "dcp")[1], dcp_load),
    }


def run(model_name: str, rounds: int, where: str | None) -> dict:
    state, params = build_state(model_name)
    key = next(iter(state["model"]))  # checked after every load: the method really round-trips
    folder = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=where))
    times = {name: {"save": [], "load": []} for name in methods(folder, state)}
    sizes = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # dcp warns that no process group exists: one process is the intent
            for _ in range(rounds):
                for name, (save, load) in methods(folder, state).items():
                    t0 = time.perf_counter()
                    path = save(state)
                    t1 = time.perf_counter()
                    loaded = load(path)
                    t2 = time.perf_counter()
                    assert torch.equal(loaded["model"][key], state["model"][key]), f"{name} lost {key}"
                    times[name]["save"].append(t1 - t0)
                    times[name]["load"].append(t2 - t1)
                    sizes[name] = _size(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    median = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    return {"model": model_name, "parameters": params, "rounds": rounds, "folder": str(folder.parent),
            "seconds": median, "bytes": sizes, "torch": torch.__version__}


def _compute_step(x: torch.Tensor) -> torch.Tensor:
    """A stand-in for a training step: a fixed amount of matrix work."""
    for _ in range(8):
        x = torch.tanh(x @ x)
    return x


def run_stall(model_name: str, rounds: int, where: str | None, steps: int = 90, save_every: int = 30) -> dict:
    """Median loop seconds with no saves, sync saves and background saves; stall per save, and
    the time submit() itself blocked (the writer's own view: the copy, or the whole write).
    The interval between saves must exceed a write for the background writer to hide it
    (one write in flight: a save that comes sooner waits for the previous one)."""
    state, _ = build_state(model_name)
    x = torch.randn(384, 384) / 384 ** 0.5
    loops = {"no save": None, "sync": False, "async": True}
    seconds: dict[str, list[float]] = {name: [] for name in loops}
    blocked: dict[str, list[float]] = {"sync": [], "async": []}
    for _ in range(rounds):
        for name, asynchronous in loops.items():
            folder = Path(tempfile.mkdtemp(prefix="ckpt_stall_", dir=where))
            try:
                writer = BackgroundWriter(CheckpointManager(folder, keep=2), asynchronous=bool(asynchronous),
                                          on_done=lambda r, name=name: blocked[name].append(r.stall_s))
                began = time.perf_counter()
                with writer:
                    for step in range(1, steps + 1):
                        _compute_step(x)
                        for tensor in state["model"].values():  # the optimizer step changes the state in place
                            if tensor.is_floating_point():
                                tensor.mul_(1.0)
                        if asynchronous is not None and step % save_every == 0:
                            writer.submit(step, state)
                    writer.wait()
                seconds[name].append(time.perf_counter() - began)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    median = {name: statistics.median(v) for name, v in seconds.items()}
    saves = steps // save_every
    return {"steps": steps, "saves": saves, "loop_seconds": median,
            "stall_per_save": {name: (median[name] - median["no save"]) / saves for name in ("sync", "async")},
            "submit_seconds": {name: statistics.median(v) for name, v in blocked.items()}}


def report(r: dict) -> None:
    base = r["seconds"][BASELINE]
    print(f"{r['model']} ({r['parameters'] / 1e6:.1f} M parameters) + Adam state, median of {r['rounds']} round(s), "
          f"in {r['folder']}, torch {r['torch']}")
    print(f"{'method':<13} {'save s':>8} {'x':>6} {'load s':>8} {'x':>6} {'MiB':>8}")
    for name, s in r["seconds"].items():
        print(f"{name:<13} {s['save']:8.3f} {s['save'] / base['save']:6.2f} {s['load']:8.3f} "
              f"{s['load'] / base['load']:6.2f} {r['bytes'][name] / 2**20:8.1f}")
    st = r.get("stall")
    if st:
        loop = st["loop_seconds"]
        print(f"\ntraining stall per save: {st['steps']} steps, a save every {st['steps'] // st['saves']} "
              f"({st['saves']} saves), loop {loop['no save']:.3f} s without saves")
        print(f"{'writer':<13} {'loop s':>8} {'stall/save s':>13} {'x sync':>7} {'submit s':>9}")
        for name in ("sync", "async"):
            per = st["stall_per_save"][name]
            ratio = per / st["stall_per_save"]["sync"] if st["stall_per_save"]["sync"] > 0 else float("nan")
            print(f"{name:<13} {loop[name]:8.3f} {per:13.4f} {ratio:7.2f} {st['submit_seconds'][name]:9.4f}")


def plot(r: dict, path: str) -> None:
    plt = pyplot_or_none()
    if plt is None:
        return
    names = list(r["seconds"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, phase in enumerate(("save", "load")):
        ax.bar([j + 0.4 * i for j in range(len(names))], [r["seconds"][n][phase] for n in names], 0.4, label=phase)
    ax.set_xticks([j + 0.2 for j in range(len(names))], names)
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"{r['model']} + Adam state")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def main(argv=None) -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("resnet18", "tiny"), default="resnet18")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", help="where to write (default: the system's temp folder)")
    parser.add_argument("--plot", metavar="PNG", help="bar chart of the times (needs matplotlib)")
    parser.add_argument("--json", metavar="PATH", help="write the raw numbers as JSON")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    torch.set_num_threads(1)
    result = run(args.model, args.rounds, args.dir)
    result["stall"] = run_stall(args.model, args.rounds, args.dir)
    report(result)
    save_outputs(result, args.json, args.plot, plot)


if __name__ == "__main__":
    main()
