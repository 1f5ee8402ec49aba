"""run_pipeline returns the sum of the micro-batches' losses still attached to their graphs, not detached: the caller keeps every micro-batch's graph alive.

The whole module is the reference with this one change."""
import inspect

from solutions.phase2_advanced import pipeline as _reference

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_gpipe_matches_one_process", "test_2_6_1f1b_matches_one_process"]

_SOURCE = inspect.getsource(_reference)
_OLD = "            total.append(out.detach())\n"
assert _SOURCE.count(_OLD) == 1, "run_pipeline changed in the reference: update this control"
_SOURCE = _SOURCE.replace(_OLD, "            total.append(out)\n")
_SOURCE = _SOURCE.replace("from .model_split import", "from solutions.phase2_advanced.model_split import")
exec(compile(_SOURCE, _reference.__file__, "exec"))
