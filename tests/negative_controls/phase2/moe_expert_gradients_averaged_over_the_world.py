"""The experts' gradients are averaged over the whole world, as the router's are: with ep > 1, ranks
hold DIFFERENT experts of the same shape, so the all-reduce mixes expert 0's gradient with expert 2's."""

EXERCISE = "2.10"
CAUGHT_BY = ["test_2_10_sync_gradients_router_over_the_world_experts_over_their_column"]
EDITS = {
    "sync_gradients": [
        ("    for params, group in ((model.router.parameters(), None), (model.experts.parameters(), groups.expert_dp)):\n",
         "    for params, group in ((model.router.parameters(), None), (model.experts.parameters(), None)):\n"),
    ],
}
