"""Exercise 2.2: mixed precision: autocast, fp32 master weights, a dynamic loss scaler.

    parameters (fp32, "master weights") --autocast casts per op--> bf16/fp16 matmuls
    loss (fp32) * S --backward--> grads of fp32 params (fp32), all multiplied by S
                                  |
    unscale_:  grads /= S ; found_inf = any grad inf/nan  (agreed by all ranks: all-reduce)
    step:      found_inf ? skip : optimizer.step()
    update:    found_inf ? S *= backoff, good = 0
                         : good += 1; good == growth_interval ? S *= growth, good = 0

            fp32          fp16          bf16
    bits    1 + 8 + 23    1 + 5 + 10    1 + 8 + 7     sign + exponent + mantissa
    max     3.4e38        65504         3.4e38
    tiny    1.2e-38       6.1e-5        1.2e-38       smallest normal (subnormals: 1.4e-45, 6.0e-8, 9.2e-41)
    eps     1.2e-7        9.8e-4        7.8e-3        relative spacing at 1.0

fp16 gradients below ~6e-8 flush to zero: multiplying the loss by S (chain rule: every
gradient by S) lifts them into range; S is lowered whenever that overflows. bf16 has
fp32's range and rarely needs a scaler.

Production: `with torch.autocast(device_type, dtype): ...` and `torch.amp.GradScaler`
(same API as `LossScaler`), or FSDP's `MixedPrecision(param_dtype=..., reduce_dtype=...)`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def autocast_dtype(device: torch.device | str) -> torch.dtype:
    """The low-precision dtype for torch.autocast on `device`.

    CUDA: bfloat16 where THAT GPU (`device`'s index; the current device for a bare
    "cuda") computes in bf16 natively, i.e. compute capability >= 8.0 (Ampere and
    newer); float16 (which needs a loss scaler) before. Every other device (CPU, ...):
    bfloat16. Note: torch.cuda.is_bf16_supported() also says True where bf16 is only
    emulated (slowly) on an older GPU; only `including_emulation=False` asks for native.
    """
    device = torch.device(device)
    # EXERCISE 2.2: fp16 on a CUDA device without native bf16 (compute capability < 8: ask the capability of THIS device), else bf16
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
        return torch.float16
    return torch.bfloat16
    # END EXERCISE


class LossScaler:
    """A dynamic loss scaler with the semantics (and API) of torch.amp.GradScaler.

    One optimizer, one step at a time:

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)          # optional: only to look at/clip true gradients
        scaler.step(optimizer)              # unscales if not done yet; skipped on inf/nan
        scaler.update()                     # adjusts the scale; ends the step

    In a process group of several ranks the inf/nan check is agreed by all ranks
    (one all-reduce: MAX here; torch's ShardedGradScaler uses SUM, since any nonzero
    count means inf), so they skip the same steps and their replicas stay identical.

    Any init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and growth_interval >= 1
    behave as in GradScaler. A growth that would make the scale inf is not applied (the
    tracker still restarts). The scale lives in `_scale` and the count of clean steps in
    `_growth_tracker`: state_dict() saves both, and a scaler loaded from it goes on exactly
    as the saved one would have. Gradients that are None (frozen or unused parameters) are
    skipped.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError("need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1 "
                             f"(got {init_scale}, {growth_factor}, {backoff_factor}, {growth_interval})")
        self._scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self._growth_tracker = 0  # consecutive steps without inf/nan since the last change of scale
        self._found_inf: bool | None = None  # None: this step's grads are not unscaled yet

    def get_scale(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * S: its backward gives every gradient multiplied by S."""
        # EXERCISE 2.2: the loss times the current scale
        return loss * self._scale
        # END EXERCISE

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide every gradient of `optimizer`'s parameters by S, in place; record found_inf.

        found_inf is True if any gradient, on any rank, holds an inf or a nan.
        At most once per step (between two `update()` calls).
        """
        if self._found_inf is not None:
            raise RuntimeError("unscale_() was already called since the last update(): gradients would be divided twice")
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        device = grads[0].device if grads else optimizer.param_groups[0]["params"][0].device
        # EXERCISE 2.2: divide the gradients by S in place; self._found_inf := a bool, the same on every rank of the group; see torch.isfinite
        found = torch.zeros(1, device=device)
        inv_scale = 1.0 / self._scale
        for grad in grads:
            grad.mul_(inv_scale)
            found = torch.maximum(found, (~torch.isfinite(grad)).any().float())
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        self._found_inf = bool(found.item())
        # END EXERCISE

    def step(self, optimizer: torch.optim.Optimizer):
        """optimizer.step() on the unscaled gradients, unless they hold an inf/nan (then skip).

        Returns what optimizer.step() returned, None when skipped.
        """
        # EXERCISE 2.2: the gradients are unscaled exactly once per step, and a step with inf/nan is skipped
        if self._found_inf is None:
            self.unscale_(optimizer)
        if self._found_inf:
            return None
        return optimizer.step()
        # END EXERCISE

    def update(self) -> None:
        """Adjust S after the step and start the next step.

        overflow:  S *= backoff_factor, growth tracker -> 0
        else:      tracker += 1; when it reaches growth_interval: S *= growth_factor, tracker -> 0
        """
        if self._found_inf is None:
            raise RuntimeError("update() before unscale_()/step(): no inf check was recorded in this step")
        # EXERCISE 2.2: the rule above (a scale that would become inf does not grow); then start the next step: no inf check recorded
        if self._found_inf:
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                if math.isfinite(self._scale * self.growth_factor):
                    self._scale *= self.growth_factor
                self._growth_tracker = 0
        self._found_inf = None
        # END EXERCISE

    def state_dict(self) -> dict:
        """What a checkpoint must keep (the keys of GradScaler.state_dict())."""
        return {"scale": self._scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self._scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["_growth_tracker"])


def mixed_precision_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: LossScaler | None,
                         inputs: torch.Tensor, targets: torch.Tensor, device: torch.device | str) -> float:
    """One training step with autocast on `device` (cross-entropy loss), returns the loss.

    The parameters stay float32 (autocast casts copies on the fly, per op); the loss is
    computed in float32 from the low-precision logits. The gradients are this batch's
    only. With a scaler: scaled backward, scaler.step, scaler.update (any object with
    GradScaler's API). scaler=None (fine for bf16): plain backward and step.
    """
    device = torch.device(device)
    # EXERCISE 2.2: one step as the docstring says: the forward autocast to autocast_dtype(device), the loss in float32; see torch.autocast
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type=device.type, dtype=autocast_dtype(device)):
        logits = model(inputs)
    loss = F.cross_entropy(logits.float(), targets)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return loss.item()
    # END EXERCISE
