"""Contract of exercise 2.3 (checkpointing.py's docstrings; guidelines 2.3): a checkpointed Function that re-runs
its forward as it ran, and checkpoint_sequential."""

import torch

from contracts import when


def _params(c):
    return c.a.get("params") or ()


def _blocks_dropout(c):
    return any(isinstance(m, torch.nn.Dropout) for b in c.a["blocks"] for m in b.modules())


CONTRACT = {
    "CheckpointFunction.forward": [
        when("x needs no gradient (the data), params do", lambda c: not c.a["x"].requires_grad
             and any(p.requires_grad for p in _params(c))),
        when("x needs a gradient", lambda c: c.a["x"].requires_grad),
        when("a frozen parameter among params", lambda c: any(not p.requires_grad for p in _params(c))),
        when("a parameter run_function does not use", lambda c: len(_params(c)) > 0),
        when("under torch.autocast", lambda c: torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled()),
        when("under torch.no_grad()", lambda c: not c.grad),
        when("no params at all", lambda c: len(_params(c)) == 0),
    ],
    "CheckpointFunction.backward": [
        when("called (the re-run)", lambda c: True),
        when("outside the autocast the forward ran under", lambda c: not torch.is_autocast_enabled("cpu")),
    ],
    "checkpoint_sequential": [
        when("segments = 1", lambda c: c.a["segments"] == 1),
        when("segments = len(blocks) (one block each)", lambda c: c.a["segments"] == len(c.a["blocks"])),
        when("segments not dividing len(blocks) (balanced sizes)",
             lambda c: 1 < c.a["segments"] < len(c.a["blocks"]) and len(c.a["blocks"]) % c.a["segments"] != 0),
        when("blocks an nn.Sequential", lambda c: isinstance(c.a["blocks"], torch.nn.Sequential)),
        when("blocks a list", lambda c: isinstance(c.a["blocks"], (list, tuple))),
        when("blocks with dropout (the re-run draws the same masks)", _blocks_dropout),
        when("x needs no gradient", lambda c: not c.a["x"].requires_grad),
        when("under torch.autocast", lambda c: torch.is_autocast_enabled("cpu")),
        when("under torch.no_grad() (evaluation)", lambda c: not c.grad),
        when("a weight shared by two segments",
             lambda c: len({id(p) for b in c.a["blocks"] for p in b.parameters()})
             < sum(1 for b in c.a["blocks"] for _ in b.parameters())),
        when("in eval mode", lambda c: all(not b.training for b in c.a["blocks"])),
    ],
}

IRRELEVANT = {
    "checkpoint_sequential: blocks an nn.Sequential": "the docstring's Sequence[nn.Module]: an nn.Sequential is "
        "indexed like the list the tests pass; common.split.balanced_ranges cuts either",
}
