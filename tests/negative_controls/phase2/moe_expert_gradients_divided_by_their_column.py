"""Each expert's gradient is averaged over its column (the ranks holding it: divided by that group's
size) instead of divided by the world size: it already sums the losses of its whole row, so it comes
out ep times too large."""

EXERCISE = "2.10"
CAUGHT_BY = ["test_2_10_sync_gradients_router_over_the_world_experts_over_their_column"]
EDITS = {
    "sync_gradients": [
        ("            p.grad /= world\n",
         "            p.grad /= dist.get_world_size(group)\n"),
    ],
}
