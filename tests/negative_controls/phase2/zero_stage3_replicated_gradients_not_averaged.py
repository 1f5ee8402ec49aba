"""ZeRO-3 keeps the small units whole (replicate_below) but never all-reduces their gradients: each rank steps its replicated parameters on its own half of the batch, and the replicas drift apart."""
from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_shard_gradients_stage3", "test_2_4_two_ranks_match_one_process_bitwise_stage3"]


class ZeroStage3(_reference.ZeroStage3):
    def _replicated_grad_ready(self, p):
        pass  # "a whole parameter needs no collective"
