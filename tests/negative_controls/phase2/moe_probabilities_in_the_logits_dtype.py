"""softmax(logits) without .float(): bf16 logits route on bf16 probabilities (ties and orders that the
float32 ones do not have), float64 logits on float64 ones, and weights and aux_loss come out in the logits'
dtype instead of float32."""

EXERCISE = "2.10"
CAUGHT_BY = [
    "test_2_10_route_is_float32_for_bf16_and_float64_logits",
    "test_2_10_layer_output_in_the_dtype_of_x",
]
EDITS = {
    "route": [
        ("    probs = torch.softmax(logits.float(), dim=-1)\n",
         "    probs = torch.softmax(logits, dim=-1)\n"),
    ],
}
