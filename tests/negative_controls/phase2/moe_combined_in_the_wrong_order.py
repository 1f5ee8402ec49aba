"""After the return all-to-all the results are added to the tokens in the order the assignments had
BEFORE they were sorted by expert: the rows come back sorted, so each token gets another token's result."""

EXERCISE = "2.10"
CAUGHT_BY = ["test_2_10_expert_parallel_layer_equals_one_process"]
EDITS = {
    "ExpertParallelMoE.forward": [
        ("        order = torch.argsort(expert, stable=True)  # rows grouped by expert, hence by destination rank\n",
         "        order = torch.argsort(expert, stable=True)  # rows grouped by expert, hence by destination rank\n"
         "        unsorted_token, unsorted_choice = token, choice\n"),
        ("        y = torch.zeros_like(x).index_add(0, token, back * r.weights[token, choice].unsqueeze(-1).to(x.dtype))\n",
         "        y = torch.zeros_like(x).index_add(0, unsorted_token, back * r.weights[unsorted_token, unsorted_choice].unsqueeze(-1).to(x.dtype))\n"),
    ],
}
