"""Contract of exercise 2.9 (context_parallel.py's docstrings; guidelines 2.9): sequence parallelism around 2.7's
blocks, load-balanced positions, block attention and its merge, ring attention and Ulysses."""

import torch

from contracts import SIGNATURE_DEFAULT, default, flag, none, when, world_group


def _q(c):
    return c.a["q"]


CONTRACT = {
    "GatherFromSequenceParallelRegion.forward": [when("a 3-D input", lambda c: any(
        isinstance(v, torch.Tensor) and v.dim() == 3 for v in c.a.values())), when("world > 2", lambda c: c.world > 2)],
    "GatherFromSequenceParallelRegion.backward": [when("called", lambda c: True)],
    "ReduceScatterToSequenceParallelRegion.forward": [when("world > 2", lambda c: c.world > 2),
                                                      when("world of 2", lambda c: c.world == 2)],
    "ReduceScatterToSequenceParallelRegion.backward": [when("called", lambda c: True)],
    "Block.__init__": [flag("causal"), when("dropout > 0", lambda c: c.a["dropout"] > 0)],
    "Block.forward": [when("called", lambda c: True)],
    "copy_block_": [],
    "SequenceParallelBlock.__init__": [flag("causal"), when("dropout > 0", lambda c: c.a["dropout"] > 0),
                                       none("group"), world_group()],
    "SequenceParallelBlock.from_full": [none("group"), when("called", lambda c: True)],
    "SequenceParallelBlock.forward": [when("in train mode", lambda c: c.training),
                                      when("in eval mode", lambda c: c.training is False),
                                      when("under torch.no_grad()", lambda c: not c.grad),
                                      when("world > 2", lambda c: c.world > 2),
                                      when("a group of one rank (t = 1)", lambda c: getattr(c.self, "group", None)
                                           is not None and torch.distributed.get_world_size(c.self.group) == 1)],
    "SequenceParallelBlock.reduce_replicated_grads": [when("after a backward", lambda c: True),
                                                      when("twice in a row", lambda c: c.history[-1:] ==
                                                           ("reduce_replicated_grads",))],
    "load_balanced_positions": [when("cp = 1", lambda c: c.a["cp"] == 1), when("cp > 2", lambda c: c.a["cp"] > 2),
                                when("the last rank", lambda c: c.a["rank"] == c.a["cp"] - 1)],
    "shard_sequence": [default("dim"), when("dim given", lambda c: "dim" in c.given),
                       when("cp = 1", lambda c: c.a["cp"] == 1)],
    "attention_block": [flag("causal"),
                        when("query and key blocks of different lengths", lambda c: _q(c).shape[-2] != c.a["k"].shape[-2]),
                        when("large scores (safe for any size)", lambda c: bool(_q(c).abs().max() > 50)),
                        when("half precision", lambda c: _q(c).dtype in (torch.float16, torch.bfloat16))],
    "merge_partials": [when("called", lambda c: True),
                       when("one side's lse much larger", lambda c: bool((c.a["lse"] - c.a["block_lse"]).abs().max() > 30))],
    "RingAttention.forward": [when("called", lambda c: True)],
    "RingAttention.backward": [when("called", lambda c: True)],
    "ring_attention": [flag("causal"), default("causal"), none("group"), world_group(),
                       when("group a subgroup", lambda c: c.a["group"] is not None
                            and torch.distributed.get_world_size(c.a["group"]) < c.world),
                       when("cp = 1 (a group of one rank)", lambda c: c.a["group"] is not None
                            and torch.distributed.get_world_size(c.a["group"]) == 1),
                       when("cp > 2", lambda c: c.world > 2), when("under torch.no_grad()", lambda c: not c.grad),
                       when("half precision", lambda c: _q(c).dtype in (torch.float16, torch.bfloat16))],
    "ulysses_attention": [flag("causal"), default("causal"), none("group"), world_group(),
                          when("cp = 1 (a group of one rank)", lambda c: c.a["group"] is not None
                               and torch.distributed.get_world_size(c.a["group"]) == 1),
                          when("cp > 2", lambda c: c.world > 2),
                          when("several heads per rank", lambda c: _q(c).shape[1] > c.world)],
}

_INSIDE = ("a building block the tests reach only through ring_attention (a correct solution may inline it, as "
           "ring_attention's contract allows); its cases run there: causal and not, logits in the hundreds, the half "
           "blocks of different lengths that the causal mask leaves")
IRRELEVANT = {
    "copy_block_": "given code (no EXERCISE region): SequenceParallelBlock.from_full and 2.11's TensorParallelBlock.from_full "
                   "call it; the tests check the parameters those give",
    "SequenceParallelBlock.__init__": "given code (no EXERCISE region): builds 2.7's shards; from_full is what the tests build with",
    "shard_sequence": "given code (no EXERCISE region): cuts load_balanced_positions out of a tensor",
    "ring_attention: causal left to its default": SIGNATURE_DEFAULT,
    "ulysses_attention: causal left to its default": SIGNATURE_DEFAULT,
    "RingAttention.forward: called": "reached through ring_attention (given), which calls RingAttention.apply",
    "SequenceParallelBlock.reduce_replicated_grads: twice in a row": (
        "not in the contract: it is called once after each backward (its docstring); a second call sums the sums "
        "again, as Megatron-LM's finalize_model_grads would"),
    **{key: _INSIDE for key in (
        "attention_block: causal=False", "attention_block: causal=True", "attention_block: half precision",
        "attention_block: large scores (safe for any size)", "attention_block: query and key blocks of different lengths",
        "merge_partials: called", "merge_partials: one side's lse much larger")},
    "ring_attention: half precision": (
        "no dtype beyond float32 is promised: merging partial softmaxes in 16 bits loses precision (torch 2.14.1's own "
        "context parallelism merges in float32: _ContextParallelOptions.convert_to_f32, "
        "tensor/experimental/_context_parallel/_attention.py line 75)"),
}
