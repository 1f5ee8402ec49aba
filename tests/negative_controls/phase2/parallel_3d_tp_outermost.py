"""The mesh is laid out (tp, dp, pp): tp is the outermost dimension, so a tp group's ranks are world/tp apart (across nodes)."""

EXERCISE = "2.11"
CAUGHT_BY = ["test_2_11_mesh_has_named_dimensions_with_tp_innermost"]
EDITS = {
    "build_mesh": [
        ("tuple(sizes[name] for name in MESH_DIMS), mesh_dim_names=MESH_DIMS)",
         "tuple(sizes[name] for name in (\"tp\", \"dp\", \"pp\")), mesh_dim_names=(\"tp\", \"dp\", \"pp\"))"),
    ],
}
