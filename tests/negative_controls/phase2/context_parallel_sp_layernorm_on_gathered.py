"""The LayerNorms run after the all-gather, on the whole sequence: the same numbers, but the LayerNorm inputs are held whole on every rank (no activation saving)."""

EXERCISE = "2.9"
CAUGHT_BY = ["test_2_9_sequence_parallel_block_holds_the_residual_stream_sharded"]
EDITS = {
    "SequenceParallelBlock._attention": [
        ("        full = GatherFromSequenceParallelRegion.apply(x, self.group)\n",
         "        full = self.ln1(GatherFromSequenceParallelRegion.apply(x, self.group))\n"),
    ],
    "SequenceParallelBlock._mlp": [
        ("        full = GatherFromSequenceParallelRegion.apply(x, self.group)\n",
         "        full = self.ln2(GatherFromSequenceParallelRegion.apply(x, self.group))\n"),
    ],
    "SequenceParallelBlock.forward": [
        ("        x = x + self.drop(self._attention(self.ln1(x)))\n"
         "        return x + self.drop(self._mlp(self.ln2(x)))\n",
         "        x = x + self.drop(self._attention(x))\n"
         "        return x + self.drop(self._mlp(x))\n"),
    ],
}
