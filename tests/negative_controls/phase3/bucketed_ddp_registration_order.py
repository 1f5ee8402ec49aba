"""assign_buckets walks the parameters in registration order: the first bucket holds the first layers, whose gradients come LAST, so nothing can be launched until backward is over."""

EXERCISE = "3.2"
CAUGHT_BY = ["test_3_2_assign_buckets_follows_the_rule", "test_3_2_all_reduce_launched_during_backward"]
EDITS = {  # BucketedDDP builds its buckets with this assign_buckets: it is the module's
    "assign_buckets": [("    for index in reversed(range(len(params))):\n", "    for index in range(len(params)):\n")],
}
