"""Contract of exercise 4.4 (compression.py's docstrings; guidelines 4.4): top-k with error feedback and DGC's momentum
correction, PowerSGD with torch's settings, as DDP communication hooks."""

import torch

from contracts import SIGNATURE_DEFAULT, default, explicit, flag, none, when


def _state(c):
    return c.a["state"]


def _topk_before(c):
    s = _state(c)
    return {"iter": s.iter, "ratio": s.ratio, "has_memory": bool(getattr(s, "residuals", {}))}


def _ps_before(c):
    s = _state(c)
    return {"iter": s.iter, "q": bool(getattr(s, "q_memory_dict", {})), "err": bool(getattr(s, "error_dict", {}))}


def _grads(c):
    return c.a["bucket"].gradients()


CONTRACT = {
    "CompressionState.__init__": [],
    "CompressionState.group": [],
    "CompressionState.record": [],
    "allreduce_mean": [when("called by a test", lambda c: True)],
    "TopKState.__init__": [
        none("process_group"), default("ratio"),
        when("ratio = 1.0 (sends everything)", lambda c: c.a["ratio"] == 1.0),
        when("a small ratio (< 0.1)", lambda c: c.a["ratio"] < 0.1),
        flag("use_error_feedback"), default("use_error_feedback"),
        default("start_iter"), explicit("start_iter", 2), when("start_iter > 2", lambda c: c.a["start_iter"] > 2),
        when("start_iter < 2 without error feedback", lambda c: c.a["start_iter"] < 2 and not c.a["use_error_feedback"]),
        when("momentum = 0", lambda c: c.a["momentum"] == 0), when("momentum > 0", lambda c: c.a["momentum"] > 0),
        when("nesterov with momentum", lambda c: c.a["nesterov"] and c.a["momentum"] > 0),
        flag("momentum_masking"),
        when("momentum_masking=False with momentum", lambda c: c.a["momentum_masking"] is False and c.a["momentum"] > 0),
        when("weight_decay a number > 0", lambda c: isinstance(c.a["weight_decay"], (int, float))
             and c.a["weight_decay"] > 0),
        when("weight_decay a function of the parameter", lambda c: callable(c.a["weight_decay"])),
        when("weight decay with momentum 0", lambda c: c.a["momentum"] == 0 and (callable(c.a["weight_decay"])
                                                                               or c.a["weight_decay"] > 0)),
        when("weight decay without error feedback", lambda c: not c.a["use_error_feedback"]
             and (callable(c.a["weight_decay"]) or c.a["weight_decay"] > 0)),
        when("momentum without error feedback", lambda c: not c.a["use_error_feedback"] and c.a["momentum"] > 0),
        when("two states alive at once (two models)", lambda c: c.live > 1),
    ],
    "TopKState.decay_of": [when("called", lambda c: True)],
    "TopKState.memory": [when("called", lambda c: True)],
    "TopKState.reset_memory": [
        when("after compressed steps (memory to forget)", lambda c: True),
        when("then training goes on", lambda c: True),
    ],
    "topk_count": [
        when("ratio 1.0", lambda c: c.a["ratio"] == 1.0),
        when("a tiny ratio (k rounds up to 1)", lambda c: c.a["numel"] * c.a["ratio"] < 1),
        when("numel * ratio not an integer", lambda c: not float(c.a["numel"] * c.a["ratio"]).is_integer()),
        when("numel = 1", lambda c: c.a["numel"] == 1),
    ],
    "sparsity_warmup": [
        when("step 0", lambda c: c.a["step"] == 0), when("during warm-up", lambda c: 0 < c.a["step"] < c.a["warmup_steps"]),
        when("at the end of warm-up", lambda c: c.a["step"] == c.a["warmup_steps"]),
        when("after warm-up", lambda c: c.a["step"] > c.a["warmup_steps"]),
        when("warmup_steps = 0", lambda c: c.a["warmup_steps"] == 0),
        default("first"), when("first given", lambda c: "first" in c.given),
    ],
    "allreduce_with_momentum": [],
    "topk_hook": [
        when("before start_iter (plain all-reduce)", lambda c: c.before["iter"] < _state(c).start_iter),
        when("before start_iter with momentum", lambda c: c.before["iter"] < _state(c).start_iter
             and _state(c).momentum > 0),
        when("before start_iter with weight decay only", lambda c: c.before["iter"] < _state(c).start_iter
             and _state(c).momentum == 0 and (callable(_state(c).weight_decay) or _state(c).weight_decay > 0)),
        when("compressed, with error feedback", lambda c: c.before["iter"] >= _state(c).start_iter
             and _state(c).use_error_feedback),
        when("compressed, without error feedback", lambda c: c.before["iter"] >= _state(c).start_iter
             and not _state(c).use_error_feedback),
        when("compressed, momentum", lambda c: c.before["iter"] >= _state(c).start_iter and _state(c).momentum > 0),
        when("compressed, nesterov", lambda c: c.before["iter"] >= _state(c).start_iter and _state(c).nesterov
             and _state(c).momentum > 0),
        when("compressed, weight decay", lambda c: c.before["iter"] >= _state(c).start_iter
             and (callable(_state(c).weight_decay) or _state(c).weight_decay > 0)),
        when("ratio 1.0 while compressing", lambda c: c.before["iter"] >= _state(c).start_iter and c.before["ratio"] == 1.0),
        when("several buckets in one backward", lambda c: c.a["bucket"].index() > 0),
        when("a bucket of one parameter", lambda c: len(_grads(c)) == 1),
        when("a non-float32 bucket (bf16/fp16/fp64)", lambda c: c.a["bucket"].buffer().dtype != torch.float32),
        when("world > 2", lambda c: c.world > 2),
        when("after reset_memory (memory rebuilt)", lambda c: c.before["iter"] > _state(c).start_iter
             and not c.before["has_memory"] and _state(c).use_error_feedback),
    ],
    "PowerSGDState.__init__": [
        none("process_group"),
        default("matrix_approximation_rank"), when("rank 1", lambda c: c.a["matrix_approximation_rank"] == 1),
        when("rank > 2 (QR instead of Gram-Schmidt)", lambda c: c.a["matrix_approximation_rank"] > 2),
        when("rank 2", lambda c: c.a["matrix_approximation_rank"] == 2),
        default("start_powerSGD_iter"), when("start_powerSGD_iter small (compressing in a test)",
                                             lambda c: c.a["start_powerSGD_iter"] <= 10),
        when("min_compression_rate != 2", lambda c: c.a["min_compression_rate"] != 2),
        flag("use_error_feedback"), flag("warm_start"),
        when("orthogonalization_epsilon > 0", lambda c: c.a["orthogonalization_epsilon"] > 0),
        when("random_seed != 0", lambda c: c.a["random_seed"] != 0),
        flag("batch_tensors_with_same_shape"),
        when("compression_stats_logging_frequency given", lambda c: "compression_stats_logging_frequency" in c.given),
    ],
    "PowerSGDState.reset_memory": [when("after compressed steps", lambda c: True)],
    "BucketSplit.low_rank_views": [], "BucketSplit.copy_back": [],
    "split_bucket": [
        when("a bucket with matrices and vectors", lambda c: bool(c.result.matrices) and bool(c.result.uncompressed)),
        when("nothing worth compressing", lambda c: not c.result.matrices),
        when("same-shaped matrices batched", lambda c: any(m.shape[0] > 1 for m in c.result.matrices)),
        when("a conv weight (4-D, viewed as n x m)", lambda c: any(g.dim() == 4 for g in c.a["gradients"])),
    ],
    "orthogonalize_": [
        default("epsilon"), when("epsilon > 0", lambda c: c.a["epsilon"] > 0),
        when("r <= 2 (Gram-Schmidt)", lambda c: c.a["matrices"].shape[-1] <= 2),
        when("r > 2 (QR)", lambda c: c.a["matrices"].shape[-1] > 2),
        when("half precision (Gram-Schmidt)", lambda c: c.a["matrices"].dtype in (torch.float16, torch.bfloat16)),
        when("a batch of several matrices", lambda c: c.a["matrices"].shape[0] > 1),
        when("a zero column", lambda c: bool((c.a["matrices"].abs().sum(-2) == 0).any())),
    ],
    "powersgd_hook": [
        when("before start_powerSGD_iter", lambda c: c.before["iter"] < _state(c).start_powerSGD_iter),
        when("compressing", lambda c: c.before["iter"] >= _state(c).start_powerSGD_iter),
        when("warm start reused (a second compressed step)", lambda c: c.before["q"]),
        when("compressing without error feedback", lambda c: c.before["iter"] >= _state(c).start_powerSGD_iter
             and not _state(c).use_error_feedback),
        when("compressing without warm start", lambda c: c.before["iter"] >= _state(c).start_powerSGD_iter
             and not _state(c).warm_start),
        when("compressing with batched shapes", lambda c: c.before["iter"] >= _state(c).start_powerSGD_iter
             and _state(c).batch_tensors_with_same_shape),
        when("several buckets", lambda c: c.a["bucket"].index() > 0),
        when("world > 2", lambda c: c.world > 2),
        when("a non-float32 bucket", lambda c: c.a["bucket"].buffer().dtype != torch.float32),
    ],
}

BEFORE = {"topk_hook": _topk_before, "powersgd_hook": _ps_before}

_BASE = "the hooks' base class: built through TopKState and PowerSGDState, read by the hooks themselves"
IRRELEVANT = {
    "PowerSGDState.__init__: matrix_approximation_rank left to its default": SIGNATURE_DEFAULT + " (1)",
    "PowerSGDState.__init__: start_powerSGD_iter left to its default": SIGNATURE_DEFAULT + " (1000: no test runs "
        "that long; 2 and 3 are exercised)",
    "TopKState.__init__: ratio left to its default": SIGNATURE_DEFAULT + " (0.01)",
    "TopKState.__init__: momentum without error feedback": "the docstring's a = g without error feedback: the velocity "
        "lives in the error-feedback memory, so this combination compresses the plain gradient; no mistake of its own",
    "PowerSGDState.reset_memory": "given code (no EXERCISE region): clears the dictionaries the hook fills",
    "TopKState.reset_memory": "given code (no EXERCISE region): clears the dictionaries the hook fills",
    "topk_hook: after reset_memory (memory rebuilt)": "the given memory() rebuilds what the given reset_memory() "
        "cleared; the hook reads memory() the same way on every compressed step",
    "allreduce_mean": "given code (no EXERCISE region): torch's allreduce_hook's rule, which the graded hooks call",
    "TopKState.decay_of": "given code (no EXERCISE region): reads the weight_decay setting", "TopKState.memory": "given code (no EXERCISE region): the hook's buffers",
    "sparsity_warmup": "given code (no EXERCISE region): the trainer's warm-up schedule (tested with the trainer)",
    "topk_count": "given code (no EXERCISE region): k from the ratio; the topk_hook tests count what is sent",
    "split_bucket": "given code (no EXERCISE region): torch's split of a bucket, which the graded powersgd_hook uses (compared bitwise with "
        "torch's hook)",

    "CompressionState.__init__": _BASE, "CompressionState.group": _BASE, "CompressionState.record": _BASE,
    "allreduce_with_momentum": "called by topk_hook before start_iter (its entries 'before start_iter ...' reach it)",
    "BucketSplit.low_rank_views": "a helper powersgd_hook calls on split_bucket's result",
    "BucketSplit.copy_back": "a helper powersgd_hook calls on split_bucket's result",
}
