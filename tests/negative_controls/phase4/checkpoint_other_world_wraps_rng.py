"""At another world size the ranks take the saved streams round-robin (rank r gets rng[r % saved]) with no
warning: ranks share streams, and the resumed randomness silently differs from the uninterrupted run."""
from solutions.phase4_production import checkpoint as _reference
from solutions.phase4_production.checkpoint import *  # noqa: F401,F403

EXERCISE = "4.1"
CAUGHT_BY = ["test_4_1_other_world_size_reseeds_from_step_and_rank"]


def restore_training_state(state, model, optimizer, scheduler=None, scaler=None):
    rank, _ = _reference._rank_and_world()
    _reference.unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    restore_rng(state["rng"][rank % len(state["rng"])])  # the bug: no reseed, no warning
    return dict(state.get("progress") or {})
