"""The layer's output is built in float32 whatever x's dtype: a bf16 layer returns float32 y (the
reference MoE, and the contract, return x's dtype)."""

EXERCISE = "2.10"
CAUGHT_BY = ["test_2_10_layer_output_in_the_dtype_of_x"]
EDITS = {
    "ExpertParallelMoE.forward": [
        ("        y = torch.zeros_like(x).index_add(0, token, back * r.weights[token, choice].unsqueeze(-1).to(x.dtype))\n",
         "        y = torch.zeros_like(x, dtype=torch.float32).index_add(0, token, back.float() * r.weights[token, choice].unsqueeze(-1))\n"),
    ],
}
