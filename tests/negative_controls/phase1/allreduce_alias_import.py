"""gather_sum calls dist.all_reduce imported under another name (from torch.distributed import all_reduce as ...)."""
from torch.distributed import all_reduce as _sum_over_ranks

from solutions.phase1_data_parallel import allreduce as _reference
from solutions.phase1_data_parallel.allreduce import *  # noqa: F401,F403

EXERCISE = "1.2"
CAUGHT_BY = ["test_1_2_strategies_equal_dist_all_reduce"]


def allreduce_gather_sum(tensor, op="sum"):
    _reference._check(tensor, op)
    _sum_over_ranks(tensor)
    return _reference._finish(tensor, op)


STRATEGIES = dict(_reference.STRATEGIES, gather_sum=allreduce_gather_sum)
