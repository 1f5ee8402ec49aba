"""broadcast_optimizer_state creates a fresh optimizer's state as Horovod does, with a step on zero
gradients, then broadcasts every state tensor in place: with decoupled weight decay (AdamW) that step moves
the parameters, which broadcast_parameters had just made equal, so the ranks start apart."""
import torch
import torch.distributed as dist

from solutions.phase3_multi_node.distributed_optimizer import *  # noqa: F401,F403

EXERCISE = "3.5"
CAUGHT_BY = ["test_3_5_broadcast_optimizer_state_to_fresh_optimizers"]


def broadcast_optimizer_state(optimizer, root_rank=0, group=None):
    if not optimizer.state_dict()["state"]:
        for param_group in optimizer.param_groups:
            for p in param_group["params"]:
                p.grad = torch.zeros_like(p)
        getattr(optimizer, "optimizer", optimizer).step()  # the wrapped one: no all-reduce
    state_dict = optimizer.state_dict()  # holds the live state tensors
    for i in sorted(state_dict["state"]):
        for key in sorted(state_dict["state"][i]):
            value = state_dict["state"][i][key]
            if isinstance(value, torch.Tensor):
                dist.broadcast(value, src=root_rank, group=group)
    options = [[{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]]
    dist.broadcast_object_list(options, src=root_rank, group=group)
    for param_group, received in zip(optimizer.param_groups, options[0]):
        param_group.update(received)
