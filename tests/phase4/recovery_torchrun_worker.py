"""One rank of the 4.2 torchrun tests: a small DDP run driven by the graded run_resumable.

Started by a real torchrun agent (`python -m torch.distributed.run ... this_file`); the
graded module comes from COURSE_GRADE_KIND / COURSE_GRADE_LOCATION, the run's settings
from COURSE_RECOVERY_FOLDER, COURSE_RECOVERY_STEPS, COURSE_RECOVERY_EVERY and the faults
from COURSE_FAULTS (the solution's FaultInjector.from_env). Every step a rank runs is
appended to $COURSE_RESULT_DIR/rank<R>.steps as "<restart> <step>" (a killed attempt
leaves its steps there); an attempt that returns writes
$COURSE_RESULT_DIR/rank<R>.attempt<K>.pkl: its RunOutcome and the final parameters. A rank
that raises writes its error there and exits non-zero, so its agent stops the job.

`train` is also what the tests run under common.launch.run_world for the uninterrupted
reference: the same model, data and loop, with no fault.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent.parent
if str(_TESTS) not in sys.path:
    sys.path[:0] = [str(_TESTS), str(_TESTS.parent)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import grading  # noqa: E402

GLOBAL_BATCH = 16


def build(seed: int = 0):
    """(DDP model with dropout, SGD with momentum): every rank starts from the same weights."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, optimizer


def batch(step: int, rank: int, world: int):
    """Rank `rank`'s share of global batch `step` (the same global batch at any world size)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=gen)
    y = torch.randint(0, 4, (GLOBAL_BATCH,), generator=gen)
    return x[rank::world], y[rank::world]


def train(mod, folder: str, total_steps: int, every: int, injector=None, log: Path | None = None) -> dict:
    """Run (or resume) the run in `folder` with the graded run_resumable; returns plain data."""
    from solutions.phase4_production.checkpoint import CheckpointManager

    torch.manual_seed(1234 + dist.get_rank())  # dropout masks differ per rank, as in real runs
    model, optimizer = build()
    injector = injector if injector is not None else mod.FaultInjector()
    model.register_comm_hook(None, injector.allreduce_hook)

    def train_step(ctx) -> None:
        if log is not None:
            with open(log, "a") as f:
                f.write(f"{ctx.attempt.restart} {ctx.step}\n")
        x, y = batch(ctx.step, ctx.attempt.rank, ctx.attempt.world_size)
        ctx.phase("forward")
        loss = F.cross_entropy(model(x), y)
        ctx.phase("backward")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    outcome = mod.run_resumable(train_step, model, optimizer, CheckpointManager(folder, keep=2),
                                total_steps=total_steps, every=every, injector=injector)
    return {"start_step": outcome.start_step, "steps_done": outcome.steps_done, "preempted": outcome.preempted,
            "rank": outcome.attempt.rank, "world_size": outcome.attempt.world_size,
            "restart": outcome.attempt.restart,
            "params": {k: v.detach().clone() for k, v in model.module.named_parameters()}}


def main() -> None:
    from common.distributed import init_distributed
    from torchrun_worker import report_and_exit

    ref = grading.ModuleRef("4.2", os.environ["COURSE_GRADE_KIND"], os.environ["COURSE_GRADE_LOCATION"])
    result_dir = Path(os.environ["COURSE_RESULT_DIR"])
    init_distributed(timeout_s=float(os.environ.get("COURSE_PG_TIMEOUT_S", "60")))
    rank, restart = dist.get_rank(), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    def work() -> dict:
        mod = ref.load()
        return train(mod, os.environ["COURSE_RECOVERY_FOLDER"], int(os.environ["COURSE_RECOVERY_STEPS"]),
                     int(os.environ["COURSE_RECOVERY_EVERY"]), mod.FaultInjector.from_env(),
                     log=result_dir / f"rank{rank}.steps")

    report_and_exit(work, result_dir / f"rank{rank}.attempt{restart}.pkl")


if __name__ == "__main__":
    main()
