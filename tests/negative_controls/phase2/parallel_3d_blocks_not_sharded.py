"""The stages hold the whole blocks (no tensor parallelism): every tp rank computes the full block, tp buys nothing."""

EXERCISE = "2.11"
CAUGHT_BY = ["test_2_11_stages_hold_this_ranks_chunks_tensor_parallel"]
EDITS = {
    "build_stages": [
        ("            layers[i] = TensorParallelBlock.from_full(model.blocks[i], group=tp_group)\n",
         "            layers[i] = model.blocks[i]\n"),
    ],
}
