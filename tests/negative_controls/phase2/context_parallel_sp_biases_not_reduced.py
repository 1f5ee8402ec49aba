"""reduce_replicated_grads sums the LayerNorms' gradients but forgets the row-parallel biases (attn.out.bias, mlp.fc2.bias), which also saw only this rank's positions."""

EXERCISE = "2.9"
CAUGHT_BY = [
    "test_2_9_sequence_parallel_block_matches_one_process",
    "test_2_9_sequence_parallel_block_on_a_group_communicates_only_within_it",
]
EDITS = {
    "SequenceParallelBlock.reduce_replicated_grads": [
        ("        for p in [*self.ln1.parameters(), *self.ln2.parameters(), self.attn.out.bias, self.mlp.fc2.bias]:\n",
         "        for p in [*self.ln1.parameters(), *self.ln2.parameters()]:\n"),
    ],
}
