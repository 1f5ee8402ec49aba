"""W reads the micro-batch's input and output (held[(k, j)]) but never drops them: every micro-batch of a split backward stays alive to the end of the step, so ZB-H1's memory grows with m.

The whole module is the reference with this one change."""
import inspect

from solutions.phase2_advanced import pipeline as _reference

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_memory_held_until_w_zero_bubble"]

_SOURCE = inspect.getsource(_reference)
_OLD = """        box.post()  # the input gradient of the B before leaves before this computes
        x, out = held.pop((k, j))
"""
assert _SOURCE.count(_OLD) == 1, "run_pipeline changed in the reference: update this control"
_SOURCE = _SOURCE.replace(_OLD, _OLD.replace("held.pop((k, j))", "held[(k, j)]"))
_SOURCE = _SOURCE.replace("from .model_split import", "from solutions.phase2_advanced.model_split import")
exec(compile(_SOURCE, _reference.__file__, "exec"))
