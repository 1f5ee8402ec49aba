"""Contract of exercise 4.3 (elastic.py's docstrings; guidelines 4.3): a fixed global batch at any world size, the
elastic sampler, resharded checkpoints."""

from contracts import default, explicit, flag, none, raises, when


CONTRACT = {
    "rank_share": [
        when("uneven (global % world != 0)", lambda c: c.a["global_batch"] % c.a["world_size"] != 0),
        when("even", lambda c: c.a["global_batch"] % c.a["world_size"] == 0),
        when("world = global batch (one sample each)", lambda c: c.a["world_size"] == c.a["global_batch"]),
        when("the last rank", lambda c: c.a["rank"] == c.a["world_size"] - 1),
        raises("rank outside the world", ValueError, lambda c: not 0 <= c.a["rank"] < c.a["world_size"]),
        raises("more ranks than samples", ValueError, lambda c: c.a["world_size"] > c.a["global_batch"]),
    ],
    "BatchPlan.micro_batches": [when("uneven micro-batches", lambda c: len(set(c.result)) > 1)],
    "BatchPlan.micro_slices": [when("unequal shares (weights differ)", lambda c: len(set(c.self.shares)) > 1)],
    "plan_batches": [
        when("accumulation > 1", lambda c: c.result.accumulation > 1),
        when("accumulation = 1", lambda c: c.result.accumulation == 1),
        when("uneven shares", lambda c: len(set(c.result.shares)) > 1),
        when("max_per_rank = 1", lambda c: c.a["max_per_rank"] == 1),
        raises("an argument not positive", ValueError),
        raises("more ranks than samples", ValueError, lambda c: c.a["world_size"] > c.a["global_batch"] > 0),
        raises("a share smaller than the micro-batch count", ValueError),
    ],
    "ElasticSampler.__init__": [default("seed"), default("shuffle"), flag("shuffle"),
                                when("dataset not a multiple of the global batch", lambda c: c.a["dataset_size"]
                                     % c.a["global_batch"] != 0)],
    "ElasticSampler.order": [none("epoch"), when("an epoch given", lambda c: c.a["epoch"] is not None)],
    "ElasticSampler.rank_batches": [
        when("mid-epoch (some consumed)", lambda c: "advance" in c.history),
        when("a world size that changed since the last call",
             lambda c: any(p["world_size"] != c.a["world_size"] for p in c.previous("rank_batches"))),
        raises("rank outside the world", ValueError), raises("more ranks than the global batch", ValueError),
    ],
    "ElasticSampler.advance": [when("past the end of an epoch", lambda c: c.self.state_dict().get("consumed", 1) == 0)],
    "ElasticSampler.state_dict": [when("mid-epoch", lambda c: c.result.get("consumed", 0) > 0)],
    "ElasticSampler.load_state_dict": [when("into a fresh sampler", lambda c: "advance" not in c.history),
                                       raises("saved for another dataset/batch/seed/shuffle", ValueError)],
    "save_sharded": [none("process_group"), when("a plain tensor (replicated)", lambda c: True)],
    "load_sharded": [none("process_group"), when("at another world size", lambda c: True)],
}

IRRELEVANT = {
    "ElasticSampler.order": "given code (no EXERCISE region): the permutation the graded rank_batches cuts",
    "save_sharded": "given code (no EXERCISE region): torch.distributed.checkpoint.save with the course's arguments",
    "load_sharded": "given code (no EXERCISE region): torch.distributed.checkpoint.load with the course's arguments",
}
