"""The router's gradient is left as each rank's own (not averaged over the data-parallel ranks): the
replicas of the router drift apart from the first step."""

EXERCISE = "2.10"
CAUGHT_BY = ["test_2_10_sync_gradients_router_over_the_world_experts_over_their_column"]
EDITS = {
    "sync_gradients": [
        ("    for params, group in ((model.router.parameters(), None), (model.experts.parameters(), groups.expert_dp)):\n",
         "    for params, group in ((model.experts.parameters(), groups.expert_dp),):\n"),
    ],
}
