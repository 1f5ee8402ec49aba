"""sync_gradients syncs every parameter, frozen ones included: a frozen parameter gets a zero .grad, which weight decay and momentum then use to move it."""
import torch
import torch.distributed as dist

from solutions.phase1_data_parallel.trainer import *  # noqa: F401,F403

EXERCISE = "1.4"
CAUGHT_BY = ["test_1_4_sync_gradients_with_frozen_and_tied_parameters"]


def sync_gradients(model, local_batch_size, group=None):
    params = list(model.parameters())
    count = torch.tensor([float(local_batch_size)], dtype=torch.float64, device=params[0].device)
    dist.all_reduce(count, group=group)
    weight = local_batch_size / count[0]
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        param.grad.mul_(weight)
        dist.all_reduce(param.grad, group=group)
