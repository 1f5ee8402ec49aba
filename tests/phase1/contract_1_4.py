"""Contract of exercise 1.4 (trainer.py's docstrings; guidelines 1.4): synchronous data parallelism by hand."""

import torch
import torch.nn as nn

from contracts import default, differs, explicit, none, when, world_group


def _model(c):
    return c.a["model"]


def _has_buffers(m):
    return any(True for _ in m.buffers())


def _nonpersistent(m):
    return any(mod._non_persistent_buffers_set for mod in m.modules())


def _frozen(m):
    return any(not p.requires_grad for p in m.parameters())


def _tied(m):
    return len(list(m.named_parameters())) < len(list(m.named_parameters(remove_duplicate=False)))


def _grads_none(m):
    return any(p.requires_grad and p.grad is None for p in m.parameters())


CONTRACT = {
    "broadcast_parameters": [
        default("src"), explicit("src", 0),
        when("src > 0", lambda c: c.a["src"] > 0),
        when("src = world - 1 > 0", lambda c: c.a["src"] == c.world - 1 > 0),
        when("a model with buffers (BatchNorm statistics)", lambda c: _has_buffers(_model(c))),
        when("a buffer left out of the state_dict (persistent=False)", lambda c: _nonpersistent(_model(c))),
        when("a frozen parameter", lambda c: _frozen(_model(c))),
        when("a tied parameter (one Parameter in two layers)", lambda c: _tied(_model(c))),
        when("world of 1", lambda c: c.world == 1),
        when("world > 2", lambda c: c.world > 2),
        when("an integer buffer (num_batches_tracked)",
             lambda c: any(not b.is_floating_point() for b in _model(c).buffers())),
    ],
    "sync_gradients": [
        none("group"), world_group(),
        when("group a subgroup of the world", lambda c: c.a["group"] is not None
             and torch.distributed.get_world_size(c.a["group"]) < c.world),
        differs("local_batch_size differs between ranks (uneven shards)", lambda c: c.a["local_batch_size"]),
        when("a trainable parameter without a gradient on this rank (unused in its forward)",
             lambda c: c.before["grad_none"]),
        when("a frozen parameter (its .grad stays None)", lambda c: _frozen(_model(c))),
        when("world of 1", lambda c: c.world == 1),
        when("world > 2", lambda c: c.world > 2),
        when("float64 parameters", lambda c: any(p.dtype == torch.float64 for p in _model(c).parameters())),
        when("called twice on the same gradients' model (two steps)", lambda c: c.count > 1),
    ],
    "train_step": [
        when("gradients left in .grad from before the call", lambda c: c.before["grad_left"]),
        differs("batch sizes differ between ranks", lambda c: len(c.a["inputs"])),
        when("world of 1", lambda c: c.world == 1),
        when("world > 2", lambda c: c.world > 2),
        when("an optimizer with momentum (state across steps)",
             lambda c: any(g.get("momentum", 0) for g in c.a["optimizer"].param_groups)),
        when("an adaptive optimizer (Adam)", lambda c: isinstance(c.a["optimizer"], torch.optim.Adam)),
        when("several steps in a row", lambda c: c.count > 2),
        when("a model with dropout (train mode)", lambda c: any(isinstance(m, nn.Dropout) for m in _model(c).modules())),
    ],
    "evaluate": [
        when("model in train mode before the call", lambda c: c.before["training"]),
        when("model in eval mode before the call", lambda c: not c.before["training"]),
        differs("loader sizes differ between ranks", lambda c: len(c.a["loader"].dataset)),
        when("an empty loader on this rank", lambda c: len(c.a["loader"].dataset) == 0),
        when("a model with BatchNorm (running statistics)",
             lambda c: any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in _model(c).modules())),
        when("a model with dropout", lambda c: any(isinstance(m, nn.Dropout) for m in _model(c).modules())),
        when("world of 1", lambda c: c.world == 1),
        when("world > 2", lambda c: c.world > 2),
        when("a last partial batch", lambda c: len(c.a["loader"].dataset) % (c.a["loader"].batch_size or 1) != 0),
    ],
    "eval_loader": [],
    "train": [],
    "parse_args": [],
    "describe_timing": [],
    "main": [],
}

def _state(c):
    m = _model(c)
    return {"grad_none": _grads_none(m), "training": m.training,
            "grad_left": any(p.grad is not None for p in m.parameters())}


BEFORE = {"sync_gradients": _state, "train_step": _state, "evaluate": _state}

_ONE = ("a world of 1 is the 2- and 3-rank worlds' rule with a single term (n_r / N = 1, the sum of one "
        "tensor): no mistake shows only there; the tests' worlds of 2-4 ranks cover the rule")
IRRELEVANT = {
    "broadcast_parameters: world of 1": _ONE, "sync_gradients: world of 1": _ONE, "train_step: world of 1": _ONE,
    "evaluate: world of 1": _ONE,
    "train_step: a model with dropout (train mode)": "each rank draws its own dropout masks: no single-process "
        "ground truth exists, and the contract promises none",
    "eval_loader": "given code (no EXERCISE region): the trainer's unpadded test shard",
    "train": "given code (no EXERCISE region): the trainer's loop; test_1_4_trainer_* run it end to end",
    "parse_args": "given code (no EXERCISE region): the command line",
    "describe_timing": "given code (no EXERCISE region): a line of the trainer's report",
    "main": "given code (no EXERCISE region): the program",
}
