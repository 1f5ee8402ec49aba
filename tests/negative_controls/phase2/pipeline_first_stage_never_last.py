"""run_pipeline's forward treats the stages as first, OR last, OR in between (if/elif): a pipeline of one stage, first and last at once, never computes its loss."""

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_executor_runs_any_valid_schedule"]
EDITS = {
    "run_pipeline": [
        ("        out = st(x)\n"
         "        if st.is_last:\n",
         "        out = st(x)\n"
         "        if st.is_last and not st.is_first:\n"),
    ],
}
