"""training_profiler writes every cycle of a rank to the same file, rank<rank>.pt.trace.json: with repeat > 1 each cycle overwrites the one before, and only the last survives."""
import os

import torch

from solutions.phase4_production.monitoring import *  # noqa: F401,F403

EXERCISE = "4.5"
CAUGHT_BY = ["test_4_5_profiler_writes_one_trace_per_cycle"]


def training_profiler(folder, rank=0, wait=10, warmup=2, active=3, repeat=1):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def write(prof):
        os.makedirs(folder, exist_ok=True)
        prof.export_chrome_trace(os.path.join(folder, f"rank{rank}.pt.trace.json"))  # the bug: no time in the name

    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=repeat),
        on_trace_ready=write,
    )
