"""Contract of exercise 2.5 (model_split.py's docstrings; guidelines 2.5): stages, the mailbox of point-to-point
messages, and one forward-backward through a split model."""

import torch

from contracts import default, none, raises, when

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


CONTRACT = {
    "PipelineStage.__init__": [
        when("layers an nn.Sequential", lambda c: isinstance(c.a["layers"], torch.nn.Sequential)),
        when("layers a list", lambda c: isinstance(c.a["layers"], (list, tuple))),
        when("num_stages = 1", lambda c: c.a["num_stages"] == 1),
        when("layers not divisible by num_stages", lambda c: len(c.a["layers"]) % c.a["num_stages"] != 0),
        when("as many stages as layers", lambda c: len(c.a["layers"]) == c.a["num_stages"]),
        default("device"), when("device given", lambda c: c.a["device"] is not None),
        when("a stage whose layers have no parameters", lambda c: not any(True for _ in c.self.parameters())),
    ],
    "PipelineStage.forward": [
        when("first stage", lambda c: c.self.is_first),
        when("a middle stage", lambda c: not c.self.is_first and not c.self.is_last),
        when("last stage", lambda c: c.self.is_last),
    ],
    "Delivery.__init__": [],
    "Delivery.wait": [
        when("waited", lambda c: True),
        when("waited twice", lambda c: c.count > 1),
    ],
    "Mailbox.__init__": [when("two mailboxes alive at once", lambda c: c.live > 1)],
    "Mailbox.send": [
        when("several sends queued before a post", lambda c: c.history[-1:] == ("send",)),
        when("a non-contiguous tensor", lambda c: not c.a["tensor"].is_contiguous()),
    ],
    "Mailbox.post": [when("with nothing queued", lambda c: "send" not in c.since("post") and "send" not in c.history[-1:]),
                     when("after sends", lambda c: "send" in c.history)],
    "Mailbox.recv": [when("with sends queued (posted together)", lambda c: c.history[-1:] == ("send",)),
                     when("with nothing queued", lambda c: c.history[-1:] != ("send",))],
    "Mailbox.flush": [when("with deliveries never waited", lambda c: "send" in c.history),
                      when("with nothing sent", lambda c: "send" not in c.history)],
    "Mailbox.send_activation": [
        *[when(f"dtype {str(d).removeprefix('torch.')}", lambda c, d=d: c.a["activation"].dtype == d) for d in _DTYPES],
        when("a 1-D activation", lambda c: c.a["activation"].dim() == 1),
        when("a 4-D activation (CNN features)", lambda c: c.a["activation"].dim() == 4),
        when("8 dims (MAX_DIMS)", lambda c: c.a["activation"].dim() == 8),
        when("a 0-d activation", lambda c: c.a["activation"].dim() == 0),
        when("a non-contiguous activation", lambda c: not c.a["activation"].is_contiguous()),
        raises("more than MAX_DIMS dims", ValueError, lambda c: c.a["activation"].dim() > 8),
        raises("a dtype not in DTYPES", ValueError, lambda c: c.a["activation"].dtype not in _DTYPES),
    ],
    "Mailbox.recv_activation": [when("called", lambda c: True)],
    "forward_backward": [
        when("2 stages", lambda c: c.a["stage"].num_stages == 2),
        when("more than 2 stages (a middle stage)", lambda c: c.a["stage"].num_stages > 2),
        when("one stage", lambda c: c.a["stage"].num_stages == 1),
        when("fewer stages than ranks (the others idle)", lambda c: c.a["stage"].num_stages < c.world),
        when("a non-float32 activation dtype", lambda c: c.a["inputs"] is not None
             and c.a["inputs"].dtype != torch.float32),
        when("twice without zero_grad (gradients add up)", lambda c: c.count > 1),
        when("a 4-D input (CNN)", lambda c: c.a["inputs"] is not None and c.a["inputs"].dim() == 4),
        when("inputs None (not the first stage)", lambda c: c.a["inputs"] is None),
        when("targets None (not the last stage)", lambda c: c.a["targets"] is None),
    ],
}

IRRELEVANT = {
    "forward_backward: a non-float32 activation dtype": "the recorder sees the batch, not the cut: "
        "test_2_5_cnn_and_low_precision_cuts_match_one_process puts bfloat16, float16 and float64 on the cut, and "
        "send_activation's dtype entries are exercised",
    "PipelineStage.__init__": "given code (no EXERCISE region): the layers of a stage (balanced_ranges); forward_backward's entries cover the "
        "stage counts",
    "PipelineStage.forward": "given code (no EXERCISE region): the stage's layers in turn",
    "Delivery.wait": "given code (no EXERCISE region): the mailbox's receipts, used by the graded send_activation/recv_activation",
    "Mailbox.send": "given code (no EXERCISE region): the mailbox the graded functions post through",
    "Mailbox.post": "given code (no EXERCISE region): the mailbox the graded functions post through",
    "Mailbox.recv": "given code (no EXERCISE region): the mailbox the graded functions post through",
    "Mailbox.flush": "given code (no EXERCISE region): the mailbox the graded functions post through",

    "Delivery.__init__": "built by Mailbox.send only, never by a caller",
}
