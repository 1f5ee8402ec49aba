"""--model-ema: an exponential moving average of the weights, evaluated beside the model.

    ema = WeightsEMA(model, ema_decay(...), every, warmup_epochs)  # before DDP / fully_shard hooks
    strategy.hold_like_the_model(ema.module)   # fsdp: sharded like the model (parallel.py)
    ema.update(step, epoch, strategy.module)   # after an optimizer step; acts every --model-ema-steps
    ema.module                                 # the averaged model (evaluate it like the model)
    ema.progress(), ema.restore(progress)      # its part of a checkpoint: the count (its weights are
                                               # the checkpointer's "ema" module)

build.py registers it: with the checkpointer (a stateful part, and its module), the evaluator
(evaluated beside the model, reported as "EMA") and the loop (an update after every step).

What torchvision's reference does (references/classification/train.py and utils.py,
ExponentialMovingAverage), and so this:
  - torch.optim.swa_utils.AveragedModel with use_buffers=True (BatchNorm statistics are
    averaged too) and an EMA multi-avg function (get_ema_multi_avg_fn: one _foreach_lerp_
    per dtype, not a Python loop over tensors);
  - updated every --model-ema-steps optimizer steps (torchvision's --model-ema-steps, 32),
    with the decay adjusted for that interval and the run's length: alpha = (1 -
    --model-ema-decay) * global_batch * steps / epochs, at most 1 (pycls' adjustment, as
    torchvision writes it with world_size * batch_size for the global batch);
  - during the LR warm-up epochs the average restarts at every update (it keeps copying the
    weights: n_averaged back to 0).

Differences, each for a reason:
  - the update is AveragedModel's arithmetic, but AveragedModel.update_parameters reads
    `n_averaged == 0` and `n_averaged > 0` from a device tensor (two host-device
    synchronisations per update, torch 2.14.1's swa_utils.py); here a host counter mirrors
    n_averaged, so an update reads nothing back;
  - --parallel fsdp: the average is a second model sharded like the live one (fully_shard on
    the same units), and each rank averages its own shards: the EMA of a sharded model is
    the per-shard EMA of its DTensors' local pieces (elementwise, so it shards trivially);
    its evaluation all-gathers like the model's, and its checkpoint is written by every rank
    through DCP beside the model's (sharded_checkpoint.py);
  - buffers: after each update every rank takes rank 0's averaged buffers (BatchNorm
    statistics differ between ranks after a forward; a checkpoint keeps one copy), so the
    average is one value on every rank, and a resumed run continues it bit for bit.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from solutions.phase4_production.trainer.parallel import broadcast_from_rank0


def ema_decay(decay: float, global_batch: int, steps: int, epochs: int) -> float:
    """The per-update decay of --model-ema-decay `decay` for an update every `steps` optimizer
    steps of `global_batch` samples over `epochs`, adjusted as torchvision's reference does."""
    alpha = min(1.0, (1.0 - decay) * global_batch * steps / epochs)
    return 1.0 - alpha


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class WeightsEMA(AveragedModel):
    """AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True) whose
    update reads nothing from the device (a host counter), averages local shards (fsdp), and
    keeps rank 0's buffers (module docstring)."""

    def __init__(self, model: nn.Module, decay: float, every: int, warmup_epochs: float):
        super().__init__(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self.decay, self.every, self.warmup_epochs = decay, every, warmup_epochs
        self.updates = 0  # n_averaged, on the host

    def _pairs(self, model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        mine = itertools.chain(self.module.parameters(), self.module.buffers())
        theirs = itertools.chain(model.parameters(), model.buffers())
        pairs = [(_local(a.detach()), _local(b.detach())) for a, b in zip(mine, theirs, strict=True)]
        return [a for a, _ in pairs], [b for _, b in pairs]

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        """AveragedModel's update (copy on the first, the EMA function after) on local tensors."""
        mine, theirs = self._pairs(model)
        if self.updates == 0:
            for a, b in zip(mine, theirs):
                a.copy_(b)
        else:
            groups: dict[torch.dtype, tuple[list, list]] = {}
            for a, b in zip(mine, theirs):
                group = groups.setdefault(a.dtype, ([], []))
                group[0].append(a)
                group[1].append(b)
            for own, current in groups.values():
                self.multi_avg_fn(own, current, None)  # get_ema_multi_avg_fn ignores the count
        self.n_averaged += 1
        self.updates += 1
        self._buffers_from_rank0()

    def _buffers_from_rank0(self) -> None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        broadcast_from_rank0(list(self.module.buffers()))

    def update(self, step: int, epoch: int, model: nn.Module) -> bool:
        """After optimizer step `step` (1-based) of `epoch`: update every `every` steps, and
        restart the average during the warm-up epochs (torchvision: epoch < --lr-warmup-epochs).
        Collective (the buffers' broadcast): every rank calls it at every step. True if it acted."""
        if step % self.every:
            return False
        self.update_parameters(model)
        if epoch < self.warmup_epochs:
            self.restart()
        return True

    def restart(self) -> None:
        """The next update copies the weights again (n_averaged = 0)."""
        self.n_averaged.zero_()
        self.updates = 0

    def start_from(self, model: nn.Module) -> None:
        """The average starts from `model`'s weights (a run started --init-from), and restarts
        at the next update as a fresh run's does."""
        self.update_parameters(model)
        self.restart()

    # ------------------------------------------------------------ checkpoints

    def progress(self) -> dict:
        """The EMA's entries of a checkpoint's progress: the count (its weights are the
        checkpoint's "ema" module: in the file, or through DCP beside the model's shards)."""
        return {"ema_updates": self.updates}

    def restore(self, progress: dict) -> None:
        """The count from a checkpoint's progress (the weights were loaded with the modules)."""
        self.updates = int(progress.get("ema_updates", 0))
        self.n_averaged.fill_(self.updates)
