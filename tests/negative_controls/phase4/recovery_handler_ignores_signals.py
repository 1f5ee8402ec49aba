"""PreemptionHandler hard-codes SIGTERM and ignores its `signals` argument: a job warned with SIGUSR1 (SLURM's --signal=USR1@120) is never stopped, and SIGTERM is taken from whoever handled it."""
import signal
import types

from solutions.phase4_production import recovery as _reference
from solutions.phase4_production.recovery import *  # noqa: F401,F403
from solutions.phase4_production.recovery import _device_of  # noqa: F401 - run_resumable's body uses it

EXERCISE = "4.2"
CAUGHT_BY = ["test_4_2_preemption_handler_takes_the_signals_it_is_given"]


class PreemptionHandler(_reference.PreemptionHandler):
    def __enter__(self):
        self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_signal)  # the bug: self.signals unused
        return self


# run_resumable looks PreemptionHandler up in its own module: the reference's body, run with this class.
run_resumable = types.FunctionType(_reference.run_resumable.__code__, globals(), "run_resumable",
                                   _reference.run_resumable.__defaults__)
run_resumable.__kwdefaults__ = _reference.run_resumable.__kwdefaults__
