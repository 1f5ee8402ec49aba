"""The micro-batches are cut only on the ranks that use them: a bad count raises on the first and last stages, and
the middle ranks wait for activations that never come."""

EXERCISE = "2.11"
CAUGHT_BY = ["test_2_11_bad_microbatch_count_refused_on_every_rank"]
WORLD_TIMEOUT = 15  # its tests' worlds take 3 s; the deadlock is caught after 15 s, not 60
EDITS = {
    "train_step": [
        ("    micro_x = split_microbatches(x.chunk(dp)[d], num_microbatches)  # run_pipeline reads them where it needs them\n"
         "    micro_y = split_microbatches(y.chunk(dp)[d], num_microbatches)\n",
         "    first, last = any(st.is_first for st in stages), any(st.is_last for st in stages)\n"
         "    micro_x = split_microbatches(x.chunk(dp)[d], num_microbatches) if first else None\n"
         "    micro_y = split_microbatches(y.chunk(dp)[d], num_microbatches) if last else None\n"),
    ],
}
