"""The tp group is taken to be inside a node whatever its size: tp = 16 on 8-GPU nodes is priced at NVLink's alpha and beta, not the inter-node link its ring crosses."""

EXERCISE = "2.12"
CAUGHT_BY = ["test_2_12_link_follows_the_placement", "test_2_12_step_time_terms"]
EDITS = {
    "link": [
        ("    if cluster.gpus_per_node % span == 0:\n",
         "    if dim == \"tp\" or cluster.gpus_per_node % span == 0:\n"),
    ],
}
