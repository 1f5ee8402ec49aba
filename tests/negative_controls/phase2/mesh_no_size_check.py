"""build_groups does not check that dp * tp is the world size: a (3, 1) mesh on 4 ranks quietly builds groups that leave rank 3 out."""

EXERCISE = "2.8"
CAUGHT_BY = ["test_2_8_groups_are_the_rows_and_columns_of_the_mesh"]
EDITS = {
    "build_groups": [
        ("    if dp * tp != world:\n",
         "    if False:\n"),
    ],
}
