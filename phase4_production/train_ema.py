"""--model-ema: an exponential moving average of the weights, evaluated beside the model.

    ema = WeightsEMA.create(model, cfg, steps_per_epoch, parallel)  # before DDP / fully_shard hooks
    ema.update(step, epoch, parallel.module)   # after an optimizer step; acts every --model-ema-steps
    ema.module                                 # the averaged model (evaluate it like the model)

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


def ema_decay(cfg, steps: int | None = None) -> float:
    """The per-update decay of --model-ema-decay, adjusted as torchvision's reference does."""
    steps = cfg.model_ema_steps if steps is None else steps
    alpha = min(1.0, (1.0 - cfg.model_ema_decay) * cfg.global_batch * steps / cfg.epochs)
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

    @classmethod
    def create(cls, model: nn.Module, cfg, device: torch.device, dtype: torch.dtype | None = None) -> "WeightsEMA":
        """The EMA of `model` (the bare module, before DDP or fully_shard adds hooks to it).
        --parallel fsdp: its copy is sharded like the model (train_parallel.shard)."""
        ema = cls(model, ema_decay(cfg), cfg.model_ema_steps, cfg.warmup_epochs)
        if cfg.parallel == "fsdp":
            from phase4_production.train_parallel import shard

            shard(ema.module, device, dtype, cfg.reshard_after_forward, cfg.cpu_offload)
        return ema

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
        from phase4_production.train_parallel import _by_dtype

        for group in _by_dtype(list(self.module.buffers())):
            flat = torch.cat([b.reshape(-1) for b in group])
            dist.broadcast(flat, src=0)
            for b, value in zip(group, flat.split([b.numel() for b in group])):
                b.copy_(value.view_as(b))

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

    # ------------------------------------------------------------ checkpoints

    def progress(self) -> dict:
        """What the checkpoint's progress holds of the EMA under ddp: its weights and count."""
        return {"ema": self.module.state_dict(), "ema_updates": self.updates}

    def restore(self, progress: dict) -> None:
        """The EMA from a checkpoint's progress: ddp's weights (under "ema"; fsdp loads them
        through DCP), and the count."""
        state = progress.pop("ema", None)
        if state is not None:
            self.module.load_state_dict(state)
        self.updates = int(progress.get("ema_updates", 0))
        self.n_averaged.fill_(self.updates)
