"""How the trainer's ranks exchange gradients: DDP's communication hook.

    register_comm_hook(ddp, options, faults, step, momentum, decays)
                                    4.4's compression (powersgd, topk, dgc), or the fault
                                    injector's "allreduce" point (parallel.DDPStrategy attaches it)
    set_sparsity(state, options, step)   --topk-warmup: top-k's fraction at this step

`options`: the config's parallel section (--compression and its settings).
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel as DDP

from solutions.phase4_production.compression import (CompressionState, PowerSGDState, TopKState, powersgd_hook,
                                                     sparsity_warmup, topk_hook)
from solutions.phase4_production.recovery import FaultInjector


def register_comm_hook(ddp: DDP, options, faults: FaultInjector, step: int, momentum: float = 0.0,
                       decays: dict[int, float] | None = None) -> CompressionState | None:
    """4.4's compression hook (returns its state), or the fault injector's all-reduce point
    (one hook per DDP). Compression begins at step options.compression_start of the run, and
    never in the first 2 steps of an attempt: a new DDP holds every parameter in one bucket
    until its first step ends, and the hook's memory is kept per bucket. For the same
    reason an attempt's hook starts with empty memory (error feedback, warm-start Q): a
    compressed run resumes correctly, but not bit-identically (with dgc the momentum, which
    lives in the hook, restarts from zero too).
    dgc: top-k with DGC's momentum correction; the hook carries `momentum` (--momentum, nesterov,
    as make_optimizer's SGD would) and each parameter's weight decay (`decays`: {id(parameter):
    decay}, step.weight_decays), and make_optimizer's SGD has neither."""
    start = max(2, options.compression_start - step)  # in this attempt's steps
    state = None
    if options.compression == "powersgd":
        state = PowerSGDState(matrix_approximation_rank=options.compression_rank, start_powerSGD_iter=start)
        ddp.register_comm_hook(state, powersgd_hook)
    elif options.compression == "topk":
        state = TopKState(ratio=options.topk_ratio, start_iter=start)
        ddp.register_comm_hook(state, topk_hook)
    elif options.compression == "dgc":
        state = TopKState(ratio=options.topk_ratio, start_iter=start, momentum=momentum, nesterov=momentum > 0,
                          weight_decay=lambda p: decays[id(p)])
        ddp.register_comm_hook(state, topk_hook)
    elif any(f.phase == "allreduce" for f in faults.faults):
        ddp.register_comm_hook(None, faults.allreduce_hook)
    return state


def set_sparsity(compression: CompressionState | None, options, step: int) -> None:
    """--topk-warmup: the fraction top-k sends at this step of the run (DGC's sparsity warm-up,
    a function of the run's step, so a resumed run continues it)."""
    if isinstance(compression, TopKState) and options.topk_warmup:
        compression.ratio = sparsity_warmup(step - options.compression_start, options.topk_warmup,
                                            options.topk_ratio)
