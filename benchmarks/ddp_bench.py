"""Step time of data-parallel ResNet-18 training: per-parameter sync vs one flat bucket vs BucketedDDP vs torch DDP.

    python benchmarks/ddp_bench.py                      # 2 ranks, CIFAR ResNet-18, batch 32 per rank
    python benchmarks/ddp_bench.py --caps 1 5 25 100 --rounds 5 --steps 2 --json ddp.json --plot ddp.png

Every rank trains one copy of the model per variant, with the same data, and the variants
take turns (round-robin, `--steps` timed steps each per round), so a machine whose load
changes during the run slows them alike; the median over rounds is kept. A step is
zero_grad + forward + backward + gradient sync + SGD step; its time is the slowest rank's.

    per-parameter sync   phase 1's sync_gradients: one all_reduce per tensor after backward
    flat after backward  every gradient in one flat buffer, one all_reduce after backward
    BucketedDDP          the reference 3.2 (and yours, phase3_multi_node/bucketed_ddp.py,
                         when it is implemented), buckets all-reduced during backward
    torch DDP            torch.nn.parallel.DistributedDataParallel, default settings
    local only           no communication at all: the compute floor

Fraction of communication hidden behind backward, for the bucketed variants:
    hidden = 1 - (step - local only) / comm alone,   clipped to [0, 1]
where `comm alone` is the time of the same buckets' all-reduces with nothing else running.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run without installing; spawned ranks re-run this
    sys.path.insert(0, str(REPO_ROOT))

import importlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from common.distributed import current_device  # noqa: E402
from common.launch import exit_on_user_error, run_world  # noqa: E402
from common.models import MLP, cifar_resnet18  # noqa: E402
from solutions.phase1_data_parallel.trainer import sync_gradients  # noqa: E402
from solutions.phase3_multi_node.bucketed_ddp import BucketedDDP, assign_buckets  # noqa: E402
from _util import OneLineParser, pyplot_or_none, save_outputs  # noqa: E402  (benchmarks/ is sys.path[0])

LEARNER_MODULE = "phase3_multi_node.bucketed_ddp"
BASELINE = "torch DDP"


def _model(name: str, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    model = cifar_resnet18() if name == "resnet18" else MLP(3 * 32 * 32, 10, hidden=(256, 256))
    return model.to(device)


class _FlatAfterBackward:
    """All gradients copied into one preallocated flat buffer, one all_reduce, .grad = views of it."""

    def __init__(self, model: nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.flat = torch.zeros(sum(p.numel() for p in self.params), device=self.params[0].device)
        self.views = list(torch.split(self.flat, [p.numel() for p in self.params]))
        self.views = [v.view_as(p) for v, p in zip(self.views, self.params)]

    def __call__(self) -> None:
        for p, view in zip(self.params, self.views):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
        self.flat.div_(dist.get_world_size())
        dist.all_reduce(self.flat)
        for p, view in zip(self.params, self.views):
            p.grad = view


def _variants(model_name: str, caps: list[float], device: torch.device, batch: int, learner: str):
    """{name: (forward module, sync after backward or None, optimizer, flats for 'comm alone' or None)}, notes."""
    variants, notes = {}, []

    def add(name, wrap, after=None, flats=None):
        model = _model(model_name, device)
        module = wrap(model)
        inner = getattr(module, "module", module)
        variants[name] = (module, after(inner) if after else None,
                          torch.optim.SGD(inner.parameters(), lr=0.01, momentum=0.9), flats)

    add("local only", lambda m: m)
    add("per-parameter sync", lambda m: m, after=lambda m: (lambda: sync_gradients(m, batch)))
    add("flat after backward", lambda m: m, after=_FlatAfterBackward)
    variants["flat after backward"] = (*variants["flat after backward"][:3], [variants["flat after backward"][1].flat])
    add(BASELINE, lambda m: DDP(m))
    for cap in caps:
        name = f"BucketedDDP {cap:g} MiB"
        add(name, lambda m, cap=cap: BucketedDDP(m, bucket_cap_mb=cap))
        variants[name] = (*variants[name][:3], variants[name][0].flats)
    try:
        learner_cls = importlib.import_module(learner).BucketedDDP
        add("yours (BucketedDDP 25 MiB)", lambda m: learner_cls(m, bucket_cap_mb=25))
    except NotImplementedError as exc:
        notes.append(f"yours: TODO (not implemented yet: {str(exc)[:60]}...)")
    except Exception as exc:  # noqa: BLE001 - a learner's crash is a note, not the end of the benchmark
        notes.append(f"yours: could not run {learner}.BucketedDDP ({type(exc).__name__}: {exc})")
    params = list(_model(model_name, device).parameters())
    notes.append(f"{model_name}: {len(params)} parameter tensors, {sum(p.numel() for p in params) * 4 / 2**20:.1f} MiB "
                 f"of fp32 gradients; BucketedDDP buckets per cap: "
                 + ", ".join(f"{cap:g} MiB -> {len(assign_buckets(params, int(cap * 2**20)))}" for cap in caps))
    return variants, notes


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(variant, inputs, targets, steps: int, device) -> float:
    module, after, optimizer, _ = variant
    dist.barrier()
    _sync_device(device)
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(module(inputs), targets).backward()
        if after is not None:
            after()
        optimizer.step()
    _sync_device(device)
    return (time.perf_counter() - start) / steps


def _time_comm(flats: list[torch.Tensor], steps: int, device) -> float:
    """The buckets' all-reduces alone, launched back to back, then waited for."""
    dist.barrier()
    _sync_device(device)
    start = time.perf_counter()
    for _ in range(steps):
        works = [dist.all_reduce(flat, async_op=True) for flat in flats]
        for work in works:
            work.wait()
    _sync_device(device)
    return (time.perf_counter() - start) / steps


def _slowest(seconds: float, device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def bench_rank(model_name: str, batch: int, caps: list[float], steps: int, rounds: int, learner: str) -> dict | None:
    """Runs on every rank; rank 0 returns {"step_s": {variant: median s}, "comm_s": {...}, "notes": [...]}."""
    device = current_device()
    variants, notes = _variants(model_name, caps, device, batch, learner)
    gen = torch.Generator().manual_seed(dist.get_rank())
    inputs = torch.randn(batch, 3, 32, 32, generator=gen).to(device)
    targets = torch.randint(0, 10, (batch,), generator=gen).to(device)
    for variant in variants.values():  # warm-up: allocator, gloo buffers, torch DDP's bucket rebuild
        _time_steps(variant, inputs, targets, 1, device)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    comm: dict[str, list[float]] = {name: [] for name, v in variants.items() if v[3] is not None}
    for _ in range(rounds):
        for name, variant in variants.items():
            samples[name].append(_slowest(_time_steps(variant, inputs, targets, steps, device), device))
            if name in comm:
                comm[name].append(_slowest(_time_comm(variant[3], steps, device), device))
    if dist.get_rank() != 0:
        return None
    return {"step_s": {k: statistics.median(v) for k, v in samples.items()},
            "comm_s": {k: statistics.median(v) for k, v in comm.items()}, "notes": notes,
            "config": {"model": model_name, "batch_per_rank": batch, "ranks": dist.get_world_size(),
                       "steps": steps, "rounds": rounds, "device": str(device)}}


def derive(r: dict) -> dict:
    """Adds ratio to torch DDP, exposed communication and the hidden fraction."""
    step, local = r["step_s"], r["step_s"]["local only"]
    base = step.get(BASELINE)
    r["vs_torch_ddp"] = {k: v / base for k, v in step.items()} if base else {}
    r["hidden_fraction"] = {}
    for name, comm in r["comm_s"].items():
        exposed = step[name] - local
        r["hidden_fraction"][name] = min(1.0, max(0.0, 1.0 - exposed / comm)) if comm > 0 else float("nan")
    return r


def format_report(r: dict) -> str:
    c = r["config"]
    lines = [f"{c['model']}, batch {c['batch_per_rank']} per rank, {c['ranks']} ranks on {c['device']}; median of "
             f"{c['rounds']} rounds of {c['steps']} steps, slowest rank",
             f"{'variant':<28}{'step ms':>9}{'vs torch DDP':>14}{'comm alone ms':>15}{'hidden':>8}"]
    for name, s in r["step_s"].items():
        comm = r["comm_s"].get(name)
        hidden = r["hidden_fraction"].get(name)
        lines.append(f"{name:<28}{s * 1e3:>9.1f}{r['vs_torch_ddp'].get(name, float('nan')):>13.2f}x"
                     f"{'' if comm is None else f'{comm * 1e3:.1f}':>15}{'' if hidden is None else f'{hidden:.0%}':>8}")
    return "\n".join(lines + [f"note: {n}" for n in r["notes"]])


def plot(r: dict, path: str) -> None:
    plt = pyplot_or_none()
    if plt is None:
        return
    names = list(r["step_s"])
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(names, [r["step_s"][n] * 1e3 for n in names])
    ax.set_xlabel("step time (ms), slowest rank")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None, learner: str = LEARNER_MODULE) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start (default 2)")
    parser.add_argument("--model", choices=["resnet18", "mlp"], default="resnet18",
                        help="CIFAR ResNet-18 (default) or a small MLP (for a quick smoke run)")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank (default 32)")
    parser.add_argument("--caps", type=float, nargs="+", default=[1, 5, 25],
                        help="BucketedDDP bucket_cap_mb values to sweep (default 1 5 25; 100 = one bucket)")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per variant per round (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds, median kept (default 3)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the world is declared hung")
    parser.add_argument("--plot", metavar="PNG", help="bar chart of step times (needs matplotlib)")
    parser.add_argument("--json", metavar="PATH", help="write the raw numbers as JSON")
    args = parser.parse_args(argv)
    if args.nproc < 2 or args.batch < 1 or args.steps < 1 or args.rounds < 1 or args.timeout <= 0:
        parser.error("need --nproc >= 2, --batch >= 1, --steps >= 1, --rounds >= 1 and --timeout > 0")
    if any(cap <= 0 for cap in args.caps):
        parser.error("every --caps value must be > 0")
    with exit_on_user_error():
        results = run_world(bench_rank, args.nproc, args=(args.model, args.batch, args.caps, args.steps,
                                                          args.rounds, learner), timeout=args.timeout)
    result = derive(results[0])
    print(format_report(result))
    save_outputs(result, args.json, args.plot, plot)


if __name__ == "__main__":
    main()
