"""ZeRO-2 slices every parameter, frozen ones too, and gives each slice without a gradient a zero one before the
step "so that every rank steps the same tensors": AdamW's decoupled weight decay then shrinks the frozen
parameters, which torch.optim never touches (they have no .grad)."""
import torch

from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_tied_and_frozen_parameters_stage2"]


class ZeroStage2(_reference.ZeroStage2):
    def __init__(self, params, optimizer_class, **defaults):
        _reference.ShardedOptimizer.__init__(self, params, optimizer_class, **defaults)
        self.flat, self.shard = {}, {}
        everything = list(dict.fromkeys(p for group in self.param_groups for p in group["params"]))
        for p in everything:
            size = -(-p.numel() // self.world_size)
            flat = torch.zeros(size * self.world_size, dtype=p.dtype, device=p.device)
            flat[:p.numel()].copy_(p.detach().reshape(-1))
            p.data = flat[:p.numel()].view_as(p)
            self.flat[p], self.shard[p] = flat, flat[self.rank * size:(self.rank + 1) * size]
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self.trainable = everything  # all-gathered after the step like the others
        self._build([[self.shard[p] for p in dict.fromkeys(group["params"])] for group in self.param_groups])

    @torch.no_grad()
    def step(self, closure=None):
        for shard in self.shard.values():
            if shard.grad is None:
                shard.grad = torch.zeros_like(shard)
        return super().step(closure)
