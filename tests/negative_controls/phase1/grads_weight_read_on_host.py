"""sync_gradients turns the global count into a Python number (count.item()) to divide by: right gradients, but on a GPU the CPU waits for the device at every call."""
import torch
import torch.distributed as dist

from solutions.phase1_data_parallel.trainer import *  # noqa: F401,F403

EXERCISE = "1.4"
CAUGHT_BY = ["test_1_4_sync_gradients_never_waits_for_the_device"]


def sync_gradients(model, local_batch_size, group=None):
    params = [p for p in model.parameters() if p.requires_grad]
    count = torch.tensor([float(local_batch_size)], dtype=torch.float64, device=params[0].device)
    dist.all_reduce(count, group=group)
    weight = local_batch_size / count.item()  # a float: simpler to read, one host round trip per call
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        param.grad.mul_(weight)
        dist.all_reduce(param.grad, group=group)
