"""Contract of exercise 1.1 (sampler.py's docstrings; phase1_data_parallel/guidelines.md, 1.1): the
documented input space of ShardSampler and make_loader (tests/contracts.py reads it)."""

from contracts import default, explicit, flag, raises, when


def _n(c):
    return len(c.a["dataset"])


def _p(c):
    return c.a["num_replicas"] if "num_replicas" in c.a else c.a["world_size"]


def _init(c):
    return c.init.a if c.init else {}


CONTRACT = {
    "ShardSampler.__init__": [
        flag("shuffle"), flag("drop_last"),
        default("shuffle"), explicit("shuffle", True),
        default("drop_last"), explicit("drop_last", False),
        default("seed"), explicit("seed", 0), when("seed > 0", lambda c: c.a["seed"] > 0),
        when("seed >= 2**31 (a 64-bit generator seed)", lambda c: c.a["seed"] >= 2**31),
        when("dataset a range", lambda c: isinstance(c.a["dataset"], range)),
        when("dataset a list", lambda c: isinstance(c.a["dataset"], list)),
        when("dataset a map-style Dataset (only its len())",
             lambda c: not isinstance(c.a["dataset"], (range, list, tuple))),
        when("num_replicas = 1", lambda c: c.a["num_replicas"] == 1),
        when("num_replicas > 2", lambda c: c.a["num_replicas"] > 2),
        when("rank = 0 of several", lambda c: c.a["rank"] == 0 and c.a["num_replicas"] > 1),
        when("rank = num_replicas - 1 > 0", lambda c: c.a["rank"] == c.a["num_replicas"] - 1 > 0),
        when("len divisible by num_replicas (> 1)", lambda c: c.a["num_replicas"] > 1 and _n(c) % _p(c) == 0),
        when("uneven: len not divisible by num_replicas, drop_last=False",
             lambda c: _n(c) % _p(c) != 0 and not c.a["drop_last"]),
        when("uneven: len not divisible by num_replicas, drop_last=True",
             lambda c: _n(c) % _p(c) != 0 and c.a["drop_last"]),
        when("len < num_replicas, drop_last=False (padding wraps more than once)",
             lambda c: _n(c) < _p(c) and not c.a["drop_last"] and _p(c) > 2 * _n(c)),
        when("len < num_replicas, drop_last=True (empty shards)", lambda c: _n(c) < _p(c) and c.a["drop_last"]),
        when("len = 1", lambda c: _n(c) == 1),
        raises("num_replicas = 0", ValueError, lambda c: c.a["num_replicas"] == 0),
        raises("num_replicas < 0", ValueError, lambda c: isinstance(c.a["num_replicas"], int) and c.a["num_replicas"] < 0),
        raises("num_replicas a float 2.0", ValueError, lambda c: isinstance(c.a["num_replicas"], float)
               and c.a["num_replicas"] == int(c.a["num_replicas"])),
        raises("num_replicas a non-integral float", ValueError, lambda c: isinstance(c.a["num_replicas"], float)
               and c.a["num_replicas"] != int(c.a["num_replicas"])),
        raises("num_replicas a str", ValueError, lambda c: isinstance(c.a["num_replicas"], str)),
        raises("num_replicas None", ValueError, lambda c: c.a["num_replicas"] is None),
        raises("rank = num_replicas", ValueError, lambda c: c.a["rank"] == c.a["num_replicas"]),
        raises("rank > num_replicas", ValueError, lambda c: c.a["rank"] > c.a["num_replicas"]),
        raises("rank < 0", ValueError, lambda c: c.a["rank"] < 0),
        raises("empty dataset, num_replicas 1", ValueError, lambda c: _n(c) == 0 and c.a["num_replicas"] == 1),
        raises("empty dataset, num_replicas > 1", ValueError, lambda c: _n(c) == 0 and c.a["num_replicas"] > 1),
    ],
    "ShardSampler.set_epoch": [
        when("epoch 0 spelled out", lambda c: c.a["epoch"] == 0),
        when("epoch > 0", lambda c: c.a["epoch"] > 0),
        when("called again (a later epoch)", lambda c: c.count > 1 and c.a["epoch"] > 0),
        when("an earlier epoch after a later one (any order)",
             lambda c: any(p["epoch"] > c.a["epoch"] for p in c.previous("set_epoch"))),
        when("after the sampler was iterated", lambda c: "__iter__" in c.history),
    ],
    "ShardSampler.__len__": [
        when("drop_last=False", lambda c: not _init(c)["drop_last"]),
        when("drop_last=True, uneven", lambda c: _init(c)["drop_last"]
             and len(_init(c)["dataset"]) % _init(c)["num_replicas"] != 0),
        when("before any iteration", lambda c: "__iter__" not in c.history),
    ],
    "ShardSampler.__iter__": [
        when("before any set_epoch (epoch 0)", lambda c: "set_epoch" not in c.history),
        when("after set_epoch", lambda c: "set_epoch" in c.history),
        when("iterated again without set_epoch in between",
             lambda c: "__iter__" in c.history and "set_epoch" not in c.since("__iter__")),
        when("shuffle=False", lambda c: not _init(c)["shuffle"]),
        when("several samplers (ranks) alive at once", lambda c: c.live > 1),
    ],
    "make_loader": [
        flag("shuffle"), flag("drop_last"),
        default("shuffle"), default("seed"), default("drop_last"),
        when("seed > 0", lambda c: c.a["seed"] > 0),
        when("world_size = 1", lambda c: c.a["world_size"] == 1),
        when("rank = world_size - 1 > 0", lambda c: c.a["rank"] == c.a["world_size"] - 1 > 0),
        when("uneven dataset, drop_last=True", lambda c: _n(c) % _p(c) != 0 and c.a["drop_last"]),
        when("shard not a multiple of batch_size (a last partial batch)",
             lambda c: len(c.result.sampler) % c.a["batch_size"] != 0),
        when("batch_size larger than the shard", lambda c: c.a["batch_size"] > len(c.result.sampler)),
        when("batch_size = 1", lambda c: c.a["batch_size"] == 1),
    ],
}

IRRELEVANT = {}
