"""allreduce_with_momentum all-reduces the plain gradient (no momentum, no weight decay) before start_iter: momentum begins only when compression does, so the first steps are plain SGD and the hook's momentum starts from zero."""
from solutions.phase4_production.compression import *  # noqa: F401,F403
from solutions.phase4_production.compression import allreduce_mean
from solutions.phase4_production import compression as _reference

EXERCISE = "4.4"
CAUGHT_BY = ["test_4_4_dgc_full_ratio_equals_momentum_sgd", "test_4_4_dgc_factor_masking_per_bucket"]


def allreduce_with_momentum(state, bucket):
    return allreduce_mean(bucket.buffer(), state.group())


def topk_hook(state, bucket):
    if state.iter < state.start_iter:
        buffer = bucket.buffer()
        state.record(bucket, buffer.numel() * buffer.element_size())
        return allreduce_with_momentum(state, bucket)
    return _reference.topk_hook(state, bucket)
