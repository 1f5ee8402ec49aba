"""RowParallelLinear always adds self.bias after the reduction: with bias=False it adds None (TypeError)."""
import torch.nn.functional as F

from solutions.phase2_advanced import tensor_parallel as _reference
from solutions.phase2_advanced.tensor_parallel import *  # noqa: F401,F403

EXERCISE = "2.7"
CAUGHT_BY = ["test_2_7_row_parallel_linear_matches_nn_linear"]


class RowParallelLinear(_reference.RowParallelLinear):
    def forward(self, x):
        if not self.input_is_parallel:
            x = _reference.ScatterToTensorParallelRegion.apply(x, self.group)
        return _reference.ReduceFromTensorParallelRegion.apply(F.linear(x, self.weight), self.group) + self.bias
