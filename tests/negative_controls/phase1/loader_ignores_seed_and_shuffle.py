"""make_loader builds the sampler with its defaults: shuffle and seed are silently ignored."""
from torch.utils.data import DataLoader

from solutions.phase1_data_parallel.sampler import *  # noqa: F401,F403

EXERCISE = "1.1"
CAUGHT_BY = ["test_1_1_make_loader_honours_shuffle_seed_and_drop_last"]


def make_loader(dataset, batch_size, rank, world_size, shuffle=True, seed=0, drop_last=False):
    sampler = ShardSampler(dataset, world_size, rank, drop_last=drop_last)  # noqa: F405
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)
