"""training_state saves the wrapper's state_dict: a checkpoint of DDP(model) has 'module.' keys that a bare model (another world, an evaluation script) refuses."""
from solutions.phase4_production.checkpoint import *  # noqa: F401,F403
from solutions.phase4_production.checkpoint import _rank_and_world

EXERCISE = "4.1"
CAUGHT_BY = ["test_4_1_wrapped_model_saves_the_bare_module"]


def training_state(model, optimizer, scheduler=None, scaler=None, progress=None):
    rank, world = _rank_and_world()
    rngs = [capture_rng()]
    if world > 1:
        rngs = [None] * world
        dist.all_gather_object(rngs, capture_rng())
    return {
        "model": model.state_dict(),  # the bug: DDP's own state_dict, every key prefixed with 'module.'
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "progress": dict(progress or {}),
        "rng": rngs,
    }
