"""Contract of exercise 3.5 (distributed_optimizer.py's docstrings; guidelines 3.5): Horovod's DistributedOptimizer,
the state broadcasts and the linear scaling rule."""

import torch

from contracts import SIGNATURE_DEFAULT, default, explicit, none, raises, when


def _sub(c):
    g = c.a.get("group")
    return g is not None and torch.distributed.get_world_size(g) < c.world


CONTRACT = {
    "DistributedOptimizer.__init__": [
        default("backward_passes_per_step"), explicit("backward_passes_per_step", 1),
        when("backward_passes_per_step > 1", lambda c: c.a["backward_passes_per_step"] > 1),
        none("group"), when("group a subgroup", _sub),
        when("SGD with momentum", lambda c: isinstance(c.a["optimizer"], torch.optim.SGD)
             and c.a["optimizer"].defaults.get("momentum", 0) > 0),
        when("Adam/AdamW", lambda c: isinstance(c.a["optimizer"], (torch.optim.Adam, torch.optim.AdamW))),
        when("a frozen parameter", lambda c: any(not p.requires_grad for p in c.a["model"].parameters())),
        when("no process group (one process)", lambda c: not torch.distributed.is_initialized()),
        raises("backward_passes_per_step < 1", ValueError),
    ],
    "DistributedOptimizer.synchronize": [
        when("before step (to clip)", lambda c: True),
        when("twice without a backward between", lambda c: c.history[-1:] == ("synchronize",)),
    ],
    "DistributedOptimizer.step": [
        none("closure"),
        when("after synchronize()", lambda c: c.history[-1:] == ("synchronize",)),
        when("several steps", lambda c: c.count > 2),
        raises("a closure (not supported)", ValueError),
    ],
    "DistributedOptimizer.zero_grad": [default("set_to_none"),
                                       when("set_to_none=False", lambda c: c.a["set_to_none"] is False),
                                       raises("while all-reduces are in flight", RuntimeError)],
    "DistributedOptimizer.state_dict": [when("called", lambda c: True)],
    "DistributedOptimizer.load_state_dict": [when("called", lambda c: True),
                                             raises("while all-reduces are in flight", RuntimeError)],
    "DistributedOptimizer.add_param_group": [raises("refused (add to the wrapped optimizer)", RuntimeError)],
    "broadcast_parameters": [
        when("an nn.Module (parameters and buffers)", lambda c: isinstance(c.a["params"], torch.nn.Module)),
        when("a dict name -> tensor", lambda c: isinstance(c.a["params"], dict)),
        when("an iterable of tensors", lambda c: not isinstance(c.a["params"], (dict, torch.nn.Module))),
        default("root_rank"), when("root_rank > 0", lambda c: c.a["root_rank"] > 0),
        when("group a subgroup, root_rank a global rank", _sub),
        when("no process group", lambda c: not torch.distributed.is_initialized()),
    ],
    "broadcast_optimizer_state": [
        when("fresh optimizers on the receivers (empty state)", lambda c: True),
        when("Adam (step tensors, moments)", lambda c: "Adam" in type(getattr(c.a["optimizer"], "optimizer",
                                                                               c.a["optimizer"])).__name__),
        when("SGD with momentum", lambda c: isinstance(getattr(c.a["optimizer"], "optimizer", c.a["optimizer"]),
                                                        torch.optim.SGD)),
        when("a DistributedOptimizer", lambda c: type(c.a["optimizer"]).__name__ == "DistributedOptimizer"),
        when("a root with no state, receivers with some (theirs must go)", lambda c: torch.distributed.get_rank()
             == c.a["root_rank"] and not getattr(c.a["optimizer"], "optimizer", c.a["optimizer"]).state
             and not c.a.get("group")),
        when("a state entry that is no tensor (every state entry)", lambda c: any(
            not isinstance(v, torch.Tensor) for entry in getattr(c.a["optimizer"], "optimizer", c.a["optimizer"])
            .state.values() for v in entry.values())),
        default("root_rank"), when("root_rank > 0", lambda c: c.a["root_rank"] > 0),
        when("group a subgroup", _sub),
    ],
    "linear_scaling_lr": [
        default("warmup_steps"), when("warmup_steps > 0, during warm-up", lambda c: c.a["step"] < c.a["warmup_steps"]),
        when("at the end of warm-up (step = warmup_steps)", lambda c: c.a["step"] == c.a["warmup_steps"] > 0),
        when("after warm-up", lambda c: c.a["step"] > c.a["warmup_steps"] > 0),
        default("reference_batch"), when("reference_batch given", lambda c: "reference_batch" in c.given),
        when("global_batch < reference_batch (lr scaled down)", lambda c: c.a["global_batch"] < c.a["reference_batch"]),
        when("step 0", lambda c: c.a["step"] == 0),
        raises("bad arguments", ValueError),
    ],
}

IRRELEVANT = {
    "DistributedOptimizer.__init__: backward_passes_per_step < 1": "given code (the argument check before the "
        "EXERCISE region)",
    "DistributedOptimizer.synchronize: twice without a backward between": "the docstring promises nothing for a "
        "second synchronize() without a backward pass between (Horovod neither)",
    "broadcast_optimizer_state: root_rank left to its default": SIGNATURE_DEFAULT,
    "broadcast_parameters: root_rank left to its default": SIGNATURE_DEFAULT,
    "linear_scaling_lr: bad arguments": "given code (the argument check before the EXERCISE region)",
    "broadcast_parameters: no process group": "given code (the early return before the EXERCISE region); a test of "
        "it would pass on the untouched template",
    "DistributedOptimizer.add_param_group": "given code (no EXERCISE region): refuses, as documented",
    "DistributedOptimizer.load_state_dict": "given code (no EXERCISE region): the wrapped optimizer's; the refusal while all-reduces are in flight "
        "is given",
    "DistributedOptimizer.step: a closure (not supported)": "given code (no EXERCISE region): the refusal before the graded synchronize()",
    "DistributedOptimizer.step: closure not None": "given code (no EXERCISE region): the refusal before the graded synchronize()",
    "DistributedOptimizer.zero_grad": "given code (no EXERCISE region): the wrapped zero_grad and a given refusal",
}
