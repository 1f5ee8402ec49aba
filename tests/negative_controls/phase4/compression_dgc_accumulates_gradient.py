"""topk_hook under momentum keeps error feedback on the raw gradient (v += g) and applies the momentum to the sparse average it receives: at ratio 1.0 that is momentum SGD, but a delayed entry loses the momentum history of the steps it waited (what DGC's momentum correction fixes)."""
import torch
import torch.distributed as dist

from solutions.phase4_production.compression import *  # noqa: F401,F403
from solutions.phase4_production.compression import allreduce_mean, allreduce_with_momentum, topk_count

EXERCISE = "4.4"
CAUGHT_BY = ["test_4_4_dgc_factor_masking_per_bucket"]


def topk_hook(state, bucket):
    group = state.group()
    buffer = bucket.buffer()
    if state.iter < state.start_iter:
        state.record(bucket, buffer.numel() * buffer.element_size())
        if state.momentum or state.weight_decay:
            return allreduce_with_momentum(state, bucket)
        return allreduce_mean(buffer, group)
    world = group.size()
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        g.add_(p.detach(), alpha=state.decay_of(p))
    u, v = state.memory(bucket)
    v.add_(buffer)  # the gradient is accumulated, not the velocity
    k = topk_count(v.numel(), state.ratio)
    indices = v.abs().topk(k, sorted=False).indices
    values = v[indices]
    v.index_fill_(0, indices, 0.0)
    all_values, all_indices = values.new_empty(world * k), indices.new_empty(world * k)
    state.record(bucket, values.numel() * values.element_size() + indices.numel() * indices.element_size())
    dist.all_gather_into_tensor(all_values, values, group=group)
    dist.all_gather_into_tensor(all_indices, indices, group=group)
    buffer.zero_()
    for r in range(world):
        buffer.index_add_(0, all_indices[r * k:(r + 1) * k], all_values[r * k:(r + 1) * k])
    buffer.div_(world)
    if u is not None:  # momentum on the sparse average: the same on every rank
        u.mul_(state.momentum).add_(buffer)
        if state.nesterov:
            buffer.add_(u, alpha=state.momentum)
        else:
            buffer.copy_(u)
    done = torch.futures.Future()
    done.set_result(buffer)
    return done
