"""The backward of the sequence-parallel all-gather all-reduces the gradient and keeps its slice: right values, twice the bytes of a reduce-scatter."""

EXERCISE = "2.9"
CAUGHT_BY = [
    "test_2_9_sequence_parallel_gather_and_reduce_scatter_operators",
    "test_2_9_sequence_parallel_block_moves_what_tensor_parallel_moves",
]
EDITS = {
    "GatherFromSequenceParallelRegion.backward": [
        ("        world = _group(ctx.group)[1]\n"
         "        parts = [part.contiguous() for part in grad.chunk(world, dim=SEQ_DIM)]\n"
         "        mine = torch.empty_like(parts[0])\n"
         "        dist.reduce_scatter(mine, parts, group=ctx.group)\n"
         "        return mine, None\n",
         "        rank, world = _group(ctx.group)\n"
         "        total = grad.contiguous().clone()\n"
         "        dist.all_reduce(total, group=ctx.group)\n"
         "        return total.chunk(world, dim=SEQ_DIM)[rank].contiguous(), None\n"),
    ],
}
