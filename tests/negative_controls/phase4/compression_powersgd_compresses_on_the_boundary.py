"""split_bucket compresses a matrix when (n + m) * r * min_compression_rate <= n * m: a matrix exactly on the
boundary is sent as P and Q (lossy, and no smaller) where torch's rule, strict <, all-reduces it whole."""
import types

from solutions.phase4_production import compression as _reference
from solutions.phase4_production.compression import *  # noqa: F401,F403
from solutions.phase4_production.compression import BucketSplit

EXERCISE = "4.4"
CAUGHT_BY = ["test_4_4_powersgd_compression_boundary_like_torch"]


def split_bucket(gradients, state):
    by_shape, uncompressed = {}, []
    for gradient in gradients:
        matrix = gradient.view(gradient.shape[0], -1)
        n, m = matrix.shape
        r = min(n, m, state.matrix_approximation_rank)
        if (n + m) * r * state.min_compression_rate <= n * m:  # the bug: <= instead of <
            by_shape.setdefault(matrix.shape, []).append(matrix)
        else:
            uncompressed.append(gradient)
    matrices, stacked_from = [], []
    for same in by_shape.values():
        groups = [same] if state.batch_tensors_with_same_shape else [[m] for m in same]
        for group in groups:
            matrices.append(group[0].unsqueeze(0) if len(group) == 1 else torch.stack(group))
            stacked_from.append(group)
    ranks = [min(m.shape[1], m.shape[2], state.matrix_approximation_rank) for m in matrices]
    return BucketSplit(matrices, uncompressed, ranks, stacked_from)


# powersgd_hook looks split_bucket up in its module's globals: the reference's body, run with this one.
powersgd_hook = types.FunctionType(_reference.powersgd_hook.__code__, dict(vars(_reference), split_bucket=split_bucket),
                                   "powersgd_hook", _reference.powersgd_hook.__defaults__)
