"""The experts' gradients are averaged over the whole world, as the router's are: with ep > 1, ranks
hold DIFFERENT experts of the same shape, so the all-reduce mixes expert 0's gradient with expert 2's.

The whole module is the reference with this one change."""
import inspect

from solutions.phase2_advanced import moe as _reference

EXERCISE = "2.10"
CAUGHT_BY = ["test_2_10_sync_gradients_router_over_the_world_experts_over_their_column"]

_SOURCE = inspect.getsource(_reference).replace("from .", "from solutions.phase2_advanced.")
_OLD = "(model.experts.parameters(), groups.expert_dp)"
assert _SOURCE.count(_OLD) == 1, "sync_gradients changed in the reference: update this control"
exec(compile(_SOURCE.replace(_OLD, "(model.experts.parameters(), None)"), _reference.__file__, "exec"))
