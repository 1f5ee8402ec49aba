"""What the production trainer costs over a bare torch DDP loop, and what a checkpoint costs.

    python benchmarks/trainer_overhead.py                    # digits and synthetic 32x32, ResNet-18
    python benchmarks/trainer_overhead.py --cases digits --steps 40 --repeats 3 --json out.json
    python benchmarks/trainer_overhead.py --cases resnet50_224 --nproc 1 --compile   # on a GPU

Both run in the same 2-rank world, one after the other, in alternating order (bare then
trainer, trainer then bare, ...) so that drift of a shared machine hits both alike: same model, data, global
batch, optimizer, LR schedule and number of steps. The bare loop is what torchvision's
reference script does (references/classification/train.py, its epoch loop): evaluate, then
torch.save the checkpoint twice on rank 0 (model_{epoch}.pth, and checkpoint.pth in place)
at every epoch's end.
The trainer runs with the same schedule of saves (epoch ends; its atomic, fsynced,
checksummed ones) so the ratio is the cost of its machinery: the per-step SIGTERM
agreement, the step timer, metrics, straggler gathers, per-sample seeding of the data,
the complete state (every rank's RNG gathered). The clock is the same for both: rank 0's
wall time at the end of every step from `--warmup` to `--steps` (the trainer's from its
per-step metrics lines). Two ratios come of it:

    per step   median step time, trainer / bare: the steady-state cost of the machinery,
               robust to the bursts of a shared machine (a slow step is one sample of 40)
    window     the whole span, trainer / bare: epoch-end evaluations and saves included,
               what a user's clock shows; on a noisy machine its pairs spread widely

The periodic checkpoints the trainer adds (every --checkpoint-every steps) are reported
apart: one save of the full training state divided by the compute it protects,
--checkpoint-every steps of the bare loop.

--compile: both compiled, the pair the trainer's --compile is held to: torch.compile(DDP(model))
with its loss and optimizer outside the graph, as torch's DDP tutorial writes it, against the
trainer with --compile. With one rank a third loop runs in each pair, torch.compile(model)
without DDP ("bare plain"): on one rank the trainer holds no DDP (nothing to reduce), and
that loop is its like. Each loop compiles its own model (the inductor caches make the second
compile of a graph cheap); the steps before --warmup hold the compilation and are left out.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
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
from solutions.phase4_production.trainer.cli import default_nproc  # noqa: E402
from solutions.phase4_production.trainer.config import TrainConfig  # noqa: E402
from solutions.phase4_production.trainer.data import build_datasets, eval_loader, input_stats  # noqa: E402
from solutions.phase4_production.trainer.device_stage import DeviceBatches, InputStage  # noqa: E402
from solutions.phase4_production.trainer.evaluator import evaluate as trainer_evaluate  # noqa: E402
from solutions.phase4_production.trainer.loop import train  # noqa: E402
from solutions.phase4_production.trainer.step import autocast_dtype, lr_schedule, make_optimizer  # noqa: E402

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


def bare_ddp(cfg: TrainConfig, steps: int, warmup: int, save_folder: str, ddp: bool = True) -> dict:
    """The plain loop: DistributedSampler, DataLoader, DDP (or the model alone: ddp=False, one
    rank), the trainer's optimizer and LR schedule, uint8 images made floats on the device (as
    the trainer's input stage does), torch.compile of the wrapped model with --compile.
    Returns rank 0's wall time at the end of steps warmup..steps ("ends") and the seconds of
    one save of the trainer's full checkpoint ("save_s")."""
    rank, world = dist.get_rank(), dist.get_world_size()
    train_set, test_set, shape, classes = build_datasets(cfg.data.dataset, cfg.data.data_root, cfg.data.image_size,
                                                         cfg.data.synthetic_size)
    per_rank = cfg.data.global_batch // world
    sampler = DistributedSampler(train_set, world, rank, shuffle=True, seed=cfg.run.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=per_rank, sampler=sampler, drop_last=True, num_workers=cfg.data.workers,
                        pin_memory=torch.cuda.is_available(), persistent_workers=cfg.data.workers > 0)
    device = current_device()
    torch.backends.cudnn.benchmark = True  # as the trainer (and torchvision's reference) sets it
    dtype = autocast_dtype(cfg.optim.amp, device)
    channels_last = torch.channels_last if device.type == "cuda" else torch.preserve_format
    model = build_model(cfg.model.name, shape, classes, seed=cfg.run.seed).to(device, memory_format=channels_last)
    net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) if ddp else model
    net = torch.compile(net) if cfg.model.compile else net
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    optimizer = make_optimizer(cfg.optim, model, cfg.data.global_batch)
    steps_per_epoch = len(train_set) // cfg.data.global_batch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(steps_per_epoch, cfg.optim.epochs,
                                                                         cfg.optim.warmup_epochs))
    tests = eval_loader(test_set, rank, world, per_rank, cfg.data.workers, torch.cuda.is_available())
    stats = input_stats(cfg.data.dataset, cfg.data.image_size)
    mean, std = ((torch.tensor(v, device=device).view(1, -1, 1, 1) for v in stats) if stats else (0.0, 1.0))
    loss_fn = nn.CrossEntropyLoss()
    step, epoch, ends = 0, 0, []
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x = x.to(device, non_blocking=True, memory_format=channels_last)
            if x.dtype == torch.uint8:
                x = (x.float() / 255 - mean) / std
            y = y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = loss_fn(net(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            if step % steps_per_epoch == 0:  # torchvision's reference: evaluate, then save twice, every epoch
                evaluate(model, tests, device, dtype, stats)
                if rank == 0:
                    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                  "lr_scheduler": scheduler.state_dict(), "epoch": epoch, "args": cfg.flat()}
                    torch.save(checkpoint, f"{save_folder}.model_{epoch}.pth")
                    torch.save(checkpoint, f"{save_folder}.checkpoint.pth")
            if step >= warmup:
                ends.append(_now(device))
            if step == steps:
                break
        epoch += 1
    state = training_state(model, optimizer, scheduler, scaler)  # collective: every rank's RNG
    started = time.perf_counter()
    CheckpointManager(save_folder, keep=1).save(step, state)
    return {"ends": ends, "save_s": time.perf_counter() - started}


def evaluate(model: nn.Module, batches, device: torch.device, dtype, stats) -> None:
    """The trainer's evaluation, on the loader's batches made floats as the bare loop's."""
    if stats is None:
        trainer_evaluate(model, batches, device, dtype)
        return
    trainer_evaluate(model, DeviceBatches(batches, InputStage(device, stats), device), device, dtype)


def trainer_run(cfg: TrainConfig, warmup: int) -> dict:
    """The trainer itself (a metrics line every step); rank 0's step ends read from the
    timestamps of its metrics.jsonl."""
    train(cfg)
    if dist.get_rank() != 0:
        return {}
    times = {}
    for line in (Path(cfg.run.output_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "train":
            times[record["step"]] = record["time"]
    return {"ends": [times[s] for s in range(warmup, cfg.run.max_steps + 1)]}


def _rank(cases: list[str], steps: int, warmup: int, repeats: int, compiled: bool) -> dict:
    results = {}
    plain = compiled and dist.get_world_size() == 1  # the trainer's like on one rank: no DDP
    for case in cases:
        rows = {"bare": [], "trainer": [], "save_s": [], **({"bare_plain": []} if plain else {})}
        for repeat in range(repeats):
            with tempfile.TemporaryDirectory() as tmp:
                out = [tmp]
                dist.broadcast_object_list(out)  # one folder for the world: rank 0 writes, all read
                cfg = TrainConfig.from_flat(dict(**CASES[case], output_dir=f"{out[0]}/run", max_steps=steps,
                                                 log_every=1, checkpoint_every=10**9, progress=False,
                                                 tensorboard=False, compile=compiled))
                loops = {"bare": lambda: bare_ddp(cfg, steps, warmup, f"{out[0]}/bare"),
                         "trainer": lambda: trainer_run(cfg, warmup)}
                if plain:
                    loops["bare_plain"] = lambda: bare_ddp(cfg, steps, warmup, f"{out[0]}/plain", ddp=False)
                order = list(loops) if repeat % 2 == 0 else list(loops)[::-1]  # drift hurts each alike
                ran = {name: loops[name]() for name in order}
                rows["bare"].append(ran["bare"]["ends"])
                rows["save_s"].append(ran["bare"]["save_s"])
                rows["trainer"].append(ran["trainer"].get("ends"))
                if plain:
                    rows["bare_plain"].append(ran["bare_plain"]["ends"])
                dist.barrier()  # nobody deletes the folder while another rank still reads it
        results[case] = rows
    return results


def compare(bare: list[list[float]], trainer: list[list[float]]) -> dict:
    """Ratios of the trainer to the bare loop from each pair's step ends (rank 0's clock):
    per step (median step times) and window (whole spans); the medians over the pairs."""
    bare_steps = [[b - a for a, b in zip(ends, ends[1:])] for ends in bare]
    trainer_steps = [[b - a for a, b in zip(ends, ends[1:])] for ends in trainer]
    step_ratios = [statistics.median(t) / statistics.median(b) for b, t in zip(bare_steps, trainer_steps)]
    window_ratios = [(t[-1] - t[0]) / (b[-1] - b[0]) for b, t in zip(bare, trainer)]
    return {"bare_step_s": statistics.median(x for pair in bare_steps for x in pair),
            "trainer_step_s": statistics.median(x for pair in trainer_steps for x in pair),
            "step_ratio": statistics.median(step_ratios), "step_ratios": step_ratios,
            "window_ratio": statistics.median(window_ratios), "window_ratios": window_ratios}


def _span(values: list[float]) -> str:
    return f"({min(values):.3f}-{max(values):.3f})"


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=DEFAULT_CASES,
                        help="resnet50_224 is for GPUs (AMP, channels_last)")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: one per GPU, else 2)")
    parser.add_argument("--steps", type=int, default=45, help="steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out at the start of each run")
    parser.add_argument("--repeats", type=int, default=4, help="bare/trainer pairs per case")
    parser.add_argument("--checkpoint-every", type=int, default=20,
                        help="the checkpoint interval the save's cost is set against (the trainer's default)")
    parser.add_argument("--compile", action="store_true",
                        help="both loops under torch.compile (bare: torch.compile(DDP(model)); one rank: also "
                             "torch.compile(model) alone)")
    parser.add_argument("--json", help="write the raw numbers here")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps <= args.warmup or args.repeats < 1:
        parser.error("need 1 <= --warmup < --steps and --repeats >= 1")
    nproc = args.nproc or default_nproc()
    results = run_world(_rank, nproc, args=(args.cases, args.steps, args.warmup, args.repeats, args.compile),
                        timeout=3600)[0]
    print(f"{nproc} ranks ({'GPU' if torch.cuda.is_available() else 'CPU'}){', compiled' if args.compile else ''}; "
          f"steps {args.warmup + 1}..{args.steps}, "
          f"{args.repeats} alternating pairs per case; both evaluate and save at epoch ends; "
          f"save/interval: one full checkpoint over {args.checkpoint_every} bare steps")
    print(f"{'case':<12}{'bare s/step':>12}{'trainer s/step':>15}{'per step':>10}{'(pairs)':>14}"
          f"{'window':>8}{'(pairs)':>14}{'save s':>8}{'save/interval':>14}")
    for case, rows in results.items():
        summary = compare(rows["bare"], rows["trainer"])
        save = statistics.median(rows["save_s"])
        summary["save_fraction"] = save / (args.checkpoint_every * summary["bare_step_s"])
        rows.update(summary)
        print(f"{case:<12}{summary['bare_step_s']:>12.3f}{summary['trainer_step_s']:>15.3f}"
              f"{summary['step_ratio']:>10.3f}{_span(summary['step_ratios']):>14}"
              f"{summary['window_ratio']:>8.3f}{_span(summary['window_ratios']):>14}"
              f"{save:>8.3f}{summary['save_fraction']:>14.1%}")
        if "bare_plain" in rows:  # the trainer against torch.compile(model) without DDP, the same pairs
            plain = compare(rows["bare_plain"], rows["trainer"])
            rows["vs_bare_plain"] = plain
            print(f"{'  no DDP':<12}{plain['bare_step_s']:>12.3f}{plain['trainer_step_s']:>15.3f}"
                  f"{plain['step_ratio']:>10.3f}{_span(plain['step_ratios']):>14}"
                  f"{plain['window_ratio']:>8.3f}{_span(plain['window_ratios']):>14}")
    print("target: trainer/bare <= 1.05 (at most 5% slower). per step: ratio of median step times (steady state); "
          "window: ratio of whole spans, epoch-end work included; (pairs): lowest and highest pair")
    save_outputs(results, args.json)


if __name__ == "__main__":
    main()
