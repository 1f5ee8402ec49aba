"""What the production trainer costs over a bare torch DDP loop, and what a checkpoint costs.

    python benchmarks/trainer_overhead.py                    # digits and synthetic 32x32, ResNet-18
    python benchmarks/trainer_overhead.py --cases digits --steps 40 --repeats 3 --json out.json

Both run in the same 2-rank world, one after the other, alternating (bare, trainer, bare,
trainer, ...) so that drift of a shared machine hits both alike: same model, data, global
batch, optimizer, LR schedule and number of steps. The bare loop is what torchvision's
reference script does: evaluate and torch.save (rank 0, in place) at every epoch's end.
The trainer runs with the same schedule of saves (epoch ends; its atomic, fsynced,
checksummed ones) so the ratio is the cost of its machinery: the per-step SIGTERM
agreement, the step timer, metrics, straggler gathers, per-sample seeding of the data,
the complete state (every rank's RNG gathered). The clock is the same for both: wall time
from the end of step `--warmup` to the end of step `--steps` on rank 0.

The periodic checkpoints the trainer adds (every --checkpoint-every steps) are reported
apart: one save of the full training state divided by the compute it protects,
--checkpoint-every steps of the bare loop.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from benchmarks._util import OneLineParser, save_outputs  # noqa: E402
from common.distributed import current_device  # noqa: E402
from common.launch import run_world  # noqa: E402
from common.models import build_model  # noqa: E402
from solutions.phase4_production.checkpoint import CheckpointManager, training_state  # noqa: E402
from solutions.phase4_production.config import TrainConfig  # noqa: E402
from solutions.phase4_production.train import (autocast_dtype, default_nproc, evaluate, lr_schedule,  # noqa: E402
                                                make_optimizer, train)
from solutions.phase4_production.train_data import build_datasets, eval_loader  # noqa: E402

CASES = {
    "digits": dict(dataset="digits"),
    "synthetic32": dict(dataset="synthetic", image_size=32, synthetic_size=2048),
    # for GPUs (one rank per GPU): the "ResNet-50, AMP, channels_last, synthetic data"
    "resnet50_224": dict(dataset="synthetic", image_size=224, synthetic_size=8192, model="resnet50",
                         global_batch=256, reference_batch=256, workers=4),
}
DEFAULT_CASES = ["digits", "synthetic32"]


def _now(device: torch.device) -> float:
    """Wall time once the device has finished what was queued (the trainer's timestamps are
    taken after its step timer synchronised)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()


def bare_ddp(cfg: TrainConfig, steps: int, warmup: int, save_folder: str) -> dict:
    """The plain loop: DistributedSampler, DataLoader, DDP, the trainer's optimizer and LR
    schedule. Returns rank 0's seconds for steps (warmup, steps] and one checkpoint save."""
    rank, world = dist.get_rank(), dist.get_world_size()
    train_set, test_set, shape, classes = build_datasets(cfg.dataset, cfg.data_root, cfg.image_size, cfg.synthetic_size)
    per_rank = cfg.global_batch // world
    sampler = DistributedSampler(train_set, world, rank, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=per_rank, sampler=sampler, drop_last=True, num_workers=cfg.workers,
                        pin_memory=torch.cuda.is_available(), persistent_workers=cfg.workers > 0)
    device = current_device()
    dtype = autocast_dtype(cfg.amp, device)
    channels_last = torch.channels_last if device.type == "cuda" else torch.preserve_format
    model = build_model(cfg.model, shape, classes, seed=cfg.seed).to(device, memory_format=channels_last)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    optimizer = make_optimizer(cfg, model)
    steps_per_epoch = len(train_set) // cfg.global_batch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(steps_per_epoch, cfg.epochs,
                                                                         cfg.warmup_epochs))
    tests = eval_loader(test_set, rank, world, per_rank, cfg.workers, torch.cuda.is_available())
    loss_fn = nn.CrossEntropyLoss()
    step, epoch, begin = 0, 0, None
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x = x.to(device, non_blocking=True, memory_format=channels_last)
            y = y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = loss_fn(ddp(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            if step % steps_per_epoch == 0:  # torchvision's reference: evaluate and save every epoch
                evaluate(model, tests, device, dtype)
                if rank == 0:
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                               f"{save_folder}.epoch.pt")
            if step == warmup:
                begin = _now(device)
            if step == steps:
                break
        epoch += 1
    seconds = _now(device) - begin
    state = training_state(ddp, optimizer, scheduler, scaler)  # collective: every rank's RNG
    started = time.perf_counter()
    CheckpointManager(save_folder, keep=1).save(step, state)
    return {"seconds": seconds, "save_s": time.perf_counter() - started}


def trainer_run(cfg: TrainConfig, warmup: int) -> dict:
    """The trainer itself; the same span read from its metrics.jsonl timestamps (rank 0)."""
    train(cfg)
    if dist.get_rank() != 0:
        return {}
    times = {}
    for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "train":
            times[record["step"]] = record["time"]
    return {"seconds": times[cfg.max_steps] - times[warmup]}


def _rank(cases: list[str], steps: int, warmup: int, repeats: int) -> dict:
    results = {}
    for case in cases:
        rows = {"bare": [], "trainer": [], "save_s": []}
        for repeat in range(repeats):
            with tempfile.TemporaryDirectory() as tmp:
                out = [tmp]
                dist.broadcast_object_list(out)  # one folder for the world: rank 0 writes, all read
                cfg = replace(TrainConfig(), **CASES[case], output_dir=f"{out[0]}/run", max_steps=steps,
                              log_every=warmup, checkpoint_every=10**9, progress=False, tensorboard=False)
                bare = bare_ddp(cfg, steps, warmup, f"{out[0]}/bare")
                rows["bare"].append(bare["seconds"])
                rows["save_s"].append(bare["save_s"])
                rows["trainer"].append(trainer_run(cfg, warmup).get("seconds"))
                dist.barrier()  # nobody deletes the folder while another rank still reads it
        results[case] = rows
    return results


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=DEFAULT_CASES,
                        help="resnet50_224 is for GPUs (AMP, channels_last)")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: one per GPU, else 2)")
    parser.add_argument("--steps", type=int, default=45, help="steps per run (a multiple of --warmup)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out at the start of each run")
    parser.add_argument("--repeats", type=int, default=2, help="bare/trainer pairs per case")
    parser.add_argument("--checkpoint-every", type=int, default=20,
                        help="the checkpoint interval the save's cost is set against (the trainer's default)")
    parser.add_argument("--json", help="write the raw numbers here")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps <= args.warmup or args.steps % args.warmup or args.repeats < 1:
        parser.error("need 1 <= --warmup < --steps, --steps a multiple of --warmup, --repeats >= 1")
    nproc = args.nproc or default_nproc()
    results = run_world(_rank, nproc, args=(args.cases, args.steps, args.warmup, args.repeats), timeout=3600)[0]
    measured = args.steps - args.warmup
    print(f"{nproc} ranks ({'GPU' if torch.cuda.is_available() else 'CPU'}); seconds for steps {args.warmup + 1}..{args.steps} "
          f"({measured} steps), {args.repeats} alternating pair(s) per case; both evaluate and save at epoch ends; "
          f"save/interval: one full checkpoint over {args.checkpoint_every} bare steps")
    print(f"{'case':<12}{'bare s/step':>12}{'trainer s/step':>16}{'trainer/bare':>14}{'spread':>10}"
          f"{'save s':>9}{'save/interval':>15}")
    for case, rows in results.items():
        ratios = [t / b for t, b in zip(rows["trainer"], rows["bare"])]
        bare_step = statistics.median(rows["bare"]) / measured
        trainer_step = statistics.median(rows["trainer"]) / measured
        save = statistics.median(rows["save_s"])
        fraction = save / (args.checkpoint_every * bare_step)
        rows.update(ratio=statistics.median(ratios), ratios=ratios, save_fraction=fraction)
        print(f"{case:<12}{bare_step:>12.3f}{trainer_step:>16.3f}{statistics.median(ratios):>14.3f}"
              f"{max(ratios) - min(ratios):>10.3f}{save:>9.3f}{fraction:>15.1%}")
    print("trainer/bare <= 1.05 is the target (the trainer at most 5% slower); spread = max - min of the pairs")
    save_outputs(results, args.json)


if __name__ == "__main__":
    main()
