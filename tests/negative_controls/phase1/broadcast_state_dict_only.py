"""broadcast_parameters broadcasts the tensors of model.state_dict(): a buffer registered with persistent=False is not in it and stays different per rank."""
import torch
import torch.distributed as dist

from solutions.phase1_data_parallel.trainer import *  # noqa: F401,F403

EXERCISE = "1.4"
CAUGHT_BY = ["test_1_4_broadcast_reaches_every_kind_of_state_in_place"]


def broadcast_parameters(model, src=0):
    with torch.no_grad():
        for tensor in model.state_dict().values():  # detached aliases: in place, but no non-persistent buffer
            dist.broadcast(tensor, src=src)
