"""sync_gradients skips parameters whose .grad is None: a parameter unused on one rank desynchronises the collectives."""
import torch
import torch.distributed as dist

from solutions.phase1_data_parallel.trainer import *  # noqa: F401,F403

EXERCISE = "1.4"
CAUGHT_BY = ["test_1_4_sync_gradients_with_a_parameter_unused_on_one_rank"]


def sync_gradients(model, local_batch_size, group=None):
    params = [p for p in model.parameters() if p.requires_grad]
    count = torch.tensor([float(local_batch_size)], dtype=torch.float64)
    dist.all_reduce(count, group=group)
    for param in params:
        if param.grad is None:
            continue
        param.grad.mul_(local_batch_size / count[0])
        dist.all_reduce(param.grad, group=group)
