"""train_step zeroes the gradients after optimizer.step() instead of before the backward: whatever .grad held when it was called is added into the first step."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from solutions.phase1_data_parallel.trainer import *  # noqa: F401,F403

EXERCISE = "1.4"
CAUGHT_BY = ["test_1_4_train_step_matches_single_process"]


def train_step(model, optimizer, inputs, targets):
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    sync_gradients(model, len(inputs))  # noqa: F405
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    stats = torch.tensor([loss.item() * len(inputs), len(inputs)], dtype=torch.float64, device=inputs.device)
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()
