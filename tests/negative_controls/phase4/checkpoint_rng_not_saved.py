"""training_state saves model, optimizer, scheduler and scaler but no RNG: the resumed run draws other dropout masks, noise and flips."""
from solutions.phase4_production.checkpoint import *  # noqa: F401,F403

EXERCISE = "4.1"
CAUGHT_BY = ["test_4_1_resume_is_bit_exact"]


def training_state(model, optimizer, scheduler=None, scaler=None, progress=None):
    return {
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "progress": dict(progress or {}),
    }


def restore_training_state(state, model, optimizer, scheduler=None, scaler=None):
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    return dict(state.get("progress") or {})
