"""Forward's running output and lse start as torch.zeros / torch.full in the default dtype (float32), not q's: float64 inputs give a float32 output, and backward fails."""

EXERCISE = "2.9"
CAUGHT_BY = ["test_2_9_ring_attention_in_float64"]
EDITS = {
    "RingAttention.forward": [
        ("        out = lse = None\n",
         "        out = torch.zeros(*q.shape[:-1], v.shape[-1], device=q.device)\n"
         "        lse = torch.full(q.shape[:-1], float(\"-inf\"), device=q.device)\n"),
    ],
}
