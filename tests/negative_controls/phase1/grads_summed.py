"""sync_gradients sums the gradients over ranks and never divides: the step is p times too big."""
import torch.distributed as dist

from solutions.phase1_data_parallel.trainer import *  # noqa: F401,F403

EXERCISE = "1.4"
CAUGHT_BY = ["test_1_4_sync_gradients_equals_full_batch_gradient"]


def sync_gradients(model, local_batch_size):
    for param in model.parameters():
        dist.all_reduce(param.grad)
