"""run_resumable leaves the checkpoints that failed verification under their names: keep-last-k ranks files
by step, so with `keep` corrupt ones above every step the new run saves, each new checkpoint is the oldest
and is deleted as soon as it is written; the next crash starts from scratch."""
import types

from solutions.phase4_production import recovery as _reference
from solutions.phase4_production.recovery import *  # noqa: F401,F403
from solutions.phase4_production.recovery import _device_of

EXERCISE = "4.2"
CAUGHT_BY = ["test_4_2_corrupt_checkpoints_do_not_prune_new_ones"]


def set_aside_newer(checkpoints, resumed):
    return []  # "resume() already skips them; the next saves will replace them"


# run_resumable looks `set_aside_newer` up in its own module: the reference's body, run with this one.
run_resumable = types.FunctionType(_reference.run_resumable.__code__, globals(), "run_resumable",
                                   _reference.run_resumable.__defaults__)
run_resumable.__kwdefaults__ = _reference.run_resumable.__kwdefaults__
