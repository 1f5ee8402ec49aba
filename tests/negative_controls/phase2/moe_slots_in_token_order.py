"""Capacity slots are claimed token by token (token 0's choices, then token 1's, ...) instead of all
first choices before any second choice: a token's second choice can take the slot another token
needed for its first (GShard gives first choices priority).

The whole module is the reference with this one change."""
import inspect

from solutions.phase2_advanced import moe as _reference

EXERCISE = "2.10"
CAUGHT_BY = ["test_2_10_route_top_k_capacity_and_balancing_loss", "test_2_10_expert_parallel_layer_equals_one_process"]

_SOURCE = inspect.getsource(_reference).replace("from .", "from solutions.phase2_advanced.")
_OLD = """    queue = F.one_hot(experts.t().reshape(-1), num_experts)  # (k*T, E): assignments in (choice, token) order
    position = (queue.cumsum(dim=0) * queue).sum(dim=-1) - 1  # how many earlier ones went to the same expert
    kept = (position < capacity).view(k, tokens).t()
"""
_NEW = """    queue = F.one_hot(experts.reshape(-1), num_experts)  # (T*k, E): token-major
    position = (queue.cumsum(dim=0) * queue).sum(dim=-1) - 1
    kept = (position < capacity).view(tokens, k)
"""
assert _SOURCE.count(_OLD) == 1, "route's slots changed in the reference: update this control"
exec(compile(_SOURCE.replace(_OLD, _NEW), _reference.__file__, "exec"))
