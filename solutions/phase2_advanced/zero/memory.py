"""The memory model of exercise 2.4 (given): the bytes a rank holds with each stage.

`zero_state_bytes` gives the bytes per rank, padding included; common.measure's
`training_memory(model, optimizer)` measures them (phase2_advanced/guidelines.md, 2.4).
"""

from __future__ import annotations

import torch.nn as nn

from .stage0 import DataParallelOptimizer
from .stage1 import ZeroStage1, partition_parameters
from .stage2 import ZeroStage2
from .stage3 import ZeroStage3


STAGES = {0: DataParallelOptimizer, 1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}


def layer_numels(model: nn.Module) -> list[int]:
    """Trainable parameter counts of the children of `model` that have some: the units of stage 3 (call it on the
    model before wrapping it: ZeroStage3 replaces a unit's parameters by its shard)."""
    counts = [sum(p.numel() for p in child.parameters() if p.requires_grad) for child in model.children()]
    return [c for c in counts if c]


def zero_state_bytes(stage: int, model: nn.Module, world_size: int, rank: int = 0,
                     element_size: int = 4) -> dict[str, int]:
    """Bytes `rank` holds after a step (before zero_grad()) with torch.optim.Adam, for the classes above.

    Keys 'params', 'grads', 'optimizer', 'total', the kinds of common.measure.training_memory:
    'params' and 'grads' are the parameters of the model (stage 3: of the ZeroStage3 wrapping
    it, i.e. this rank's shards) and their .grad; 'optimizer' is what the optimizer keeps
    besides (stage 2's slices of parameters and gradients, Adam's state, with its `step`, a
    4-byte scalar per tensor it steps). Ψ counts the trainable parameters (frozen ones add
    their bytes to 'params' everywhere), e = element_size, N = world_size:
      stage 0 (DP):  eΨ params, eΨ grads, 2eΨ Adam                                    = 16Ψ
      stage 1:       eΨ params, eΨ grads, 2e x (the elements `rank` owns)              ~ 4Ψ + 4Ψ + 8Ψ/N
      stage 2:       each parameter padded to N*S_p, S_p = ceil(numel/N), S = sum of S_p:
                     eNS params, 0 grads, 3eS (grad slices + Adam)                      ~ 4Ψ + 12Ψ/N
      stage 3:       each unit (layer_numels; all sharded) padded likewise, S3 = sum of its slices:
                     eS3 params (the shards), eS3 grads, 2eS3 Adam                      ~ 16Ψ/N
    """
    numels = [p.numel() for p in model.parameters() if p.requires_grad]
    if stage not in STAGES or world_size < 1 or not 0 <= rank < world_size or not numels:
        raise ValueError(f"need a stage in 0..3, world_size >= 1, 0 <= rank < world_size and a model with trainable "
                         f"parameters; got {stage}, {world_size}, {rank}")
    psi, e, n, step = sum(numels), element_size, world_size, 4
    if stage == 0:
        params, grads, optim = e * psi, e * psi, 2 * e * psi + step * len(numels)
    elif stage == 1:
        mine = [k for k, owner in zip(numels, partition_parameters(numels, n)) if owner == rank]
        params, grads, optim = e * psi, e * psi, 2 * e * sum(mine) + step * len(mine)
    elif stage == 2:
        s = sum(-(-k // n) for k in numels)
        params, grads, optim = e * n * s, 0, 3 * e * s + step * len(numels)
    else:
        units = layer_numels(model)
        s3 = sum(-(-u // n) for u in units)
        params, grads, optim = e * s3, e * s3, 2 * e * s3 + step * len(units)
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}
