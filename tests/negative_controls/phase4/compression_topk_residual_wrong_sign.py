"""topk_hook keeps the residual as sent - accumulated (the wrong sign): the next step subtracts what it should add."""
import torch
import torch.distributed as dist

from solutions.phase4_production.compression import *  # noqa: F401,F403
from solutions.phase4_production.compression import allreduce_mean, topk_count

EXERCISE = "4.4"
CAUGHT_BY = ["test_4_4_topk_error_feedback_loses_nothing"]


def topk_hook(state, bucket):
    group = state.group()
    buffer = bucket.buffer()
    if state.iter < state.start_iter:
        state.record(bucket, buffer.numel() * buffer.element_size())
        return allreduce_mean(buffer, group)
    world, index = group.size(), bucket.index()
    accumulated = buffer + state.residuals[index] if state.use_error_feedback and index in state.residuals else buffer.clone()
    k = topk_count(accumulated.numel(), state.ratio)
    indices = accumulated.abs().topk(k, sorted=False).indices
    values = accumulated[indices]
    if state.use_error_feedback:
        sent = torch.zeros_like(accumulated)
        sent[indices] = values
        state.residuals[index] = sent - accumulated
    all_values, all_indices = values.new_empty(world * k), indices.new_empty(world * k)
    state.record(bucket, values.numel() * values.element_size() + indices.numel() * indices.element_size())
    dist.all_gather_into_tensor(all_values, values, group=group)
    dist.all_gather_into_tensor(all_indices, indices, group=group)
    buffer.zero_()
    for r in range(world):
        buffer.index_add_(0, all_indices[r * k:(r + 1) * k], all_values[r * k:(r + 1) * k])
    done = torch.futures.Future()
    done.set_result(buffer.div_(world))
    return done
