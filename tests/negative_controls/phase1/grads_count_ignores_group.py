"""sync_gradients sums the sample count over the whole world, not over `group`: every gradient is scaled by N_group / N_world."""
import torch
import torch.distributed as dist

from solutions.phase1_data_parallel.trainer import *  # noqa: F401,F403

EXERCISE = "1.4"
CAUGHT_BY = ["test_1_4_sync_gradients_averages_within_its_group"]


def sync_gradients(model, local_batch_size, group=None):
    params = [p for p in model.parameters() if p.requires_grad]
    count = torch.tensor([float(local_batch_size)], dtype=torch.float64)
    dist.all_reduce(count)
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        param.grad.mul_(local_batch_size / count[0])
        dist.all_reduce(param.grad, group=group)
