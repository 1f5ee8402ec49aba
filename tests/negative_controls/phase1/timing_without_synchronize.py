"""time_collective reads the clock while CUDA work is still queued (no torch.cuda.synchronize): it times the launches."""
import time

import torch
import torch.distributed as dist

from solutions.phase1_data_parallel.comm_bench import *  # noqa: F401,F403

EXERCISE = "1.3"
CAUGHT_BY = ["test_1_3_time_collective_waits_for_the_device"]


def time_collective(fn, tensor, iters=10, warmup=2, clock=time.perf_counter):
    for _ in range(warmup):
        fn(tensor)
    dist.barrier()
    start = clock()
    for _ in range(iters):
        fn(tensor)
    per_call = torch.tensor([(clock() - start) / iters], dtype=torch.float64, device=tensor.device)
    dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
    return per_call.item()
