"""current_attempt reads rank and world size once and keeps them: after a restart at another size (or with the ranks reassigned) the loop shards data and picks the writer with the first attempt's numbers."""
import types

from solutions.phase4_production import recovery as _reference
from solutions.phase4_production.recovery import *  # noqa: F401,F403
from solutions.phase4_production.recovery import _device_of  # noqa: F401 - run_resumable's body uses it

EXERCISE = "4.2"
CAUGHT_BY = ["test_4_2_rank_and_world_size_read_on_every_attempt"]

_first = None


def current_attempt():
    global _first
    if _first is None:  # the bug: "the world does not change while this process lives"
        _first = _reference.current_attempt()
    return _first


# resume and run_resumable look current_attempt up in their own module: the reference's bodies, run with this one.
resume = types.FunctionType(_reference.resume.__code__, globals(), "resume", _reference.resume.__defaults__)
run_resumable = types.FunctionType(_reference.run_resumable.__code__, globals(), "run_resumable",
                                   _reference.run_resumable.__defaults__)
run_resumable.__kwdefaults__ = _reference.run_resumable.__kwdefaults__
