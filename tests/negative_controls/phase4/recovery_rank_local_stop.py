"""should_stop answers from this rank's own SIGTERM flag, without asking the others: the rank that got the signal saves and stops while its peer enters the next step."""
import types

from solutions.phase4_production import recovery as _reference
from solutions.phase4_production.recovery import *  # noqa: F401,F403
from solutions.phase4_production.recovery import _device_of  # noqa: F401 - run_resumable's body uses it

EXERCISE = "4.2"
CAUGHT_BY = ["test_4_2_ranks_agree_to_stop_on_sigterm"]


class PreemptionHandler(_reference.PreemptionHandler):
    def should_stop(self) -> bool:
        return self.requested  # the bug: a rank-local decision


# run_resumable looks PreemptionHandler up in its own module: the reference's body, run with this class.
run_resumable = types.FunctionType(_reference.run_resumable.__code__, globals(), "run_resumable",
                                   _reference.run_resumable.__defaults__)
run_resumable.__kwdefaults__ = _reference.run_resumable.__kwdefaults__
