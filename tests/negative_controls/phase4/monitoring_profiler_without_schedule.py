"""training_profiler passes no schedule: the profiler records every step of the run (wait/warmup/active ignored), a trace that grows without end."""
import torch

from solutions.phase4_production.monitoring import *  # noqa: F401,F403

EXERCISE = "4.5"
CAUGHT_BY = ["test_4_5_profiler_trace_holds_the_scheduled_steps"]


def training_profiler(folder, rank=0, wait=10, warmup=2, active=3, repeat=1):
    return torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(folder), worker_name=f"rank{rank}"),
    )
