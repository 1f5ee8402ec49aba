"""build_groups does not check that dp * tp is the world size: a (3, 1) mesh on 4 ranks quietly builds groups that leave rank 3 out.

The whole module is the reference with this one change."""
import inspect

from solutions.phase2_advanced import mesh as _reference

EXERCISE = "2.8"
CAUGHT_BY = ["test_2_8_groups_are_the_rows_and_columns_of_the_mesh"]

_SOURCE = inspect.getsource(_reference)
_OLD = "    if dp * tp != world:\n"
assert _SOURCE.count(_OLD) == 1, "build_groups changed in the reference: update this control"
_SOURCE = _SOURCE.replace(_OLD, "    if False:\n").replace("from .tensor_parallel import",
                                                          "from solutions.phase2_advanced.tensor_parallel import")
exec(compile(_SOURCE, _reference.__file__, "exec"))
