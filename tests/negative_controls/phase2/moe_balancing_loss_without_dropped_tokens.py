"""The balancing loss counts only the kept first choices in f_i: an overloaded expert looks no busier than its capacity.

Switch (Fedus et al. 2021, eq. 4 and its mesh-tensorflow code) and GShard (Algorithm 1) count every
token's choice, dropped or not: the loss must see the overload the capacity hides. The whole module
is the reference with this one change."""

EXERCISE = "2.10"
CAUGHT_BY = [
    "test_2_10_route_top_k_capacity_and_balancing_loss",
    "test_2_10_expert_parallel_layer_equals_one_process",
]
EDITS = {
    "route": [
        ("    first = F.one_hot(experts[:, 0], num_experts).float().mean(dim=0)  # f_i: first choices, dropped or not\n",
         "    first = (F.one_hot(experts[:, 0], num_experts) * kept[:, :1]).float().mean(dim=0)  # f_i: first choices, dropped or not\n"),
    ],
}
