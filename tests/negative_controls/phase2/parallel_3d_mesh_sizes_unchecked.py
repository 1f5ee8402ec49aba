"""build_mesh does not check dp * pp * tp against the world size: a misfit fails inside torch with its own error, or not at all."""

EXERCISE = "2.11"
CAUGHT_BY = ["test_2_11_mesh_has_named_dimensions_with_tp_innermost"]
EDITS = {
    "build_mesh": [
        ("    if dp * pp * tp != world:\n", "    if dp * pp * tp > world and False:\n"),
    ],
}
