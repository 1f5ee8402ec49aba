"""Contract of exercise 2.10 (moe.py's docstrings; guidelines 2.10): capacity, routing, the differentiable
all-to-all, expert parallelism and its gradients."""

import torch

from contracts import none, when, world_group


CONTRACT = {
    "expert_capacity": [none("capacity_factor"), when("capacity_factor < 1 (drops)", lambda c: (c.a["capacity_factor"]
                                                                                                  or 2) < 1),
                        when("k > 1", lambda c: c.a["k"] > 1), when("tokens = 0", lambda c: c.a["tokens"] == 0),
                        when("not an integer before ceil", lambda c: c.a["capacity_factor"] is not None and
                             not float(c.a["capacity_factor"] * c.a["k"] * c.a["tokens"] / c.a["num_experts"]).is_integer())],
    "load_imbalance": [when("no token at all (1.0)", lambda c: int(c.a["tokens_per_expert"].sum()) == 0),
                       when("balanced", lambda c: c.result == 1.0)],
    "route": [when("k = 1", lambda c: c.a["k"] == 1), when("k > 1", lambda c: c.a["k"] > 1),
              when("T = 0", lambda c: c.a["logits"].shape[0] == 0),
              when("a low-precision logits dtype", lambda c: c.a["logits"].dtype in (torch.bfloat16, torch.float16)),
              when("capacity dropping tokens", lambda c: not bool(c.result.kept.all())),
              when("ties in the logits", lambda c: c.a["logits"].shape[0] > 0 and
                   bool((c.a["logits"].unsqueeze(-1) == c.a["logits"].unsqueeze(-2)).sum() > c.a["logits"].numel()))],
    "all_to_all": [none("group"), world_group(),
                   when("a rank sending nothing to some rank", lambda c: 0 in list(c.a["send_splits"])),
                   when("uneven splits", lambda c: len(set(c.a["send_splits"])) > 1),
                   when("multi-dimensional rows", lambda c: c.a["x"].dim() > 2),
                   when("world > 2", lambda c: c.world > 2)],
    "MoE.__init__": [when("k > 1", lambda c: c.a["k"] > 1), none("capacity_factor")],
    "MoE.forward": [when("called", lambda c: True)],
    "ExpertParallelMoE.__init__": [none("group"), none("capacity_factor"), when("k > 1", lambda c: c.a["k"] > 1)],
    "ExpertParallelMoE.from_full": [none("group"), world_group()],
    "ExpertParallelMoE.forward": [when("T = 0 on this rank", lambda c: c.a["x"].shape[0] == 0),
                                  when("a low-precision input", lambda c: c.a["x"].dtype in (torch.bfloat16, torch.float16)),
                                  when("two forwards in a row (tokens_per_expert set anew)",
                                       lambda c: c.history[-1:] == ("forward",)),
                                  when("world > 2", lambda c: c.world > 2)],
    "build_expert_groups": [when("ep = world", lambda c: c.a["ep"] == c.world), when("ep < world", lambda c: c.a["ep"] < c.world),
                            when("ep = 1", lambda c: c.a["ep"] == 1)],
    "sync_gradients": [when("called", lambda c: True),
                       when("an expert without gradient on this rank (None)", lambda c: c.before["none"])],
}

BEFORE = {"sync_gradients": lambda c: {"none": any(p.grad is None for p in c.a["model"].parameters())}}

IRRELEVANT = {
    "ExpertParallelMoE.__init__": "given code (no EXERCISE region): the tests build with from_full (given too), whose entries are below",
    "expert_capacity": "given code (no EXERCISE region): the capacity formula route() is given",
    "load_imbalance": "given code (no EXERCISE region): a statistic for the guidelines' table",
    "build_expert_groups": "given code (no EXERCISE region): 2.8's build_groups renamed",
}
