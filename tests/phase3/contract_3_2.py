"""Contract of exercise 3.2 (bucketed_ddp.py's docstrings; guidelines 3.2): torch's bucket assignment and a DDP
whose buckets are all-reduced during backward."""

import torch

from contracts import SIGNATURE_DEFAULT, default, none, raises, when


def _req(c):
    return [p for p in c.a["params"] if p.requires_grad]


def _state(c):
    s = c.self
    return {"prepared": getattr(s, "sync_prepared", None), "require": getattr(s, "require_sync", None)}


CONTRACT = {
    "assign_buckets": [
        when("no parameters", lambda c: len(c.a["params"]) == 0),
        when("a frozen parameter (skipped)", lambda c: any(not p.requires_grad for p in c.a["params"])),
        when("two dtypes (a bucket per dtype)", lambda c: len({p.dtype for p in _req(c)}) > 1),
        when("a parameter larger than the cap", lambda c: any(p.numel() * p.element_size() > c.a["cap_bytes"]
                                                              for p in _req(c))),
        when("a parameter exactly at the cap", lambda c: any(p.numel() * p.element_size() == c.a["cap_bytes"]
                                                             for p in _req(c))),
        when("cap_bytes = 1 (one parameter each)", lambda c: c.a["cap_bytes"] == 1),
        when("everything in one bucket", lambda c: len(c.result) == 1),
        raises("cap_bytes < 1", ValueError, lambda c: c.a["cap_bytes"] < 1),
    ],
    "BucketedDDP.__init__": [
        default("bucket_cap_mb"), when("a small cap (several buckets)", lambda c: c.a["bucket_cap_mb"] < 1),
        when("a fractional cap", lambda c: not float(c.a["bucket_cap_mb"]).is_integer()),
        none("group"), when("group a subgroup", lambda c: c.a["group"] is not None
                            and torch.distributed.get_world_size(c.a["group"]) < c.world),
        when("a model with buffers (broadcast too)", lambda c: any(True for _ in c.a["module"].buffers())),
        when("a frozen parameter", lambda c: any(not p.requires_grad for p in c.a["module"].parameters())),
        when("two wrappers alive at once", lambda c: c.live > 1),
        when("world > 2", lambda c: c.world > 2),
    ],
    "BucketedDDP.forward": [
        when("outside no_sync", lambda c: c.self.require_sync),
        when("inside no_sync", lambda c: not c.self.require_sync),
        when("under torch.no_grad()", lambda c: not c.grad),
        when("a second forward before a backward", lambda c: c.history[-1:] == ("forward",)),
        when("keyword arguments", lambda c: len(c.given - {"inputs"}) > 0),
        when("several steps", lambda c: c.count > 2),
    ],
    "BucketedDDP.no_sync": [
        when("entered", lambda c: True),
        when("nested", lambda c: not c.before["require"]),
    ],
}

BEFORE = {"BucketedDDP.no_sync": _state}

IRRELEVANT = {
    "BucketedDDP.__init__: bucket_cap_mb left to its default": SIGNATURE_DEFAULT + " (25 MiB: one bucket for the "
        "tests' models, the case 'everything in one bucket' of assign_buckets)",
    "assign_buckets: cap_bytes < 1": "given code? no: the check opens the EXERCISE region, but the docstring only "
        "states cap_bytes >= 1 as a precondition, not an error; nothing to grade",
}
