"""topk_hook sends the top k of the raw gradient and drops the rest: no residual, no error feedback, so 95 % of every step is lost."""
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
    world = group.size()
    k = topk_count(buffer.numel(), state.ratio)
    indices = buffer.abs().topk(k, sorted=False).indices
    values = buffer[indices]
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
