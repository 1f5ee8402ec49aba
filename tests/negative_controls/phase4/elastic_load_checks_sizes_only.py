"""ElasticSampler.load_state_dict checks the dataset size and the global batch but not the seed or the shuffle
flag: a position counted in another permutation is taken over, and the resumed epoch repeats some samples and
skips others."""
from solutions.phase4_production import elastic as _reference
from solutions.phase4_production.elastic import *  # noqa: F401,F403

EXERCISE = "4.3"
CAUGHT_BY = ["test_4_3_load_state_dict_refuses_another_order"]


class ElasticSampler(_reference.ElasticSampler):
    def load_state_dict(self, state):
        if (state.get("dataset_size"), state.get("global_batch")) != (self.dataset_size, self.global_batch):
            raise ValueError("state saved for another dataset size or global batch")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])  # the bug: seed, shuffle unchecked
