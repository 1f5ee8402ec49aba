"""Each rank takes the slice of the global batch of its tp index, not its dp index: one replica's shards see different rows."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from solutions.phase2_advanced.mesh import *  # noqa: F401,F403
from solutions.phase2_advanced.tensor_parallel import ParallelMLP

EXERCISE = "2.8"
CAUGHT_BY = ["test_2_8_training_on_the_mesh_equals_one_process"]


def train(full, x, y, groups, *, steps, lr):
    model = ParallelMLP.from_full(full, group=groups.tp)
    dp_size, index = dist.get_world_size(groups.dp), dist.get_rank(groups.tp) % dist.get_world_size(groups.dp)
    x_d, y_d = x.chunk(dp_size)[index], y.chunk(dp_size)[index]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        F.mse_loss(model(x_d), y_d).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=groups.dp)
            p.grad /= dp_size
        optimizer.step()
    return model
