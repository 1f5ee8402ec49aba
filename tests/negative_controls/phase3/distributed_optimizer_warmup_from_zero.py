"""The warm-up ramps the learning rate from 0 (scaled * t / warmup_steps, as many transformer schedules do)
instead of from base_lr as Goyal et al.'s gradual warm-up does."""
from solutions.phase3_multi_node.distributed_optimizer import *  # noqa: F401,F403

EXERCISE = "3.5"
CAUGHT_BY = ["test_3_5_linear_scaling_schedule"]


def linear_scaling_lr(step, base_lr, global_batch, reference_batch=256, warmup_steps=0):
    scaled = base_lr * global_batch / reference_batch
    return scaled if step >= warmup_steps else scaled * step / warmup_steps
