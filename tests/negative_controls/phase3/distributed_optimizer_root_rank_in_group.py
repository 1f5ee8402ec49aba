"""broadcast_parameters and broadcast_optimizer_state read `root_rank` as a rank of `group` (group_src=) instead of a global rank: the same thing on the world group, another rank (or none) on a subgroup without global rank 0."""
import torch
import torch.distributed as dist
import torch.nn as nn

from solutions.phase3_multi_node import distributed_optimizer as _reference
from solutions.phase3_multi_node.distributed_optimizer import *  # noqa: F401,F403
from solutions.phase3_multi_node.distributed_optimizer import _TensorSpec, _world_size

EXERCISE = "3.5"
CAUGHT_BY = ["test_3_5_broadcasts_on_a_group_without_rank_0"]


def broadcast_parameters(params, root_rank=0, group=None):
    if _world_size(group) == 1:
        return
    if isinstance(params, nn.Module):
        tensors = list(params.state_dict().values())
    elif isinstance(params, dict):
        tensors = list(params.values())
    else:
        tensors = list(params)
    with torch.no_grad():
        works = [dist.broadcast(t, group_src=root_rank, group=group, async_op=True) for t in tensors]  # the bug
    for work in works:
        work.wait()


def broadcast_optimizer_state(optimizer, root_rank=0, group=None):
    if _world_size(group) == 1:
        return
    is_root = dist.get_rank(group) == root_rank  # the bug: a group rank compared with root_rank
    params = [p for g in optimizer.param_groups for p in g["params"]]
    sent = optimizer.state_dict() if is_root else None
    structure = [None]
    if is_root:
        structure[0] = {
            "param_groups": sent["param_groups"],
            "state": {i: {key: _TensorSpec(tuple(v.shape), v.dtype, v.device.type == "cpu")
                          if isinstance(v, torch.Tensor) else v for key, v in entry.items()}
                      for i, entry in sent["state"].items()},
        }
    dist.broadcast_object_list(structure, group_src=root_rank, group=group)
    structure = structure[0]
    state, works, moves = {}, [], []
    for i, entry in structure["state"].items():
        state[i] = {}
        for key, value in entry.items():
            if isinstance(value, _TensorSpec):
                buffer = sent["state"][i][key].to(params[i].device) if is_root else \
                    torch.empty(value.shape, dtype=value.dtype, device=params[i].device)
                works.append(dist.broadcast(buffer, group_src=root_rank, group=group, async_op=True))
                moves.append((state[i], key, buffer, value.on_cpu))
                value = buffer
            state[i][key] = value
    for work in works:
        work.wait()
    for entry, key, buffer, on_cpu in moves:
        if on_cpu:
            entry[key] = buffer.cpu()
    if not is_root:
        optimizer.load_state_dict({"state": state, "param_groups": structure["param_groups"]})
