"""make_loader never passes drop_last on: the shards are always padded."""
from torch.utils.data import DataLoader

from solutions.phase1_data_parallel.sampler import *  # noqa: F401,F403

EXERCISE = "1.1"
CAUGHT_BY = ["test_1_1_make_loader_honours_shuffle_seed_and_drop_last"]


def make_loader(dataset, batch_size, rank, world_size, shuffle=True, seed=0, drop_last=False):
    sampler = ShardSampler(dataset, world_size, rank, shuffle=shuffle, seed=seed)  # noqa: F405
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)
