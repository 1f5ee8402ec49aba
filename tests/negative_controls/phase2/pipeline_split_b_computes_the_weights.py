"""The executor runs the whole backward at B even when a W follows (weight gradients included), and W only lets the micro-batch go: right gradients, but the input gradient leaves only after the weight gradient was computed, and W has nothing left to fill the bubble with."""

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_weight_gradients_computed_at_w_zero_bubble"]
EDITS = {
    "run_pipeline": [
        ("        if (k, j) in split:\n"
         "            pending[(k, j)] = grad\n"
         "            x_grad = None if st.is_first else torch.autograd.grad(out, x, grad, retain_graph=True)[0]\n",
         "        if False:\n"
         "            pass\n"),
        ("        grad = pending.pop((k, j))\n"
         "        weights = [p for p in stages[k].parameters() if p.requires_grad]\n",
         "        weights = []\n"),
    ],
}
