"""ZeRO-2's zero_grad() clears the model's gradients only (as torch.optim's does) and forgets the gradient
slices the hooks accumulate into: every step adds its gradient to all the previous ones'."""
from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_trains_like_data_parallel_adam_stage2", "test_2_4_gradient_is_averaged_over_ranks_stage2"]


class ZeroStage2(_reference.ZeroStage2):
    def zero_grad(self, set_to_none=True):
        _reference.ShardedOptimizer.zero_grad(self, set_to_none)
