"""The sequence-parallel reduce-scatter is an all-reduce followed by keeping this rank's slice: right values, twice the bytes."""

EXERCISE = "2.9"
CAUGHT_BY = [
    "test_2_9_sequence_parallel_gather_and_reduce_scatter_operators",
    "test_2_9_sequence_parallel_block_moves_what_tensor_parallel_moves",
]
EDITS = {
    "ReduceScatterToSequenceParallelRegion.forward": [
        ("        parts = [part.contiguous() for part in x.chunk(_group(group)[1], dim=SEQ_DIM)]\n"
         "        mine = torch.empty_like(parts[0])\n"
         "        dist.reduce_scatter(mine, parts, group=group)\n"
         "        return mine\n",
         "        rank, world = _group(group)\n"
         "        total = x.contiguous().clone()\n"
         "        dist.all_reduce(total, group=group)\n"
         "        return total.chunk(world, dim=SEQ_DIM)[rank].contiguous()\n"),
    ],
}
