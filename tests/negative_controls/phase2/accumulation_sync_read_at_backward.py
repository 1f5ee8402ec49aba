"""GradSync reads require_sync in backward, not forward: a forward outside no_sync() whose backward runs inside it does not sync (DDP does)."""
from solutions.phase2_advanced import accumulation as _reference
from solutions.phase2_advanced.accumulation import *  # noqa: F401,F403

EXERCISE = "2.1"
CAUGHT_BY = ["test_2_1_sync_is_decided_at_forward_like_ddp"]


class GradSync(_reference.GradSync):
    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def backward(self, loss, local_samples):
        loss.backward()
        if self.require_sync:
            self.sync(local_samples)
