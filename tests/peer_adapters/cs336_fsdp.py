"""Stanford CS336 assignment 2 ("systems", the 2026 release), its FSDP tests, run against this course's ZeRO-3.

Their suite, `tests/test_fsdp.py` of the assignment's repository (read here in a student's
public copy, github.com/searlion/cs336-2026-assignment2-systems; not vendored), imports three
functions from its `tests/adapters.py`; these are the same three, each one call into
`ZeroStage3` (exercise 2.4) and no logic of its own. To run their suite against your stage 3,
put these three functions in place of theirs in a checkout of the assignment, with this
repository on PYTHONPATH. The course's own graded tests run them too, with `zero` bound to
the code being graded (tests/phase2/test_2_4_zero.py, its `peer_*` scenarios).

What their suite asks, and how ZeroStage3 gives it:
  * `get_fsdp(module, compute_dtype)` returns a module whose `.parameters()` an SGD optimizer
    steps and whose `.module` is the model: ZeroStage3's parameters are this rank's shards (one
    fp32 flat shard per unit, registered where the unit's parameters were), the master copy
    even when the units compute in `compute_dtype`.
  * Their gradient-sync test treats only Linear and Embedding weights as sharded and checks
    that every other parameter's gradient (their RMSNorm weights: 64 and 128 elements; every
    Linear and the Embedding has at least 6400) is the same on every rank, i.e. replicated:
    units under REPLICATE_BELOW elements stay whole (ZeroStage3's `replicate_below`), their
    gradients averaged over the ranks.
  * `fsdp_on_after_backward`: nothing to call: ZeroStage3 has reduced every gradient before
    backward() returns (the hooks, and the callback queued for the end of the backward pass).
  * `fsdp_gather_full_params`: `full_state_dict()`, every parameter whole, by the names
    `model.named_parameters()` gave before wrapping (a collective: every rank calls it).
"""

from __future__ import annotations

import torch

from phase2_advanced import zero  # the code under test: your stage 3 (the reference: solutions.phase2_advanced.zero)

REPLICATE_BELOW = 1024  # elements: their norms stay whole, every Linear and Embedding is sharded


def get_fsdp(module: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    return zero.ZeroStage3(module, compute_dtype=compute_dtype, replicate_below=REPLICATE_BELOW)


def fsdp_on_after_backward(fsdp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    return None  # every gradient is reduced inside backward (see the module docstring)


def fsdp_gather_full_params(fsdp_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return fsdp_model.full_state_dict()
