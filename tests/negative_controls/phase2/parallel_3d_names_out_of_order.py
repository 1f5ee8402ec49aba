"""The sizes are given in (dp, pp, tp) order but the names in MESH_DIMS order: mesh["dp"] is the pp dimension."""

EXERCISE = "2.11"
CAUGHT_BY = ["test_2_11_mesh_has_named_dimensions_with_tp_innermost"]
EDITS = {
    "build_mesh": [
        ("tuple(sizes[name] for name in MESH_DIMS), mesh_dim_names=MESH_DIMS)", "(dp, pp, tp), mesh_dim_names=MESH_DIMS)"),
    ],
}
