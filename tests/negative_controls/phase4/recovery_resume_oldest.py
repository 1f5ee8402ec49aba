"""resume walks the checkpoints oldest first and takes the first one that loads: a restarted run redoes every step since the first checkpoint."""
import types

from solutions.phase4_production import recovery as _reference
from solutions.phase4_production.checkpoint import CorruptCheckpoint
from solutions.phase4_production.recovery import *  # noqa: F401,F403
from solutions.phase4_production.recovery import _device_of

EXERCISE = "4.2"
CAUGHT_BY = ["test_4_2_resumes_from_newest_valid_checkpoint"]


def resume(checkpoints, model, optimizer, scheduler=None, scaler=None, map_location=None):
    attempt = current_attempt()
    location = map_location if map_location is not None else _device_of(model)
    found = None
    if attempt.rank == 0:
        for step in checkpoints.steps():  # the bug: oldest first
            try:
                found = step, load_verified(checkpoints.path_for(step), location)
                break
            except CorruptCheckpoint:
                continue
    if attempt.world_size > 1:
        choice = [found[0] if found is not None else None]
        dist.broadcast_object_list(choice, src=0)
        if attempt.rank != 0 and choice[0] is not None:
            found = choice[0], load_verified(checkpoints.path_for(choice[0]), location)
    if found is None:
        return None
    return restore_training_state(found[1], model, optimizer, scheduler, scaler)


# run_resumable looks `resume` up in its own module: the reference's body, run with this resume.
run_resumable = types.FunctionType(_reference.run_resumable.__code__, globals(), "run_resumable",
                                   _reference.run_resumable.__defaults__)
run_resumable.__kwdefaults__ = _reference.run_resumable.__kwdefaults__
