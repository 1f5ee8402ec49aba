"""The balancing loss counts only the kept first choices in f_i: an overloaded expert looks no busier than its capacity.

Switch (Fedus et al. 2021, eq. 4 and its mesh-tensorflow code) and GShard (Algorithm 1) count every
token's choice, dropped or not: the loss must see the overload the capacity hides. The whole module
is the reference with this one change."""
import inspect

from solutions.phase2_advanced import moe as _reference

EXERCISE = "2.10"
CAUGHT_BY = ["test_2_10_route_top_k_capacity_and_balancing_loss", "test_2_10_expert_parallel_layer_equals_one_process"]

_SOURCE = inspect.getsource(_reference).replace("from .", "from solutions.phase2_advanced.")
_OLD = "    first = F.one_hot(experts[:, 0], num_experts).float().mean(dim=0)"
assert _SOURCE.count(_OLD) == 1, "route's f_i changed in the reference: update this control"
exec(compile(_SOURCE.replace(_OLD, "    first = (F.one_hot(experts[:, 0], num_experts) * kept[:, :1]).float().mean(dim=0)"),
             _reference.__file__, "exec"))
