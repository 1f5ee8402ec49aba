"""powersgd_hook seeds the global CPU generator for a fresh Q (torch.default_generator.manual_seed, so no
CUDA generator is touched) and never restores it: every rank's CPU stream is reset to the same seed, and the
training's own draws (dropout on the CPU, shuffling, augmentation) change."""
import torch
import torch.distributed as dist

from solutions.phase4_production.compression import *  # noqa: F401,F403
from solutions.phase4_production.compression import allreduce_mean, orthogonalize_, split_bucket

EXERCISE = "4.4"
CAUGHT_BY = ["test_4_4_powersgd_leaves_global_generators_alone"]


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> Future:
    """The reference, with a fresh Q drawn from the global CPU generator."""
    group = state.group()
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.record(bucket, buffer.numel() * buffer.element_size())
        return allreduce_mean(buffer, group)
    world = group.size()
    index = bucket.index()
    epsilon = state.orthogonalization_epsilon
    before = None
    if state.use_error_feedback:
        if index in state.error_dict:
            buffer.add_(state.error_dict[index])
        else:
            state.error_dict[index] = torch.zeros_like(buffer)
        before = buffer.clone()

    split = split_bucket(bucket.gradients(), state)
    flat = torch.cat([t.view(-1) for t in split.uncompressed]) if split.uncompressed else buffer.new_empty(0)
    fresh = not state.warm_start or index not in state.p_memory_dict
    if fresh:
        state.p_memory_dict[index] = buffer.new_empty(split.p_numel)
        state.q_memory_dict[index] = buffer.new_empty(split.q_numel)
    ps = split.low_rank_views(state.p_memory_dict[index], "p")
    qs = split.low_rank_views(state.q_memory_dict[index], "q")
    if fresh:
        torch.default_generator.manual_seed(state.rng.randint(1_000_000_000))  # "no CUDA generator touched"
        for q in qs:
            q.copy_(torch.randn(*q.shape, device="cpu", dtype=buffer.dtype))
            orthogonalize_(q, epsilon)
    else:
        for q in qs:
            orthogonalize_(q, epsilon)
    for matrix, q, p in zip(split.matrices, qs, ps):
        torch.bmm(matrix, q, out=p)
    state.record(bucket, (flat.numel() + split.p_numel + split.q_numel) * buffer.element_size())

    # Every collective is issued here, on the hook's thread, in bucket order. (torch's hook issues
    # the P and Q all-reduces from future callbacks, which gloo runs on its own threads: with
    # more than one bucket, ranks then issue them in different orders and gloo aborts.)
    if flat.numel():
        dist.all_reduce(flat, group=group)
        flat.div_(world)
    offset = 0
    for tensor in split.uncompressed:
        tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
    dist.all_reduce(state.p_memory_dict[index], group=group)
    for p in ps:  # P's scale does not matter: orthogonalisation removes it (no / p here)
        orthogonalize_(p, epsilon)
    for matrix, p, q in zip(split.matrices, ps, qs):
        torch.bmm(matrix.transpose(1, 2), p, out=q)
    dist.all_reduce(state.q_memory_dict[index], group=group)
    state.q_memory_dict[index].div_(world)
    for p, q, matrix in zip(ps, qs, split.matrices):
        torch.bmm(p, q.transpose(1, 2), out=matrix)
    split.copy_back()
    if state.use_error_feedback:
        state.error_dict[index] = before - buffer
    if not state.warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    done = torch.futures.Future()
    done.set_result(buffer)
    return done
