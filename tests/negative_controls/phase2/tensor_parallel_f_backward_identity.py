"""f's backward is the identity (no all-reduce): the column-parallel INPUT gradient is partial on every rank.

The classic tensor-parallel bug (Megatron's f: identity forward, all-reduce backward). Forward
is right, so only gradients show it. The whole module is the reference with this one change,
so every layer built on f (column-parallel, MLP, attention) carries it, as in a learner's file."""

EXERCISE = "2.7"
CAUGHT_BY = [
    "test_2_7_f_g_gather_scatter_operators",
    "test_2_7_column_parallel_linear_matches_nn_linear",
    "test_2_7_parallel_mlp_matches_reference_one_allreduce_each_way",
    "test_2_7_parallel_attention_matches_reference_one_allreduce_each_way",
]
EDITS = {
    "CopyToTensorParallelRegion.backward": [
        ("        total = grad.clone(memory_format=torch.contiguous_format)\n"
         "        dist.all_reduce(total, group=ctx.group)\n"
         "        return total, None\n",
         "        return grad, None\n"),
    ],
}
