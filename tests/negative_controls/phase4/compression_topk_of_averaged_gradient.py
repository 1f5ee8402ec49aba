"""topk_hook all-reduces the dense gradient first and sparsifies the average: every byte is still sent, and it reports only the k it kept."""
import torch
import torch.distributed as dist

from solutions.phase4_production.compression import *  # noqa: F401,F403
from solutions.phase4_production.compression import allreduce_mean, topk_count

EXERCISE = "4.4"
CAUGHT_BY = ["test_4_4_bytes_per_step_are_what_was_sent"]


def topk_hook(state, bucket):
    group = state.group()
    buffer = bucket.buffer()
    if state.iter < state.start_iter:
        state.record(bucket, buffer.numel() * buffer.element_size())
        return allreduce_mean(buffer, group)
    index = bucket.index()
    dist.all_reduce(buffer, group=group)
    accumulated = buffer.div_(group.size())
    if state.use_error_feedback and index in state.residuals:
        accumulated += state.residuals[index]
    k = topk_count(accumulated.numel(), state.ratio)
    indices = accumulated.abs().topk(k, sorted=False).indices
    state.record(bucket, k * (accumulated.element_size() + indices.element_size()))
    values = accumulated[indices]
    if state.use_error_feedback:
        residual = accumulated.clone()
        residual[indices] = 0.0
        state.residuals[index] = residual
    buffer.zero_()
    buffer[indices] = values
    done = torch.futures.Future()
    done.set_result(buffer)
    return done
