"""topk_hook with momentum correction leaves weight decay out of the momentum and adds it to the update it returns, as SGD(momentum=0, weight_decay=wd) after the hook would: the decay is no longer amplified by 1/(1 - m) as in torch's momentum SGD."""
import torch
import torch.distributed as dist

from solutions.phase4_production.compression import *  # noqa: F401,F403
from solutions.phase4_production.compression import allreduce_mean, topk_count

EXERCISE = "4.4"
CAUGHT_BY = ["test_4_4_dgc_full_ratio_equals_momentum_sgd"]


def allreduce_with_momentum(state, bucket):
    params, gradients = bucket.parameters(), bucket.gradients()

    def step(fut):
        for p, d in zip(params, gradients):
            decay = state.decay_of(p)
            if state.momentum:
                u = state.param_momenta.get(p)
                if u is None:
                    u = state.param_momenta[p] = d.clone()
                else:
                    u.mul_(state.momentum).add_(d)
                if state.nesterov:
                    d.add_(u, alpha=state.momentum)
                else:
                    d.copy_(u)
            if decay:
                d.add_(p.detach(), alpha=decay)  # after the momentum
        return fut.value()

    return allreduce_mean(bucket.buffer(), state.group()).then(step)


def topk_hook(state, bucket):
    group = state.group()
    buffer = bucket.buffer()
    if state.iter < state.start_iter:
        state.record(bucket, buffer.numel() * buffer.element_size())
        if state.momentum or state.weight_decay:
            return allreduce_with_momentum(state, bucket)
        return allreduce_mean(buffer, group)
    world = group.size()
    params, gradients = bucket.parameters(), bucket.gradients()
    u, v = state.memory(bucket)
    if u is None:
        v.add_(buffer)
    else:
        u.mul_(state.momentum).add_(buffer)
        v.add_(buffer.add(u, alpha=state.momentum) if state.nesterov else u)
    k = topk_count(v.numel(), state.ratio)
    indices = v.abs().topk(k, sorted=False).indices
    values = v[indices]
    v.index_fill_(0, indices, 0.0)
    if u is not None and state.momentum_masking:
        u.index_fill_(0, indices, 0.0)
    all_values, all_indices = values.new_empty(world * k), indices.new_empty(world * k)
    state.record(bucket, values.numel() * values.element_size() + indices.numel() * indices.element_size())
    dist.all_gather_into_tensor(all_values, values, group=group)
    dist.all_gather_into_tensor(all_indices, indices, group=group)
    buffer.zero_()
    for r in range(world):
        buffer.index_add_(0, all_indices[r * k:(r + 1) * k], all_values[r * k:(r + 1) * k])
    buffer.div_(world)
    for p, d in zip(params, gradients):
        d.add_(p.detach(), alpha=state.decay_of(p))  # the decay joins the update, after the momentum
    done = torch.futures.Future()
    done.set_result(buffer)
    return done
