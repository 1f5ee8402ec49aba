"""training_state gathers the ranks' RNG states to rank 0 only (gather_object): rank 0's file is complete, but the state the other ranks get back holds None for every rank but their own."""

EXERCISE = "4.1"
CAUGHT_BY = ['test_4_1_each_rank_resumes_its_own_rng']
EDITS = {
    "training_state": [
        ("        rngs = [None] * world\n"
         "        dist.all_gather_object(rngs, capture_rng())\n",
         "        rngs = [None] * world if rank == 0 else None\n"
         "        gathered = [None] * world\n"
         "        dist.gather_object(capture_rng(), rngs, dst=0)\n"
         "        if rngs is None:\n"
         "            gathered[rank] = capture_rng()\n"
         "            rngs = gathered\n"),
    ],
}
