"""ColumnParallelLinear never passes its input through f: the input gradient is never all-reduced (partial on every rank)."""
import torch.nn.functional as F

from solutions.phase2_advanced import tensor_parallel as _reference
from solutions.phase2_advanced.tensor_parallel import *  # noqa: F401,F403

EXERCISE = "2.7"
CAUGHT_BY = ["test_2_7_column_parallel_linear_matches_nn_linear"]


class ColumnParallelLinear(_reference.ColumnParallelLinear):
    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return _reference.GatherFromTensorParallelRegion.apply(y) if self.gather_output else y
