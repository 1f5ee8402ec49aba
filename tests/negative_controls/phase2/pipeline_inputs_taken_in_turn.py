"""run_pipeline feeds the first stage the next input micro-batch in turn (and the last stage the next target), not micro-batch j's: right only when the forwards come in order 0..m-1."""

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_executor_runs_any_valid_schedule"]
EDITS = {
    "run_pipeline": [
        ("            x = microbatch_inputs[j].to(st.device)\n",
         "            x = microbatch_inputs[len(held)].to(st.device)\n"),
        ("            out = loss_fn(out, microbatch_targets[j].to(st.device)) / num_microbatches\n",
         "            out = loss_fn(out, microbatch_targets[len(held)].to(st.device)) / num_microbatches\n"),
    ],
}
