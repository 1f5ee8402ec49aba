"""should_stop broadcasts rank 0's flag instead of reducing every rank's: a SIGTERM that reaches another rank only (its node is drained, its container stopped) is never acted on."""
import types

from solutions.phase4_production import recovery as _reference
from solutions.phase4_production.recovery import *  # noqa: F401,F403
from solutions.phase4_production.recovery import _device_of  # noqa: F401 - run_resumable's body uses it

EXERCISE = "4.2"
CAUGHT_BY = ["test_4_2_one_rank_signalled_all_stop_at_one_boundary"]


class PreemptionHandler(_reference.PreemptionHandler):
    def should_stop(self) -> bool:
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=self._collective_device())
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(flag, src=0)  # the bug: rank 0 decides for everyone
        return bool(flag.item())


# run_resumable looks PreemptionHandler up in its own module: the reference's body, run with this class.
run_resumable = types.FunctionType(_reference.run_resumable.__code__, globals(), "run_resumable",
                                   _reference.run_resumable.__defaults__)
run_resumable.__kwdefaults__ = _reference.run_resumable.__kwdefaults__
