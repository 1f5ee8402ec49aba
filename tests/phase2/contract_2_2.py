"""Contract of exercise 2.2 (mixed_precision.py's docstrings; guidelines 2.2): autocast's dtype, the dynamic
loss scaler with torch.amp.GradScaler's semantics, one mixed-precision step."""

import math

import torch

from contracts import default, explicit, none, raises, when


def _state(c):
    s = c.self
    return {"scale": float(getattr(s, "_scale", float("nan"))), "tracker": getattr(s, "_growth_tracker", None),
            "unscaled": getattr(s, "_unscaled", None), "found_inf": getattr(s, "_found_inf", None)}


def _grads(opt):
    return [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]


def _no_grad_param(opt):
    return any(p.grad is None for g in opt.param_groups for p in g["params"])


def _nonfinite(opt):
    return any(not bool(torch.isfinite(g).all()) for g in _grads(opt))


def _opt_state(c):
    return {"nonfinite": _nonfinite(c.a["optimizer"]), "none": _no_grad_param(c.a["optimizer"])}


CONTRACT = {
    "autocast_dtype": [
        when("a str 'cpu'", lambda c: c.a["device"] == "cpu"),
        when("a torch.device('cpu')", lambda c: isinstance(c.a["device"], torch.device) and c.a["device"].type == "cpu"),
        when("a bare 'cuda' (the current device)", lambda c: str(c.a["device"]) == "cuda"),
        when("'cuda:1' (that GPU's capability, not the current one's)", lambda c: str(c.a["device"]).startswith("cuda:")
             and str(c.a["device"]) != "cuda:0"),
        when("a GPU of compute capability < 8.0 (float16)", lambda c: c.result == torch.float16),
        when("another device type (mps, xpu, meta)", lambda c: torch.device(c.a["device"]).type not in ("cpu", "cuda")),
    ],
    "LossScaler.__init__": [
        default("init_scale"), explicit("init_scale", 2.0 ** 16),
        when("init_scale not a power of two", lambda c: not math.log2(c.a["init_scale"]).is_integer()),
        when("growth_factor != 2", lambda c: c.a["growth_factor"] != 2.0),
        when("backoff_factor != 0.5", lambda c: c.a["backoff_factor"] != 0.5),
        when("growth_interval = 1", lambda c: c.a["growth_interval"] == 1),
        when("growth_interval small (2..5)", lambda c: 2 <= c.a["growth_interval"] <= 5),
        default("growth_interval"),
        when("two scalers alive at once", lambda c: c.live > 1),
    ],
    "LossScaler.get_scale": [when("before any step", lambda c: "update" not in c.history),
                             when("after an update", lambda c: "update" in c.history)],
    "LossScaler.scale": [
        when("a float32 loss", lambda c: c.a["loss"].dtype == torch.float32),
        when("a low-precision loss (bf16/fp16)", lambda c: c.a["loss"].dtype in (torch.bfloat16, torch.float16)),
        when("a non-scalar tensor", lambda c: c.a["loss"].dim() > 0),
    ],
    "LossScaler.unscale_": [
        when("finite gradients", lambda c: not c.before["nonfinite"]),
        when("an inf or nan gradient", lambda c: c.before["nonfinite"]),
        when("a parameter with no gradient (None)", lambda c: c.before["none"]),
        when("world > 1 (found_inf agreed by all ranks)", lambda c: c.world > 1),
        raises("twice in one step", RuntimeError, lambda c: c.since("update").count("unscale_") >= 1),
    ],
    "LossScaler.step": [
        when("after an explicit unscale_", lambda c: "unscale_" in c.since("update")),
        when("without unscale_ (step unscales)", lambda c: "unscale_" not in c.since("update")),
        when("skipped (inf/nan)", lambda c: c.result is None and c.before["nonfinite"]),
        when("an optimizer.step that returns a value (a closure's loss)", lambda c: c.result is not None),
        when("an inf on one rank only", lambda c: c.world > 1 and c.before["nonfinite"]),
        when("a parameter with no gradient (None)", lambda c: c.before["none"]),
    ],
    "LossScaler.update": [
        when("after an overflow (backoff)", lambda c: c.self.get_scale() < c.before["scale"]),
        when("growth applied (tracker reached growth_interval)", lambda c: c.self.get_scale() > c.before["scale"]),
        when("growth that would overflow to inf (not applied)", lambda c: c.before["scale"] * 2 >= 3.4e38
             or c.before["scale"] * c.self._growth_factor == float("inf")),
        when("clean step, no growth yet", lambda c: c.self.get_scale() == c.before["scale"]),
        when("many updates in a row (> growth_interval)", lambda c: c.count > 3),
    ],
    "LossScaler.state_dict": [
        when("mid-interval (tracker > 0)", lambda c: c.result.get("_growth_tracker", 0) > 0),
        when("after a backoff", lambda c: c.result.get("scale", 0) < c.self._init_scale),
    ],
    "LossScaler.load_state_dict": [
        when("into a scaler built with other arguments", lambda c: True),
        when("from torch.amp.GradScaler's state_dict", lambda c: "_growth_tracker" in c.a["state"]
             and "backoff_factor" in c.a["state"]),
        when("then the steps go on (a later update)", lambda c: True),
    ],
    "mixed_precision_step": [
        none("scaler"),
        when("a torch.amp.GradScaler as the scaler (any object with its API)",
             lambda c: isinstance(c.a["scaler"], torch.amp.GradScaler)),
        when("device a str", lambda c: isinstance(c.a["device"], str)),
        when("device a torch.device", lambda c: isinstance(c.a["device"], torch.device)),
        when("gradients left in .grad before the call", lambda c: c.before["grad_left"]),
        when("a model with BatchNorm (kept in float32 by autocast)",
             lambda c: any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in c.a["model"].modules())),
        when("several steps (the scaler's state carries)", lambda c: c.count > 2),
        when("an overflowing step (skipped)", lambda c: c.before["scale"] is not None
             and c.a["scaler"].get_scale() < c.before["scale"]),
    ],
}


def _mp_state(c):
    return {"grad_left": any(p.grad is not None for p in c.a["model"].parameters()),
            "scale": c.a["scaler"].get_scale() if c.a["scaler"] is not None else None}


BEFORE = {"LossScaler.unscale_": lambda c: {**_state(c), **_opt_state(c)},
          "LossScaler.step": lambda c: {**_state(c), **_opt_state(c)},
          "LossScaler.update": _state, "mixed_precision_step": _mp_state}

IRRELEVANT = {
    "LossScaler.unscale_: twice in one step": "given code (the RuntimeError before the EXERCISE region)",
    "LossScaler.unscale_: world > 1 (found_inf agreed by all ranks)": "step() unscales when unscale_ was not "
        "called: the entry 'LossScaler.step: an inf on one rank only' runs this agreement across ranks",
    "mixed_precision_step: a model with BatchNorm (kept in float32 by autocast)": "which ops autocast casts is "
        "torch's: the step only enters torch.autocast",
    "LossScaler.__init__: init_scale=65536.0 spelled out": "given code (no EXERCISE region): the constructor stores its arguments",
    "LossScaler.state_dict: after a backoff": "given code (no EXERCISE region): state_dict copies the two fields; the round trip mid-interval "
        "is tested",

    "autocast_dtype: a bare 'cuda' (the current device)": "needs a GPU (tests/test_gpu.py); CI has none",
    "autocast_dtype: 'cuda:1' (that GPU's capability, not the current one's)": "needs two GPUs",
    "autocast_dtype: a GPU of compute capability < 8.0 (float16)": "needs a pre-Ampere GPU",
}
