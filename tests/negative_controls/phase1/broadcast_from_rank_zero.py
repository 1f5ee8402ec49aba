"""broadcast_parameters always broadcasts from rank 0, whatever src says."""
import torch
import torch.distributed as dist

from solutions.phase1_data_parallel.trainer import *  # noqa: F401,F403

EXERCISE = "1.4"
CAUGHT_BY = ["test_1_4_broadcast_parameters_and_buffers"]


def broadcast_parameters(model, src=0):
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor, src=0)
