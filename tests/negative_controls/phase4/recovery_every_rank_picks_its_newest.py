"""resume lets every rank look for the newest valid checkpoint in its own listing of the folder: where a shared
file system shows the ranks different listings, ranks resume different steps and their weights diverge."""
import types

from solutions.phase4_production import recovery as _reference
from solutions.phase4_production.recovery import *  # noqa: F401,F403
from solutions.phase4_production.recovery import _device_of

EXERCISE = "4.2"
CAUGHT_BY = ["test_4_2_every_rank_resumes_the_step_rank_0_found"]


def resume(checkpoints, model, optimizer, scheduler=None, scaler=None, map_location=None):
    location = map_location if map_location is not None else _device_of(model)
    found = checkpoints.load_latest(location)  # the bug: each rank's own choice, nothing broadcast
    if found is None:
        return None
    return restore_training_state(found[1], model, optimizer, scheduler, scaler)


# run_resumable looks `resume` up in its own module: the reference's body, run with this resume.
run_resumable = types.FunctionType(_reference.run_resumable.__code__, globals(), "run_resumable",
                                   _reference.run_resumable.__defaults__)
run_resumable.__kwdefaults__ = _reference.run_resumable.__kwdefaults__
