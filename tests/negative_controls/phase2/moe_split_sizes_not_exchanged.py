"""The split sizes are not exchanged: each rank assumes it receives from every rank as many rows as it
sends there (and that they go to its experts as its own rows to them would). With uneven routing
the receive buffers are the wrong size: on torch 2.14.1 gloo, a rank whose buffer is too small for
what comes aborts ("Received data size doesn't match expected size"); one whose buffer is too large
returns uninitialised memory, silently."""

EXERCISE = "2.10"
CAUGHT_BY = ["test_2_10_expert_parallel_layer_equals_one_process"]
EDITS = {
    "ExpertParallelMoE.forward": [
        ("        received = torch.empty_like(counts)\n"
         "        dist.all_to_all_single(received, counts, group=self.group)  # [source rank, local expert], flattened\n",
         "        rank, _ = _ep(self.group)\n"
         "        received = counts.view(ep, local)[rank].repeat(ep)  # what I send to rank q's experts, mirrored\n"),
    ],
}
