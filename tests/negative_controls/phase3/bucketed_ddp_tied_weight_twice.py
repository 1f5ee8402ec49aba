"""BucketedDDP lists the parameters module by module (`for m in module.modules(): m.parameters(recurse=False)`), so
a weight two layers share gets two bucket slots and two hooks: its gradient is right, but it is all-reduced twice."""
from solutions.phase3_multi_node import bucketed_ddp as _reference
from solutions.phase3_multi_node.bucketed_ddp import *  # noqa: F401,F403

EXERCISE = "3.2"
CAUGHT_BY = ["test_3_2_tied_and_frozen_parameters_like_ddp"]


class BucketedDDP(_reference.BucketedDDP):
    def _build_buckets(self, cap_bytes):
        self.params = [p for m in self.module.modules() for p in m.parameters(recurse=False)]
        self.buckets = assign_buckets(self.params, cap_bytes)
        self.flats, self.slots, self.bucket_of = [], {}, {}
        for b, indices in enumerate(self.buckets):
            first = self.params[indices[0]]
            flat = first.new_zeros(sum(self.params[i].numel() for i in indices))
            offset = 0
            for i in indices:
                numel = self.params[i].numel()
                self.slots[i] = flat[offset:offset + numel].view_as(self.params[i])
                self.bucket_of[i] = b
                offset += numel
            self.flats.append(flat)
        for i in self.slots:
            self.params[i].register_post_accumulate_grad_hook(lambda param, i=i: self._grad_ready(i))
