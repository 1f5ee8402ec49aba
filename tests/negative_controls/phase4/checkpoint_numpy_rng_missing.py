"""capture_rng records python's and torch's generators but not numpy's: numpy-based augmentation differs after a resume."""
import random

from solutions.phase4_production import checkpoint as _reference
from solutions.phase4_production.checkpoint import *  # noqa: F401,F403

EXERCISE = "4.1"
CAUGHT_BY = ["test_4_1_resume_is_bit_exact"]


def capture_rng():
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def restore_rng(state):
    random.setstate(_reference._as_python_state(state["python"]))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu(), torch.cuda.current_device())


def training_state(model, optimizer, scheduler=None, scaler=None, progress=None):
    state = _reference.training_state(model, optimizer, scheduler, scaler, progress)
    rank, world = _reference._rank_and_world()
    rngs = [capture_rng()]
    if world > 1:
        rngs = [None] * world
        dist.all_gather_object(rngs, capture_rng())
    return dict(state, rng=rngs)


def restore_training_state(state, model, optimizer, scheduler=None, scaler=None):
    rank, _ = _reference._rank_and_world()
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    restore_rng(state["rng"][rank])
    return dict(state.get("progress") or {})
