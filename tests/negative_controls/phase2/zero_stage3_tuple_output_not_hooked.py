"""_post_forward hooks the unit's output only when it is a tensor: a unit returning a tuple is never gathered again before its backward, which then finds its weights freed.

The whole module is the reference with this one change."""
import inspect

from solutions.phase2_advanced import zero as _reference

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_unit_returning_a_tuple_stage3"]

_SOURCE = inspect.getsource(_reference)
_OLD = "        outputs = output if isinstance(output, (tuple, list)) else (output,)\n"
assert _SOURCE.count(_OLD) == 1, "_post_forward changed in the reference: update this control"
exec(compile(_SOURCE.replace(_OLD, "        outputs = (output,)\n"), _reference.__file__, "exec"))
