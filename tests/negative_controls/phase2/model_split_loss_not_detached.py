"""forward_backward returns the loss still attached to its graph: the caller keeps the whole step's graph (every saved activation) alive as long as it keeps the loss.

The whole module is the reference with this one change."""
import inspect

from solutions.phase2_advanced import model_split as _reference

EXERCISE = "2.5"
CAUGHT_BY = ["test_2_5_split_model_matches_one_process"]

_SOURCE = inspect.getsource(_reference)
_OLD = "    return None if loss is None else loss.detach()\n"
assert _SOURCE.count(_OLD) == 1, "forward_backward changed in the reference: update this control"
exec(compile(_SOURCE.replace(_OLD, "    return loss\n"), _reference.__file__, "exec"))
