"""The last, incomplete global batch of the epoch is filled up by wrapping around to the start of the order (as DistributedSampler pads): the global batch stays fixed, but the samples it wraps to are trained on twice in that epoch."""
from solutions.phase4_production import elastic as _reference
from solutions.phase4_production.elastic import *  # noqa: F401,F403

EXERCISE = "4.3"
CAUGHT_BY = ["test_4_3_uninterrupted_epochs_use_every_sample_once_in_fixed_global_batches",
             "test_4_3_resized_run_sees_every_sample_of_the_epoch_once"]


class ElasticSampler(_reference.ElasticSampler):
    @property
    def steps_per_epoch(self):
        return -(-self.dataset_size // self.global_batch)  # the bug: ceil, the last batch padded

    def order(self, epoch=None):
        order = super().order(epoch)
        return order + order[:self.steps_per_epoch * self.global_batch - len(order)]
