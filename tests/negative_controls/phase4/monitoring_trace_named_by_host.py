"""training_profiler's trace handler is given no worker name: the traces are named <host>_<pid>.<time>..., and
the ranks of one run cannot be told apart from their file names."""
import torch

from solutions.phase4_production.monitoring import *  # noqa: F401,F403

EXERCISE = "4.5"
CAUGHT_BY = ["test_4_5_profiler_trace_named_by_rank"]


def training_profiler(folder, rank=0, wait=10, warmup=2, active=3, repeat=1):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=repeat),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(folder)),  # the bug: no worker_name
    )
