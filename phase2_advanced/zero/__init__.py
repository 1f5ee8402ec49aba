"""Exercise 2.4: ZeRO-style sharding of optimizer state, gradients and parameters, by hand.

Data parallelism on N ranks keeps N identical copies of everything. Adam in fp32 costs,
per rank, 4 bytes of parameter + 4 of gradient + 8 of state (exp_avg, exp_avg_sq) for
each of the Ψ parameters: 16Ψ. ZeRO keeps 1/N of it on each rank instead, one stage per
file (phase2_advanced/guidelines.md, 2.4, says what to read for which stage):

    stage0.py   ShardedOptimizer (given): stages 0-2 are torch optimizers wrapping ANY torch.optim
                optimizer; DataParallelOptimizer, stage 0, the baseline
    stage1.py   ZeroStage1: optimizer state sharded by whole parameters
    stage2.py   ZeroStage2: + gradients sharded, every parameter cut into N flat slices
    flat.py     FlatParams, sharding_units (given): the flat layout stage 3 works on
    stage3.py   ZeroStage3: + parameters sharded, a module wrapper
    memory.py   zero_state_bytes, STAGES (given): the bytes per rank of each stage

                         parameters        gradients                 optimizer state   bytes per rank, Adam
    DataParallelOptimizer all              all (all-reduce)          all               16Ψ
    ZeroStage1           all               all (all-reduce)          my parameters     4Ψ + 4Ψ + 8Ψ/N (+ imbalance)
    ZeroStage2           all               my slices (reduce-scatter my slices         4Ψ + 12Ψ/N
                                           per parameter in backward)
    ZeroStage3           my slices (+ the  my slices (same, per      my slices         16Ψ/N
                         running unit's)   unit)                     (the optimizer's)

Communication per step, elements each rank sends (ring algorithms): DP's all-reduce is
2Ψ(N-1)/N = a reduce-scatter plus an all-gather; stage 2 is exactly those two; stage 1
all-reduces then broadcasts every parameter from its owner (a broadcast sends the whole
tensor: 2Ψ(N-1)/N + Ψ); stage 3 all-gathers twice and reduce-scatters once: 1.5x DP. On
gloo (torch 2.14) reduce_scatter_single runs an all-reduce inside and keeps one chunk
(all-reduce's traffic); NCCL runs a real ring reduce-scatter.

Everything is imported from here: `from phase2_advanced.zero import ZeroStage1, ZeroStage2, ZeroStage3`.

Production: torch.distributed.optim.ZeroRedundancyOptimizer (stage 1, whole parameters),
DeepSpeed ZeRO stages 1-3 (flat partitions), torch.distributed.fsdp.fully_shard (FSDP2,
torch >= 2.6 under that name: stage 3, every parameter a DTensor sharded on dim 0; the
guidelines, 2.4, "From ZeRO-3 to FSDP2", map this package onto it).
"""

from .stage0 import DataParallelOptimizer, ShardedOptimizer
from .stage1 import ZeroStage1, partition_parameters
from .stage2 import ZeroStage2
from .flat import FlatParams, sharding_units
from .stage3 import ZeroStage3, queue_callback
from .memory import STAGES, layer_numels, zero_state_bytes

__all__ = ["ShardedOptimizer", "DataParallelOptimizer", "partition_parameters", "ZeroStage1", "ZeroStage2",
           "FlatParams", "sharding_units", "ZeroStage3", "queue_callback", "STAGES", "layer_numels",
           "zero_state_bytes"]
