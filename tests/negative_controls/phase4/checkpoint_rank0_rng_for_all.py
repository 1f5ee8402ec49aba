"""restore_training_state gives every rank the RNG of rank 0: after a resume all ranks draw the same dropout masks."""
from solutions.phase4_production import checkpoint as _reference
from solutions.phase4_production.checkpoint import *  # noqa: F401,F403

EXERCISE = "4.1"
CAUGHT_BY = ["test_4_1_each_rank_resumes_its_own_rng"]


def restore_training_state(state, model, optimizer, scheduler=None, scaler=None):
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    restore_rng(state["rng"][0])  # the bug: rank 0's entry for everybody
    return dict(state.get("progress") or {})
