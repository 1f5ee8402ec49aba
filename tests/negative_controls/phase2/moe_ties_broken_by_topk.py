"""torch.topk picks the experts: on equal probabilities it does not promise the lower index first (on
CPU, torch 2.14.1, topk of [0.1, 0.3, 0.3, 0.3] with k=2 returns experts 2 and 3, not 1 and 2).

Two ranks, or a rank and the single-process ground truth, then route a tied token differently. The
whole module is the reference with this one change."""
import inspect

from solutions.phase2_advanced import moe as _reference

EXERCISE = "2.10"
CAUGHT_BY = ["test_2_10_route_top_k_capacity_and_balancing_loss"]

_SOURCE = inspect.getsource(_reference).replace("from .", "from solutions.phase2_advanced.")
_OLD = """    top, experts = probs.sort(dim=-1, descending=True, stable=True)  # stable: equal p keep index order
    top, experts = top[:, :k], experts[:, :k]
"""
assert _SOURCE.count(_OLD) == 1, "route's top-k changed in the reference: update this control"
exec(compile(_SOURCE.replace(_OLD, "    top, experts = probs.topk(k, dim=-1)\n"), _reference.__file__, "exec"))
