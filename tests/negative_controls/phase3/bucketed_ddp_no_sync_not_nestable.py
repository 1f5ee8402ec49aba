"""Leaving no_sync() always turns sync back on instead of restoring the setting it found: an inner block that ends inside an outer one re-enables the sync too early."""
from contextlib import contextmanager

from solutions.phase3_multi_node import bucketed_ddp as _reference
from solutions.phase3_multi_node.bucketed_ddp import *  # noqa: F401,F403

EXERCISE = "3.2"
CAUGHT_BY = ["test_3_2_no_sync_decided_at_forward_like_ddp"]


class BucketedDDP(_reference.BucketedDDP):
    @contextmanager
    def no_sync(self):
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True  # the bug: not the value in force when the block was entered
