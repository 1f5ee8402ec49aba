"""make_loader uses DataLoader(shuffle=True): every rank iterates over the whole dataset."""
from torch.utils.data import DataLoader

from solutions.phase1_data_parallel.sampler import *  # noqa: F401,F403

EXERCISE = "1.1"
CAUGHT_BY = ["test_1_1_make_loader_gives_each_rank_its_shard"]


def make_loader(dataset, batch_size, rank, world_size, shuffle=True, seed=0, drop_last=False):
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last)
