"""GatherFromTensorParallelRegion all-gathers x as it is into torch.empty_like(x) buffers: for a non-contiguous x (a transposed activation) input and buffers are strided, which NCCL refuses (gloo copies quietly)."""

EXERCISE = "2.7"
CAUGHT_BY = ["test_2_7_f_g_gather_scatter_operators"]
EDITS = {
    "GatherFromTensorParallelRegion.forward": [
        ("        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(_tp(group)[1])]\n"
         "        dist.all_gather(parts, x.contiguous(), group=group)\n",
         "        parts = [torch.empty_like(x) for _ in range(_tp(group)[1])]\n"
         "        dist.all_gather(parts, x, group=group)\n"),
    ],
}
