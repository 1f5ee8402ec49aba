"""Contract of exercise 2.8 (mesh.py's docstrings; guidelines 2.8): the groups of a (dp, tp) mesh and training on it."""

from contracts import when


CONTRACT = {
    "build_groups": [
        when("dp = 1 (tensor parallel only)", lambda c: c.a["dp"] == 1),
        when("tp = 1 (data parallel only)", lambda c: c.a["tp"] == 1),
        when("dp, tp > 1", lambda c: c.a["dp"] > 1 and c.a["tp"] > 1),
        when("dp != tp (a rectangular mesh)", lambda c: c.a["dp"] != c.a["tp"] and c.a["dp"] > 1 and c.a["tp"] > 1),
        when("tp > 2", lambda c: c.a["tp"] > 2),
        when("dp > 2", lambda c: c.a["dp"] > 2),
        when("called twice in one world (a second mesh)", lambda c: c.count > 1),
    ],
    "train": [
        when("dp = 1", lambda c: c.a["groups"].dp.size() == 1),
        when("tp = 1", lambda c: c.a["groups"].tp.size() == 1),
        when("dp, tp > 1", lambda c: c.a["groups"].dp.size() > 1 and c.a["groups"].tp.size() > 1),
        when("steps = 0", lambda c: c.a["steps"] == 0), when("steps = 1", lambda c: c.a["steps"] == 1),
        when("several steps", lambda c: c.a["steps"] > 1),
        when("a dp slice of one sample", lambda c: len(c.a["x"]) == c.a["groups"].dp.size()),
    ],
}

IRRELEVANT = {
    "build_groups: dp != tp (a rectangular mesh)": "needs 6 or 8 ranks; the (4, 1) and (1, 4) meshes of the world of "
        "4 are rectangular: a formula that swaps dp and tp, or strides by the wrong one, fails there",
}
