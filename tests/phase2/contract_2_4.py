"""Contract of exercise 2.4 (the docstrings of zero/, one file per stage; guidelines 2.4): stages 0-2 wrapping any
torch.optim optimizer with its options, stage 3's module wrapper with its compute dtype and replication threshold,
the helpers."""

import torch

from contracts import default, explicit, none, raises, when


def _cls(c):
    return c.a.get("optimizer_class")


def _groups(c):
    return c.self.param_groups


def _is(c, *names):
    return _cls(c) is not None and _cls(c).__name__ in names


def _params_in(c):
    return [p for g in _groups(c) for p in g["params"]]


def _optimizer_entries(stage2: bool = False):
    """What every optimizer wrapper takes: the class, its keyword arguments (alone and together), the params."""
    entries = [
        when("SGD without momentum", lambda c: _is(c, "SGD") and not c.a.get("momentum", 0)),
        when("SGD with momentum", lambda c: _is(c, "SGD") and c.a.get("momentum", 0) > 0),
        when("SGD, weight decay with momentum 0", lambda c: _is(c, "SGD") and not c.a.get("momentum", 0)
             and c.a.get("weight_decay", 0) > 0),
        when("SGD, momentum and weight decay", lambda c: _is(c, "SGD") and c.a.get("momentum", 0) > 0
             and c.a.get("weight_decay", 0) > 0),
        when("SGD nesterov", lambda c: c.a.get("nesterov") is True or any(g.get("nesterov") for g in _groups(c))),
        when("SGD dampening", lambda c: c.a.get("dampening", 0) > 0),
        when("Adam", lambda c: _is(c, "Adam")),
        when("Adam with weight decay (L2, coupled)", lambda c: _is(c, "Adam") and c.a.get("weight_decay", 0) > 0),
        when("AdamW (decoupled weight decay)", lambda c: _is(c, "AdamW")),
        when("Adam/AdamW amsgrad", lambda c: c.a.get("amsgrad") is True),
        when("maximize=True", lambda c: c.a.get("maximize") is True),
        when("betas given", lambda c: "betas" in c.a),
        when("a subclass of an ELEMENTWISE optimizer", lambda c: _cls(c).__module__ != "torch.optim"
             and not _cls(c).__module__.startswith("torch.optim.")
             and any(issubclass(_cls(c), getattr(torch.optim, n)) for n in ("SGD", "Adam", "AdamW"))),
        when("params a generator (model.parameters())", lambda c: hasattr(c.a["params"], "__next__")),
        when("params a list of tensors", lambda c: isinstance(c.a["params"], (list, tuple))
             and all(isinstance(p, torch.Tensor) for p in c.a["params"])),
        when("param groups (dicts) with their own lr and weight decay", lambda c: isinstance(c.a["params"], (list, tuple))
             and any(isinstance(g, dict) for g in c.a["params"])),
        when("a frozen parameter among params", lambda c: any(not p.requires_grad for p in _params_in(c))),
        when("a tied parameter listed twice", lambda c: isinstance(c.a["params"], (list, tuple))
             and len({id(p) for p in c.a["params"]}) < len(c.a["params"])),
        when("world > 2", lambda c: c.world > 2),
        when("world of 2", lambda c: c.world == 2),
        when("fewer trainable parameters than ranks", lambda c: len(c.self.trainable) < c.world),
        when("a float64 parameter", lambda c: any(p.dtype == torch.float64 for p in _params_in(c))),
        when("a bfloat16 parameter", lambda c: any(p.dtype == torch.bfloat16 for p in _params_in(c))),
        when("a lr given as a tensor", lambda c: isinstance(c.a.get("lr"), torch.Tensor)),
        raises("optimizer_class not a torch.optim.Optimizer subclass", TypeError),
        raises("no parameter requires a gradient", ValueError, lambda c: "grad" in str(c.raised)),
        two_instances(),
    ]
    if stage2:
        entries += [raises("a non-element-wise optimizer (refused)", ValueError, lambda c: _cls(c) is not None
                           and not any(issubclass(_cls(c), getattr(torch.optim, n)) for n in ("SGD", "Adam", "AdamW")))]
    else:
        entries += [when("a non-element-wise optimizer (Adafactor, whole tensors)", lambda c: _is(c, "Adafactor"))]
    return entries


def two_instances():
    return when("two optimizers alive at once (two models in one process)", lambda c: c.live > 1)


def _step_state(c):
    params = [p for g in c.self.param_groups for p in g["params"]]
    return {"none": any(p.requires_grad and p.grad is None for p in params),
            "lr_changed": any(g["lr"] != g.get("initial_lr", g["lr"]) for g in c.self.param_groups)}


def _step_entries(stage1: bool = False):
    entries = [] if stage1 else [when("after zero_grad(set_to_none=False)", lambda c: any(
        p.get("set_to_none") is False for p in c.previous("zero_grad")))]
    return entries + [
        none("closure"), default("closure"),
        when("a trainable parameter without gradient this step", lambda c: c.before["none"]),
        when("after load_state_dict", lambda c: "load_state_dict" in c.history),
        when("after an LR scheduler changed the lr", lambda c: c.before["lr_changed"]),
        when("several steps", lambda c: c.count > 2),
    ]


def _units(c):
    return getattr(c.self, "units", [])


CONTRACT = {
    "ShardedOptimizer.__init__": [],
    "ShardedOptimizer.add_param_group": [
        raises("after construction (NotImplementedError)", NotImplementedError),
    ],
    "ShardedOptimizer.state_dict": [
        when("DataParallelOptimizer", lambda c: c.cls == "DataParallelOptimizer"),
        when("ZeroStage1", lambda c: c.cls == "ZeroStage1"),
        when("ZeroStage2", lambda c: c.cls == "ZeroStage2"),
        when("before any step", lambda c: "step" not in c.history),
    ],
    "ShardedOptimizer.load_state_dict": [
        when("ZeroStage1", lambda c: c.cls == "ZeroStage1"),
        when("ZeroStage2", lambda c: c.cls == "ZeroStage2"),
        when("into a fresh optimizer over fresh parameters", lambda c: "step" not in c.history),
        raises("saved by another rank", ValueError, lambda c: c.a["state_dict"].get("rank") != c.rank),
        raises("saved in another world size", ValueError, lambda c: c.a["state_dict"].get("world_size") != c.world),
    ],
    "DataParallelOptimizer.__init__": [
        when("Adam", lambda c: _is(c, "Adam")), when("SGD", lambda c: _is(c, "SGD")),
    ],
    "DataParallelOptimizer.step": [when("called", lambda c: True)],
    "partition_parameters": [
        when("world of 1", lambda c: c.a["world_size"] == 1),
        when("more ranks than parameters", lambda c: c.a["world_size"] > len(c.a["numels"])),
        when("equal sizes (ties go to the lowest rank)", lambda c: len(set(c.a["numels"])) < len(c.a["numels"])),
        when("numels not sorted", lambda c: list(c.a["numels"]) != sorted(c.a["numels"], reverse=True)),
        when("no parameters", lambda c: len(c.a["numels"]) == 0),
    ],
    "ZeroStage1.__init__": _optimizer_entries(),
    "ZeroStage1.step": _step_entries(stage1=True),
    "ZeroStage2.__init__": _optimizer_entries(stage2=True),
    "ZeroStage2.zero_grad": [default("set_to_none"), explicit("set_to_none", True),
                             when("set_to_none=False", lambda c: c.a["set_to_none"] is False),
                             when("before any backward", lambda c: "step" not in c.history)],
    "ZeroStage2.step": _step_entries(),
    "FlatParams.__init__": [
        none("dtype"),
        when("dtype bfloat16 (a compute dtype)", lambda c: c.a["dtype"] == torch.bfloat16),
        when("dtype float16", lambda c: c.a["dtype"] == torch.float16),
        when("numel not divisible by world_size (padding)", lambda c: sum(p.numel() for p in c.a["params"])
             % c.a["world_size"] != 0),
        when("numel divisible by world_size (no padding)", lambda c: sum(p.numel() for p in c.a["params"])
             % c.a["world_size"] == 0),
        when("world of 1", lambda c: c.a["world_size"] == 1),
        when("the last rank", lambda c: c.a["rank"] == c.a["world_size"] - 1 > 0),
        when("one parameter", lambda c: len(c.a["params"]) == 1),
    ],
    "FlatParams.flat_grad": [when("some .grad None (zeros)", lambda c: any(p.grad is None for p in c.self.params)),
                             when("every .grad set", lambda c: all(p.grad is not None for p in c.self.params))],
    "FlatParams.split": [when("called", lambda c: True),
                         when("after the parameters given were written", lambda c: c.tensors_written)],
    "sharding_units": [
        when("a child without trainable parameters (skipped)", lambda c: len(c.result) < len(list(c.a["model"].children()))),
        when("a child with frozen and trainable parameters", lambda c: any(
            any(not p.requires_grad for p in child.parameters()) for child, _ in c.result)),
        raises("a parameter shared by two children", ValueError),
    ],
    "ZeroStage3.__init__": [
        none("compute_dtype"), default("compute_dtype"),
        when("compute_dtype bfloat16", lambda c: c.a["compute_dtype"] == torch.bfloat16),
        when("compute_dtype float16", lambda c: c.a["compute_dtype"] == torch.float16),
        when("compute_dtype float32 spelled out (the parameters' own)", lambda c: c.a["compute_dtype"] == torch.float32),
        default("replicate_below"), explicit("replicate_below", 0),
        when("replicate_below > 0 (some units replicated)", lambda c: c.a["replicate_below"] > 0),
        when("a unit with frozen parameters", lambda c: any(not p.requires_grad for p in c.a["model"].parameters())),
        when("a child without parameters", lambda c: any(not any(True for _ in m.parameters())
                                                         for m in c.a["model"].children())),
        when("world > 2", lambda c: c.world > 2),
        when("world of 2", lambda c: c.world == 2),
        when("a unit smaller than the world (padding > half)", lambda c: any(
            0 < sum(p.numel() for p in m.parameters()) < c.world for m in c.a["model"].children())),
        two_instances(),
        raises("compute_dtype not floating-point", ValueError, lambda c: c.a["compute_dtype"] is not None
               and not c.a["compute_dtype"].is_floating_point),
        raises("a parameter registered on the root module", ValueError,
               lambda c: any(True for _ in c.a["model"].parameters(recurse=False))),
        raises("a parameter shared by two units", ValueError),
        raises("a unit whose parameters differ in dtype", ValueError),
        raises("a frozen parameter not in the compute dtype", ValueError, lambda c: c.a["compute_dtype"] is not None),
        raises("no parameter requires a gradient", ValueError,
               lambda c: not any(p.requires_grad for p in c.a["model"].parameters())),
    ],
    "ZeroStage3.forward": [
        when("training, with grad", lambda c: c.grad and c.training),
        when("under torch.no_grad() (an evaluation)", lambda c: not c.grad),
        when("under no_grad, then a training step", lambda c: c.grad and any(
            not p.get("__grad__", True) for p in c.previous("forward"))),
        when("in eval mode", lambda c: c.training is False),
        when("a second forward before the backward", lambda c: c.history[-1:] == ("forward",)),
        when("a keyword argument", lambda c: len(c.given - {"args"}) > 0),
        when("after full_state_dict", lambda c: c.history[-1:] == ("full_state_dict",)),
        when("under torch.autocast", lambda c: torch.is_autocast_enabled("cpu")),
    ],
    "ZeroStage3.is_unsharded": [], "ZeroStage3.unshard": [], "ZeroStage3.reshard": [],
    "ZeroStage3.reduce_gradients": [], "ZeroStage3.backward_done": [],
    "ZeroStage3.full_state_dict": [
        when("before any step", lambda c: "forward" not in c.history),
        when("between steps", lambda c: "forward" in c.history),
        when("with a compute dtype (fp32 copies)", lambda c: getattr(c.init, "a", {}).get("compute_dtype") is not None),
        when("with replicated units", lambda c: (getattr(c.init, "a", {}).get("replicate_below") or 0) > 0),
        when("with frozen parameters", lambda c: any(not t.requires_grad for t in c.self.parameters())),
    ],
    "layer_numels": [when("a frozen parameter (not counted)", lambda c: any(not p.requires_grad
                                                                              for p in c.a["model"].parameters())),
                     when("a child without parameters (skipped)", lambda c: any(
                         not any(True for _ in m.parameters()) for m in c.a["model"].children()))],
    "zero_state_bytes": [
        *[when(f"stage {s}", lambda c, s=s: c.a["stage"] == s) for s in range(4)],
        default("rank"), when("rank > 0", lambda c: c.a["rank"] > 0),
        when("rank = world - 1 (the least loaded in stage 1)", lambda c: c.a["rank"] == c.a["world_size"] - 1 > 0),
        default("element_size"), when("element_size 2 (bf16)", lambda c: c.a["element_size"] == 2),
        when("world of 1", lambda c: c.a["world_size"] == 1),
        when("a model with frozen parameters", lambda c: any(not p.requires_grad for p in c.a["model"].parameters())),
        when("world > 2", lambda c: c.a["world_size"] > 2),
    ],
}

BEFORE = {"ZeroStage1.step": _step_state, "ZeroStage2.step": _step_state}

_HOOK = "called by ZeroStage3's own hooks (forward pre/post, backward), never by its user: a test reaches it " \
        "through forward and backward, and the stage-3 tests count what it gathers, frees and reduces"
IRRELEVANT = {
    "DataParallelOptimizer.__init__": "given code (no EXERCISE region): stage 0, the baseline the memory tests compare with",
    "DataParallelOptimizer.step": "given code (no EXERCISE region): stage 0, the baseline",
    "ShardedOptimizer.state_dict: DataParallelOptimizer": "given code (no EXERCISE region): stage 0, the baseline",
    "FlatParams.__init__": "given code (no EXERCISE region): stage 3's flat buffer, built by ZeroStage3 (whose entries cover dtypes and padding)",
    "FlatParams.flat_grad": "given code (no EXERCISE region): a helper of the graded reduce_gradients",
    "FlatParams.split": "given code (no EXERCISE region): a helper of the graded hooks",
    "partition_parameters": "given code (no EXERCISE region): stage 1's owner assignment (torch's ZeroRedundancyOptimizer's rule)",
    "sharding_units": "given code (no EXERCISE region): stage 3's units, reached through ZeroStage3.__init__",
    "layer_numels": "given code (no EXERCISE region): the memory tests' expected sizes",
    "zero_state_bytes": "given code (no EXERCISE region): the memory model the guidelines print; the memory tests measure instead",

    "ShardedOptimizer.__init__": "an abstract base: the constructors of its subclasses (stages 0-2) are the entries",
    "ZeroStage3.is_unsharded": _HOOK, "ZeroStage3.unshard": _HOOK, "ZeroStage3.reshard": _HOOK,
    "ZeroStage3.reduce_gradients": _HOOK, "ZeroStage3.backward_done": _HOOK,
}
