"""assign_buckets walks the parameters in registration order: the first bucket holds the first layers, whose gradients come LAST, so nothing can be launched until backward is over."""
from solutions.phase3_multi_node import bucketed_ddp as _reference
from solutions.phase3_multi_node.bucketed_ddp import *  # noqa: F401,F403

EXERCISE = "3.2"
CAUGHT_BY = ["test_3_2_assign_buckets_follows_the_rule", "test_3_2_all_reduce_launched_during_backward"]


def assign_buckets(params, cap_bytes):
    closed, open_buckets = [], {}
    for index, param in enumerate(params):  # the bug: forward, not reversed
        if not param.requires_grad:
            continue
        indices, size = open_buckets.setdefault((param.dtype, param.device), ([], [0]))
        indices.append(index)
        size[0] += param.numel() * param.element_size()
        if size[0] >= cap_bytes:
            closed.append(indices)
            del open_buckets[(param.dtype, param.device)]
    return closed + [indices for indices, _ in open_buckets.values()]


class BucketedDDP(_reference.BucketedDDP):
    def _build_buckets(self, cap_bytes):
        real = _reference.assign_buckets
        _reference.assign_buckets = assign_buckets  # the reference's __init__ looks it up in its module
        try:
            super()._build_buckets(cap_bytes)
        finally:
            _reference.assign_buckets = real
