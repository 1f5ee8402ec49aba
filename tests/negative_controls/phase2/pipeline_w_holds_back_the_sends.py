"""W computes without posting the queued sends first (no box.post()): the input gradient its B just queued waits in the mailbox through the weight-gradient computation, and the previous stage waits for it meanwhile: the B/W split then saves nothing.

The whole module is the reference with this one change."""
import inspect

from solutions.phase2_advanced import pipeline as _reference

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_weight_gradients_computed_at_w_zero_bubble"]

_SOURCE = inspect.getsource(_reference)
_OLD = "        box.post()  # the input gradient of the B before leaves before this computes\n"
assert _SOURCE.count(_OLD) == 1, "run_pipeline changed in the reference: update this control"
_SOURCE = _SOURCE.replace(_OLD, "")
_SOURCE = _SOURCE.replace("from .model_split import", "from solutions.phase2_advanced.model_split import")
exec(compile(_SOURCE, _reference.__file__, "exec"))
