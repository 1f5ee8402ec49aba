"""Contract of exercise 2.1 (accumulation.py's docstrings; guidelines 2.1): GradSync's decision taken by the
forward, no_sync, micro-batches and the accumulation step."""

import torch

from contracts import differs, raises, when


def _n(c):
    return len(c.a["inputs"])


def _sync_state(c):
    s = c.self
    return {"prepared": getattr(s, "sync_prepared", None), "require": getattr(s, "require_sync", None)}


def _step_state(c):
    model = c.a["sync"]
    return {"grad_left": any(p.grad is not None for p in model.parameters())}


CONTRACT = {
    "GradSync.__init__": [
        when("a model with a frozen parameter", lambda c: any(not p.requires_grad for p in c.a["module"].parameters())),
        when("two GradSync alive at once", lambda c: c.live > 1),
    ],
    "GradSync.forward": [
        when("outside no_sync", lambda c: c.self.require_sync),
        when("inside no_sync", lambda c: not c.self.require_sync),
        when("under torch.no_grad() (decides nothing)", lambda c: not c.grad),
        when("under torch.no_grad() after a forward whose backward has not come",
             lambda c: not c.grad and [h for h in c.history if h in ("forward", "backward")][-1:] == ["forward"]),
        when("a keyword argument", lambda c: len(c.given - {"inputs"}) > 0),
        when("several positional arguments", lambda c: len(c.a["inputs"]) > 1),
        when("in eval mode", lambda c: c.training is False),
        when("a second forward before the backward of the first", lambda c: c.history[-1:] == ("forward",)),
    ],
    "GradSync.sync": [
        when("called by the caller directly", lambda c: True),
        when("no process group (one process)", lambda c: not torch.distributed.is_initialized()),
    ],
    "GradSync.backward": [
        when("forward outside no_sync, backward outside", lambda c: c.before["prepared"] and c.before["require"]),
        when("forward outside no_sync, backward inside it", lambda c: c.before["prepared"] and not c.before["require"]),
        when("forward inside no_sync, backward outside it", lambda c: not c.before["prepared"] and c.before["require"]
             and c.history[-1:] == ("forward",)),
        when("a second backward with no forward between (the decision used up)",
             lambda c: c.history[-1:] == ("backward",)),
        when("two forwards, then one backward", lambda c: c.history[-2:] == ("forward", "forward")),
        differs("local_samples differ between ranks", lambda c: c.a["local_samples"]),
        when("no process group (one process)", lambda c: not torch.distributed.is_initialized()),
        when("world > 2", lambda c: c.world > 2),
    ],
    "GradSync.no_sync": [
        when("nested in another no_sync", lambda c: not c.before["require"]),
    ],
    "micro_batches": [
        when("n divisible by micro_batch_size", lambda c: c.a["n"] % c.a["micro_batch_size"] == 0 and c.a["n"] > 0),
        when("n not divisible (a smaller last slice)", lambda c: c.a["n"] % c.a["micro_batch_size"] != 0),
        when("micro_batch_size > n (one slice)", lambda c: c.a["micro_batch_size"] > c.a["n"] > 0),
        when("micro_batch_size = 1", lambda c: c.a["micro_batch_size"] == 1),
        when("n = 0 (no slices)", lambda c: c.a["n"] == 0),
        raises("micro_batch_size = 0", ValueError, lambda c: c.a["micro_batch_size"] == 0),
        raises("micro_batch_size < 0", ValueError, lambda c: c.a["micro_batch_size"] < 0),
    ],
    "global_mean": [
        differs("counts differ between ranks", lambda c: c.a["local_count"]),
        when("no process group (one process)", lambda c: not torch.distributed.is_initialized()),
        when("a rank with local_count 0", lambda c: c.a["local_count"] == 0),
    ],
    "accumulation_step": [
        when("micro_batch_size divides n, several micro-batches",
             lambda c: _n(c) % c.a["micro_batch_size"] == 0 and _n(c) > c.a["micro_batch_size"]),
        when("micro_batch_size does not divide n (a smaller last micro-batch)",
             lambda c: _n(c) % c.a["micro_batch_size"] != 0),
        when("micro_batch_size >= n (one micro-batch)", lambda c: c.a["micro_batch_size"] >= _n(c)),
        when("micro_batch_size = 1", lambda c: c.a["micro_batch_size"] == 1),
        differs("local batches differ between ranks", lambda c: _n(c)),
        when("gradients left in .grad before the call", lambda c: c.before["grad_left"]),
        when("an optimizer with state (momentum or Adam)", lambda c: any(
            g.get("momentum", 0) or "betas" in g for g in c.a["optimizer"].param_groups)),
        when("two steps in a row", lambda c: c.count > 1),
        when("world > 2", lambda c: c.world > 2),
        when("model with dropout", lambda c: any(isinstance(m, torch.nn.Dropout) for m in c.a["sync"].modules())),
        raises("len(inputs) != len(targets)", ValueError, lambda c: len(c.a["inputs"]) != len(c.a["targets"])),
        raises("an empty batch", ValueError, lambda c: _n(c) == 0),
    ],
}

BEFORE = {"GradSync.backward": _sync_state, "GradSync.no_sync": _sync_state, "accumulation_step": _step_state}

IRRELEVANT = {
    "GradSync.forward: in eval mode": "the decision is torch.is_grad_enabled()'s and no_sync's alone (as DDP's): the "
        "module's mode is not an input of GradSync; a forward under torch.no_grad() is graded",
    "GradSync.backward: local_samples differ between ranks": "backward hands local_samples to sync (1.4's "
        "sync_gradients, graded there with uneven batches); accumulation_step's uneven ranks cover the path",
    "GradSync.backward: world > 2": "the sync is 1.4's (graded on 3 and 4 ranks); GradSync decides when, per rank",
    "accumulation_step: an empty batch": "given code (the argument check before the EXERCISE region)",
    "accumulation_step: len(inputs) != len(targets)": "given code (the argument check before the EXERCISE region)",
    "accumulation_step: model with dropout": "each rank draws its own masks: no single-process ground truth, and "
        "the contract promises none",
    "accumulation_step: world > 2": "the weighting n_r / N is 1.4's rule (graded on 3-4 ranks); 2 ranks with "
        "uneven batches and uneven micro-batch counts grade the accumulation",
    "micro_batches": "given code (no EXERCISE region): the slicing helper accumulation_step may use; accumulation_step's entries cover the "
                     "batch shapes",
    "global_mean": "given code (no EXERCISE region): the loss average accumulation_step returns (checked by its tests)",
    "GradSync.sync": "given code (no EXERCISE region): phase 1's sync_gradients behind GradSync.backward",
    "GradSync.__init__: a model with a frozen parameter": "given code (no EXERCISE region): GradSync only stores the module; frozen parameters "
        "are sync_gradients' (1.4's tests)",
}
