"""DDP vs the course's ZeRO-3 vs torch's fully_shard: bytes per rank, step time, checkpoint bytes (2.4).

    python benchmarks/fsdp_memory.py                          # 2 ranks, ~3.2M parameters, 5 timed steps
    python benchmarks/fsdp_memory.py --nproc 4 --width 512 --layers 8 --steps 10 --learner

One world of ranks (common.launch.run_world) builds the same MLP three times and trains
each with torch.optim.Adam, the three taking turns step by step (so whatever slows the
machine down slows all three):

    DDP            torch's DistributedDataParallel: every rank holds everything (stage 0)
    ZeRO-3         the course's ZeroStage3 (exercise 2.4): one flat fp32 shard per unit
    fully_shard    torch's FSDP2 on each Linear, then the root: per-parameter DTensor shards

Per rank, between steps: the bytes of parameters, gradients and optimizer state
(common.measure.training_memory; a DTensor counts its local shard), next to the model of
16 bytes per parameter for DDP and 16/N for the sharded two (Adam in fp32: 4 + 4 + 8), as
measured/model and as a ratio to DDP measured in the same run. Step time: forward,
backward and optimizer step, the slowest rank's, the median over --steps, and its ratio to
DDP's. Checkpoint bytes each rank writes: DDP, one torch.save of the model's and the
optimizer's state_dict by rank 0 (all of it); fully_shard, torch.distributed.checkpoint
(dcp.save of get_state_dict(model, optimizer)), each rank its own shards (about 1/N each;
the coordinator adds the .metadata index); ZeRO-3, a torch.save per rank of its shards'
state_dict and the optimizer's (about 1/N each, but only loadable at the same world size
and layout: no resharding). Activations are not counted (2.3). No timing is asserted.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run without installing; spawned ranks re-run this
    sys.path.insert(0, str(REPO_ROOT))

import importlib  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common.distributed import current_device  # noqa: E402
from common.launch import exit_on_user_error, run_world  # noqa: E402
from common.measure import training_memory  # noqa: E402
from _util import OneLineParser, save_outputs  # noqa: E402  (benchmarks/ is sys.path[0])

NAMES = ("DDP", "ZeRO-3", "fully_shard")


def build(width: int, layers: int, classes: int = 10) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers - 1):
        mods += [nn.Linear(width, width), nn.ReLU()]
    mods.append(nn.Linear(width, classes))
    return nn.Sequential(*mods)


def _wrap(name: str, module_name: str, width: int, layers: int):
    """(what the step calls, the optimizer), or None: the learner's ZeroStage3 still raises its TODO."""
    device = current_device()
    model = build(width, layers).to(device)
    if name == "DDP":
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    elif name == "ZeRO-3":
        try:
            net = importlib.import_module(module_name).ZeroStage3(model)
        except NotImplementedError as exc:
            if str(exc).startswith("TODO"):
                return None
            raise
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh)
        fully_shard(model, mesh=mesh)
        net = model
    return net, torch.optim.Adam(net.parameters(), lr=1e-3)


def _checkpoint_bytes(name: str, net: nn.Module, optimizer, folder: Path) -> int:
    """Bytes this rank writes for one checkpoint of `net` and `optimizer` into `folder` (collective)."""
    rank = dist.get_rank()
    if name == "DDP":
        if rank != 0:
            dist.barrier()
            return 0
        path = folder / "ddp.pt"
        torch.save({"model": net.module.state_dict(), "optimizer": optimizer.state_dict()}, path)
        dist.barrier()
        return path.stat().st_size
    if name == "ZeRO-3":
        path = folder / f"zero3_rank{rank}.pt"
        torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, path)
        dist.barrier()
        return path.stat().st_size
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_state, optim_state = get_state_dict(net, optimizer)
    target = folder / "dcp"
    dcp.save({"model": model_state, "optimizer": optim_state}, storage_writer=dcp.FileSystemWriter(str(target)))
    dist.barrier()
    mine = sum(f.stat().st_size for f in target.glob(f"__{rank}_*.distcp"))
    return mine + ((target / ".metadata").stat().st_size if rank == 0 else 0)


def bench_rank(module_name: str, width: int, layers: int, batch: int, steps: int, folder: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    device = current_device()
    inputs = torch.randn(batch, width, generator=gen).to(device)
    targets = torch.randint(0, 10, (batch,), generator=gen).to(device)
    runs = {name: _wrap(name, module_name, width, layers) for name in NAMES}
    times: dict[str, list[float]] = {name: [] for name in NAMES}
    for step in range(steps + 1):  # the first step builds Adam's state and warms up: not timed
        for name, run in runs.items():
            if run is None:
                continue
            net, optimizer = run
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad()
            F.cross_entropy(net(inputs), targets).backward()
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
            if step:
                times[name].append(elapsed.item())
    out = {}
    for name, run in runs.items():
        if run is None:
            out[name] = None
            continue
        net, optimizer = run
        sub = Path(folder) / name
        if rank == 0:
            sub.mkdir()
        dist.barrier()
        out[name] = {"memory": training_memory(net, optimizer), "step_s": statistics.median(times[name]),
                     "checkpoint_bytes": _checkpoint_bytes(name, net, optimizer, sub)}
    out["world"] = world
    return out


def run(args) -> dict:
    module_name = ("" if args.learner else "solutions.") + "phase2_advanced.zero"
    psi = sum(p.numel() for p in build(args.width, args.layers).parameters())
    with tempfile.TemporaryDirectory(prefix="fsdp-memory-") as folder, exit_on_user_error():
        ranks = run_world(bench_rank, args.nproc, args=(module_name, args.width, args.layers, args.batch,
                                                        args.steps, folder), timeout=args.timeout)
    return {"psi": psi, "nproc": args.nproc, "ranks": ranks}


def report(r: dict, args) -> str:
    psi, n, mb = r["psi"], r["nproc"], 2**20
    impl = "your zero/" if args.learner else "reference zero/"
    lines = [f"MLP {args.layers} x Linear(width {args.width}), Psi = {psi:,} fp32 parameters, torch.optim.Adam, "
             f"{n} ranks ({os.cpu_count()} CPU cores), batch {args.batch} per rank, {impl}, torch {torch.__version__}",
             "bytes per rank between steps (training_memory: params + grads + optimizer state) vs the model "
             "(16 Psi for DDP, 16 Psi/N sharded);",
             f"step: forward + backward + Adam step, the slowest rank's, median of {args.steps}; ratios to DDP measured "
             "in the same run", ""]
    lines.append(f"{'rank':>4} {'':<12} {'params MiB':>10} {'grads MiB':>9} {'optim MiB':>9} {'total MiB':>9} "
                 f"{'B/Psi':>6} {'model':>6} {'meas/model':>10} {'vs DDP':>7} {'step ms':>8} {'vs DDP':>7} "
                 f"{'ckpt MiB':>9} {'vs DDP r0':>9}")
    for rank, results in enumerate(r["ranks"]):
        ddp = results["DDP"]
        for name in NAMES:
            row = results[name]
            if row is None:
                lines.append(f"{rank:>4} {name:<12} TODO (your ZeroStage3 is not written yet)")
                continue
            m, model = row["memory"], 16.0 if name == "DDP" else 16.0 / n
            lines.append(f"{rank:>4} {name:<12} {m['params'] / mb:>10.2f} {m['grads'] / mb:>9.2f} "
                         f"{m['optimizer'] / mb:>9.2f} {m['total'] / mb:>9.2f} {m['total'] / psi:>6.2f} {model:>6.2f} "
                         f"{m['total'] / psi / model:>10.3f} {m['total'] / ddp['memory']['total']:>6.3f}x "
                         f"{row['step_s'] * 1e3:>8.1f} {row['step_s'] / ddp['step_s']:>6.2f}x "
                         f"{row['checkpoint_bytes'] / mb:>9.2f} "
                         f"{row['checkpoint_bytes'] / r['ranks'][0]['DDP']['checkpoint_bytes']:>8.3f}x")
        lines.append("")
    lines += ["checkpoint: DDP = one torch.save by rank 0 (model + optimizer state_dicts, all of it); fully_shard = "
              "dcp.save of get_state_dict(model, optimizer), each rank its shards (rank 0 also .metadata), "
              "reshardable to another world size; ZeRO-3 = torch.save of each rank's sharded state_dict and "
              "optimizer state_dict (its flat shards: same world size only).",
              "A step time is one machine's, at one moment: read the ratios, measured side by side, not the ms."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--width", type=int, default=1024, help="hidden width (default 1024: ~3.2M parameters with 4 layers)")
    parser.add_argument("--layers", type=int, default=4, help="Linear layers (default 4)")
    parser.add_argument("--batch", type=int, default=8, help="samples per rank (default 8)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per implementation (default 5)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the world is declared hung")
    parser.add_argument("--learner", action="store_true", help="measure YOUR phase2_advanced/zero/ as ZeRO-3")
    parser.add_argument("--json", metavar="PATH", help="write the raw numbers as JSON")
    args = parser.parse_args(argv)
    if args.nproc < 2 or args.width < 1 or args.layers < 1 or args.batch < 1 or args.steps < 1:
        parser.error("need --nproc >= 2, --width >= 1, --layers >= 1, --batch >= 1, --steps >= 1")
    results = run(args)
    print(report(results, args))
    save_outputs(results, args.json)


if __name__ == "__main__":
    main()
