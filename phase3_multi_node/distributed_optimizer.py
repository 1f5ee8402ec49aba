"""Exercise 3.5: a Horovod-style DistributedOptimizer, state broadcasts, and the linear scaling rule.

Horovod puts data parallelism in the OPTIMIZER instead of a model wrapper (DDP):

    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr, momentum=0.9), model)
    broadcast_parameters(model, root_rank=0)         # same starting weights everywhere
    broadcast_optimizer_state(optimizer, root_rank=0)  # same momenta / Adam moments / step counts
    for inputs, targets in loader:                      # this rank's shard of the global batch
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()  # hooks launch async all-reduces
        optimizer.step()                                 # waits for them, averages, steps

    backward of pass k (the last of the step)           step()
    layer L   grad ready -> all_reduce(async) ---------+
    layer L-1 grad ready -> all_reduce(async) -------+ |   wait every Work
    ...                                              | |   .grad /= world * k
    layer 1   grad ready -> all_reduce(async) -----+ | |   wrapped optimizer.step()
                                                   v v v

With `backward_passes_per_step = k`, passes 1..k-1 only accumulate into .grad (no
communication); the k-th pass launches one all-reduce per parameter as its gradient
becomes ready, so communication overlaps the rest of that backward. After step()'s
synchronisation every .grad holds the MEAN over ranks and passes of the per-pass
gradients: with equal micro-batches of mean losses, the gradient of one big batch of
world * k micro-batches. (Horovod averages over ranks only and leaves 1/k to the loss:
its examples call `loss.div_(k)`.)

Collectives pair by call order, not by tensor: if a parameter is unused on one rank
(a branch its data skipped), that rank's gradients arrive in another order, and
launching each as it arrives would pair different tensors of equal size silently. So
every rank launches in one fixed order (reverse registration, as 3.2's buckets), each
all-reduce once it and all before it are ready; Horovod's coordinator negotiates
instead (guidelines, 3.5).

Horovod fuses these per-tensor requests in a fusion buffer (HOROVOD_FUSION_THRESHOLD,
128 MiB by default since Horovod 0.21) before they reach the wire: exercise 3.2's buckets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn


def _world_size(group=None) -> int:
    """Ranks in `group` (the default group if None); 1 without an initialised process group."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps any torch optimizer so that step() uses gradients averaged over the ranks of `group`.

    Contract, per step (every rank runs the same passes on its own data):
      * backward passes 1..k-1 (k = backward_passes_per_step) accumulate into .grad
        locally and communicate nothing;
      * during pass k, gradients are all-reduced (asynchronously, SUM) while backward still
        runs, so communication overlaps the rest of backward;
      * every rank launches its all-reduces in the SAME order, whatever its data did:
        collectives pair by call order, so a parameter unused on some ranks only (its
        gradient arrives on the others, never here) must not change the order. The
        reference launches in reverse registration order (roughly the order backward
        produces gradients, as 3.2's buckets), each as soon as it and every parameter
        before it in that order have their k-th pass;
      * step() launches what is still missing, in that order (a parameter whose gradient
        did not arrive k times counts with its .grad as it stands, zeros if None), waits
        for every all-reduce, divides by world_size * k, then steps the wrapped
        optimizer: .grad = mean over ranks and passes;
      * a gradient computed more than k times before step() raises RuntimeError (from that
        backward pass). The count starts again at every step() (synchronize()), not only
        at this wrapper's zero_grad(): gradients may be cleared any way (model.zero_grad(),
        p.grad = None, the wrapper's zero_grad()).
      * synchronize() can be called before step(), to read or clip the averaged gradients
        (Horovod's `synchronize(); clip_grad_norm_(...); step()`, where Horovod asks for
        `with optimizer.skip_synchronize(): optimizer.step()`): step() then reduces nothing
        again, since nothing reached a parameter after the synchronize().

    zero_grad, state_dict, load_state_dict, param_groups, state and defaults are the
    wrapped optimizer's, so LR schedulers and checkpoints work on the wrapper. Without an
    initialised process group (one process) only the division by k remains.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                 backward_passes_per_step: int = 1, group=None):
        # Optimizer.__init__ is not called: the wrapped optimizer owns param_groups and state.
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self.optimizer = optimizer
        self.backward_passes_per_step = backward_passes_per_step
        self.group = group
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._passes = {p: 0 for p in self._params}  # backward passes that reached p since the last step
        self._pending: list[tuple[torch.Tensor, object]] = []  # (param, Work or None), in launch order
        self._order = self._params[::-1]  # the launch order, the same on every rank
        self._launched = 0  # self._order[:self._launched] are launched in this step
        self._hooks = []
        raise NotImplementedError('TODO 3.5: hook each parameter of self._params to call self._on_grad_ready once its .grad is accumulated; see post-accumulate hooks')

    def _launch(self, param: torch.Tensor) -> None:
        """Start the async SUM all-reduce of param.grad (zeros if None) in self.group; append
        (param, its Work) to self._pending (Work None without other ranks)."""
        raise NotImplementedError('TODO 3.5: all-reduce param.grad in place WITHOUT waiting (async_op=True: a Work); keep (param, work) in self._pending for step()')

    def _launch_in_order(self, everything: bool = False) -> None:
        """Launch, in self._order from self._launched on, every parameter whose k-th pass has
        arrived, stopping at the first that has not (everything=True: launch all the rest)."""
        raise NotImplementedError('TODO 3.5: from self._launched, launch each of self._order at its k-th pass (any, if everything=True); stop at the first not ready')

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: count this pass for `param`; on its k-th pass, launch what
        is ready in the shared order (self._launch_in_order())."""
        raise NotImplementedError("TODO 3.5: count the pass; at a parameter's k-th launch what is ready, in the shared order; a (k+1)-th pass raises RuntimeError")

    def synchronize(self) -> None:
        """Launch the all-reduces still missing, wait for all, and leave the mean in every .grad;
        the pass counts start again from 0."""
        raise NotImplementedError('TODO 3.5: launch the rest in order, wait for EVERY Work (.grad has its result only then), divide by world_size * k, reset counts')

    def step(self, closure=None):
        """synchronize() (unless it was called since the last backward pass: nothing is pending
        and no pass counted), then the wrapped optimizer's step(). A closure would run backward
        inside step() and launch all-reduces behind the counts: not supported."""
        if closure is not None:
            raise ValueError("DistributedOptimizer.step() takes no closure; run backward before step()")
        if self._pending or any(self._passes.values()):
            self.synchronize()
        return self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped zero_grad; also restarts the pass count. Refused while all-reduces are in flight."""
        if self._pending:
            raise RuntimeError("zero_grad() while gradient all-reduces are in flight (after the last "
                               "backward pass, before step()): the reduced gradients would land after it")
        for p in self._params:
            self._passes[p] = 0
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        if self._pending:
            raise RuntimeError("load_state_dict() while gradient all-reduces are in flight")
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError("add the parameter group to the wrapped optimizer before wrapping it: "
                           "its parameters would have no all-reduce hook")

    def __repr__(self) -> str:
        return (f"DistributedOptimizer(backward_passes_per_step={self.backward_passes_per_step}, "
                f"{self.optimizer!r})")


def broadcast_parameters(params, root_rank: int = 0, group=None) -> None:
    """Overwrite, in place on every rank, `params` with root_rank's values.

    `params`: an nn.Module (its state_dict: parameters AND buffers), a dict name -> tensor
    (e.g. model.state_dict()), or an iterable of tensors; the same structure on every
    rank. `root_rank` is a global rank, also when `group` is a subgroup (as dist.broadcast's
    `src`): on the group of global ranks [1, 2], root_rank=1 is the group's rank 0. Does
    nothing without a process group.
    """
    if _world_size(group) == 1:
        return
    raise NotImplementedError("TODO 3.5: broadcast every tensor (a Module's state_dict: buffers too) from root_rank, in one order on all ranks; wait for all")


@dataclass(frozen=True)
class _TensorSpec:
    """Stands for a state tensor in the pickled structure: what a receiver allocates."""

    shape: tuple
    dtype: torch.dtype
    on_cpu: bool  # e.g. Adam's `step` stays a CPU tensor beside CUDA parameters


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0, group=None) -> None:
    """Make every rank's optimizer state and hyper-parameters root_rank's.

    After it, optimizer.state_dict() is the same on every rank: per parameter every
    state entry (Adam's `step` as the tensor it is, exp_avg, exp_avg_sq; SGD's
    momentum_buffer) and every param_group option (lr, betas, weight_decay...). It works
    when the receiving optimizers are fresh (empty state) and must not change the
    parameters (no dummy step). `optimizer` may be a DistributedOptimizer. `root_rank` is a
    global rank, also when `group` is a subgroup (as in broadcast_parameters). Bulk tensors
    travel by broadcast on the device of their parameter, so the same code runs on NCCL.
    """
    if _world_size(group) == 1:
        return
    raise NotImplementedError('TODO 3.5: the structure (tensors as shape, dtype) by broadcast_object_list, then each tensor by broadcast; receivers load it')


def linear_scaling_lr(step: int, base_lr: float, global_batch: int, reference_batch: int = 256,
                      warmup_steps: int = 0) -> float:
    """The learning rate of optimizer step `step` (0-based) under Goyal et al. (2017):

        scaled = base_lr * global_batch / reference_batch          (linear scaling rule)
        lr(t)  = base_lr + (scaled - base_lr) * t / warmup_steps   for t < warmup_steps
        lr(t)  = scaled                                            for t >= warmup_steps

    `base_lr` is the rate tuned for `reference_batch` samples per step (0.1 for 256 in
    the paper); the warm-up ramps linearly from it, a constant increment per step, and
    reaches `scaled` at t = warmup_steps. lr(t) is proportional to base_lr, so with
    base_lr=1.0 it is the factor for torch.optim.lr_scheduler.LambdaLR on an optimizer
    created with lr=base_lr:
        LambdaLR(opt, lambda t: linear_scaling_lr(t, 1.0, global_batch, 256, warmup_steps))
    """
    if step < 0 or global_batch < 1 or reference_batch < 1 or warmup_steps < 0:
        raise ValueError(f"need step >= 0, global_batch >= 1, reference_batch >= 1, warmup_steps >= 0; got "
                         f"{step}, {global_batch}, {reference_batch}, {warmup_steps}")
    raise NotImplementedError('TODO 3.5: base_lr x global_batch / reference_batch, ramped linearly from base_lr (step 0) to it (step warmup_steps) during warm-up')
