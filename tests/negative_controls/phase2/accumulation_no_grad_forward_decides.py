"""GradSync.forward records require_sync even under torch.no_grad(): an evaluation forward inside no_sync() cancels the sync that the training forward before it prepared."""
from solutions.phase2_advanced import accumulation as _reference
from solutions.phase2_advanced.accumulation import *  # noqa: F401,F403

EXERCISE = "2.1"
CAUGHT_BY = ["test_2_1_sync_is_decided_at_forward_like_ddp"]


class GradSync(_reference.GradSync):
    def forward(self, *inputs, **kwargs):
        self.sync_prepared = self.require_sync
        return self.module(*inputs, **kwargs)
