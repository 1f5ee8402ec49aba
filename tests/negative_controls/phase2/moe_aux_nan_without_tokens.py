"""The balancing loss is a plain mean over the tokens: a rank with no tokens (T = 0) gets aux = NaN
instead of 0, and its loss carries the NaN through the sync into every rank's router gradient.

The whole module is the reference with this one change."""
import inspect

from solutions.phase2_advanced import moe as _reference

EXERCISE = "2.10"
CAUGHT_BY = ["test_2_10_route_of_no_tokens_and_of_one_token", "test_2_10_layer_with_a_rank_that_has_no_tokens"]

_SOURCE = inspect.getsource(_reference).replace("from .", "from solutions.phase2_advanced.")
_OLD = "    aux_loss = num_experts * (first * probs.mean(dim=0)).sum() if tokens else probs.sum()  # T = 0: 0, not NaN\n"
_NEW = "    aux_loss = num_experts * (first * probs.mean(dim=0)).sum()\n"
assert _SOURCE.count(_OLD) == 1, "route's aux loss changed in the reference: update this control"
exec(compile(_SOURCE.replace(_OLD, _NEW), _reference.__file__, "exec"))
