"""broadcast_parameters forgets the buffers (BatchNorm running statistics)."""
import torch
import torch.distributed as dist

from solutions.phase1_data_parallel.trainer import *  # noqa: F401,F403

EXERCISE = "1.4"
CAUGHT_BY = ["test_1_4_broadcast_parameters_and_buffers"]


def broadcast_parameters(model, src=0):
    with torch.no_grad():
        for param in model.parameters():
            dist.broadcast(param, src=src)
