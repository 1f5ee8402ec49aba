"""Contract of exercise 2.7 (tensor_parallel.py's docstrings; guidelines 2.7): the four region functions, column-
and row-parallel linears with their options, the parallel MLP and attention, over the default group or a subgroup."""

import torch

from contracts import default, flag, none, when, world_group


def _sub(c):
    g = c.a.get("group")
    return g is not None and torch.distributed.get_world_size(g) < c.world


def _fn_entries():
    return [
        when("world of 2", lambda c: c.world == 2), when("world > 2", lambda c: c.world > 2),
        when("a 3-D input (batch, seq, hidden)", lambda c: c.a["input_"].dim() == 3 if "input_" in c.a else
             any(isinstance(v, torch.Tensor) and v.dim() == 3 for v in c.a.values())),
        when("a float64 input", lambda c: any(isinstance(v, torch.Tensor) and v.dtype == torch.float64
                                              for v in c.a.values())),
    ]


def _group_entries():
    return [none("group"), world_group(),
            when("group a subgroup (a tp group of a mesh)", _sub),
            when("world of 1 (p = 1)", lambda c: c.world == 1)]


def _x(c):
    return c.a["x"]


CONTRACT = {
    "CopyToTensorParallelRegion.forward": _fn_entries(),
    "CopyToTensorParallelRegion.backward": [when("called", lambda c: True)],
    "ReduceFromTensorParallelRegion.forward": _fn_entries(),
    "ReduceFromTensorParallelRegion.backward": [when("called", lambda c: True)],
    "GatherFromTensorParallelRegion.forward": _fn_entries(),
    "GatherFromTensorParallelRegion.backward": [when("called", lambda c: True)],
    "ScatterToTensorParallelRegion.forward": _fn_entries(),
    "ScatterToTensorParallelRegion.backward": [when("called", lambda c: True)],
    "ColumnParallelLinear.__init__": [flag("bias"), flag("gather_output"), default("bias"), default("gather_output"),
                                      *_group_entries(),
                                      when("device given", lambda c: c.a["device"] is not None)],
    "ColumnParallelLinear.reset_parameters": [when("called again after construction", lambda c: True)],
    "ColumnParallelLinear.from_full": [flag("gather_output"), default("gather_output"), *_group_entries(),
                                       when("a Linear without bias", lambda c: c.a["linear"].bias is None)],
    "ColumnParallelLinear.copy_from_full_": [when("a Linear without bias", lambda c: c.a["linear"].bias is None),
                                             when("a Linear with bias", lambda c: c.a["linear"].bias is not None)],
    "ColumnParallelLinear.forward": [
        when("a 2-D input", lambda c: _x(c).dim() == 2), when("a 3-D input", lambda c: _x(c).dim() == 3),
        when("gather_output=True", lambda c: c.self.gather_output),
        when("under torch.no_grad()", lambda c: not c.grad),
        when("an input that needs no gradient (data)", lambda c: not _x(c).requires_grad),
        when("under torch.autocast", lambda c: torch.is_autocast_enabled("cpu")),
    ],
    "ColumnParallelLinear.extra_repr": [],
    "RowParallelLinear.__init__": [flag("bias"), flag("input_is_parallel"), default("bias"),
                                   default("input_is_parallel"), *_group_entries(),
                                   when("device given", lambda c: c.a["device"] is not None)],
    "RowParallelLinear.reset_parameters": [when("called again after construction", lambda c: True)],
    "RowParallelLinear.from_full": [flag("input_is_parallel"), default("input_is_parallel"), *_group_entries(),
                                    when("a Linear without bias", lambda c: c.a["linear"].bias is None)],
    "RowParallelLinear.copy_from_full_": [when("a Linear without bias", lambda c: c.a["linear"].bias is None),
                                          when("a Linear with bias", lambda c: c.a["linear"].bias is not None)],
    "RowParallelLinear.forward": [
        when("input_is_parallel=True (a slice)", lambda c: c.self.input_is_parallel),
        when("input_is_parallel=False (the full input, sliced here)", lambda c: not c.self.input_is_parallel),
        when("a 3-D input", lambda c: _x(c).dim() == 3),
        when("without bias", lambda c: c.self.bias is None),
        when("under torch.no_grad()", lambda c: not c.grad),
    ],
    "RowParallelLinear.extra_repr": [],
    "MLP.__init__": [when("called", lambda c: True)],
    "MLP.forward": [when("a 3-D input", lambda c: _x(c).dim() == 3)],
    "ParallelMLP.__init__": [*_group_entries()],
    "ParallelMLP.from_full": [*_group_entries()],
    "ParallelMLP.copy_from_full_": [when("called", lambda c: True)],
    "ParallelMLP.forward": [when("a 2-D input", lambda c: _x(c).dim() == 2), when("a 3-D input", lambda c: _x(c).dim() == 3),
                            when("world > 2", lambda c: c.world > 2), when("under torch.no_grad()", lambda c: not c.grad),
                            when("two forwards, then backward of both", lambda c: c.history[-1:] == ("forward",))],
    "SelfAttention.__init__": [flag("causal")],
    "SelfAttention.forward": [when("called", lambda c: True)],
    "ParallelSelfAttention.__init__": [flag("causal"), default("causal"), *_group_entries()],
    "ParallelSelfAttention.reset_parameters": [when("called again after construction", lambda c: True)],
    "ParallelSelfAttention.from_full": [*_group_entries(), when("causal", lambda c: c.a["attn"].causal)],
    "ParallelSelfAttention.copy_from_full_": [when("called", lambda c: True)],
    "ParallelSelfAttention.forward": [
        when("causal", lambda c: c.self.causal), when("not causal", lambda c: not c.self.causal),
        when("several heads per rank", lambda c: c.self.local_heads > 1),
        when("one head per rank", lambda c: c.self.local_heads == 1),
        when("batch > 1", lambda c: _x(c).shape[0] > 1),
        when("sequence of 1", lambda c: _x(c).shape[1] == 1),
        when("world > 2", lambda c: c.world > 2),
    ],
}

_ONE = ("a world of 1 (p = 1) shards nothing: every layer is its unsharded module and every operator the "
        "identity; the worlds of 2 and 4 (and tp groups of 2) grade the splitting")
IRRELEVANT = {
    **{f"{cls}.__init__: world of 1 (p = 1)": _ONE for cls in ("ColumnParallelLinear", "RowParallelLinear",
                                                              "ParallelMLP", "ParallelSelfAttention")},
    "ColumnParallelLinear.forward: under torch.autocast": "the layer calls F.linear on its shard: autocast's casting "
        "is torch's, and the 2.2 tests grade autocast",
    **{f"{cls}.{m}": "given code (no EXERCISE region): the shard's construction and nn.Linear's initialisation; the graded copy_from_full_ "
        "and forward are tested on modules built by from_full and by the constructor" for cls in ("ColumnParallelLinear",
        "RowParallelLinear", "ParallelSelfAttention") for m in ("reset_parameters", "from_full")},
    "ParallelMLP.from_full": "given code (no EXERCISE region): builds the module and calls the graded copy_from_full_",
    "ParallelMLP.copy_from_full_": "given code (no EXERCISE region): copies into its two graded linears",

    "ColumnParallelLinear.extra_repr": "given code: the module's printed description",
    "RowParallelLinear.extra_repr": "given code: the module's printed description",
}
