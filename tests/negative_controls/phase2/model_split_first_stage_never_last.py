"""forward_backward handles the stages as first OR last (if/elif): a model on one stage, first and last at once, is never given its loss and backward.

The whole module is the reference with this one change."""
import inspect

from solutions.phase2_advanced import model_split as _reference

EXERCISE = "2.5"
CAUGHT_BY = ["test_2_5_split_model_matches_one_process"]

_SOURCE = inspect.getsource(_reference)
_OLD = "    loss = None\n    if stage.is_last:\n"
assert _SOURCE.count(_OLD) == 1, "forward_backward changed in the reference: update this control"
exec(compile(_SOURCE.replace(_OLD, "    loss = None\n    if stage.is_last and not stage.is_first:\n"),
             _reference.__file__, "exec"))
