"""f's backward is the identity (no all-reduce): the column-parallel INPUT gradient is partial on every rank.

The classic tensor-parallel bug (Megatron's f: identity forward, all-reduce backward). Forward
is right, so only gradients show it. The whole module is the reference with this one change,
so every layer built on f (column-parallel, MLP, attention) carries it, as in a learner's file.
"""
import inspect

from solutions.phase2_advanced import tensor_parallel as _reference

EXERCISE = "2.7"
CAUGHT_BY = [
    "test_2_7_f_g_gather_scatter_operators",
    "test_2_7_column_parallel_linear_matches_nn_linear",
    "test_2_7_parallel_mlp_matches_reference_one_allreduce_each_way",
    "test_2_7_parallel_attention_matches_reference_one_allreduce_each_way",
]

_SOURCE = inspect.getsource(_reference)
_F_BACKWARD = """        total = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=ctx.group)
        return total, None
"""
assert _SOURCE.count(_F_BACKWARD) == 1, "f's backward changed in the reference: update this control"
exec(compile(_SOURCE.replace(_F_BACKWARD, "        return grad, None\n"), _reference.__file__, "exec"))
