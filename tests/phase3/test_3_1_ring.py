"""Graded tests of exercise 3.1, ring all-reduce from point-to-point messages
(phase3_multi_node/guidelines.md, section 3.1).

Run them with `python tests/test_phase3.py -k 3_1` (your code) or
`pytest tests/test_phase3.py -k 3_1` (the reference); tests/test_phase3.py collects them.

One world per size (1, 2, 3 and 4 ranks) runs every case once, recording what each rank
computed and every message it posted; each test then checks one aspect of those
records. What is graded is behaviour: the values, the bytes each rank sends and to whom,
the receive buffers it allocates. A ring in the other direction passes as well.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import grading
from common.launch import run_world
from common.measure import PointToPointLog, storage_key
from compare import assert_no_problems, diff_report

CASES = [  # (dtype, shape): numel % p != 0, numel < p, 0-d and empty tensors included
    (torch.float32, (1000,)), (torch.float32, (3, 5, 2)), (torch.float32, ()), (torch.float32, (0,)),
    (torch.float64, (7,)), (torch.int64, (4, 4)), (torch.int32, (2,)), (torch.float16, (33,)),
]
P2P = {"send", "recv", "isend", "irecv", "batch_isend_irecv"}
# Receive buffers that are not views of the tensor: at most one per phase of the ring.
MAX_BUFFERS = {"ring_reduce_scatter": 1, "ring_all_gather": 1, "ring_all_reduce": 2}
PARTITIONS = [[[0], [1, 2, 3]], [[0, 2], [1, 3]]]  # subgroups, in the world of 4
# A large tensor (world of 2): 33.5 MB of float32, two chunks of more than 16 MiB each, the first one element longer
# (numel odd): whatever a solution does with large messages (one message, or pieces), the values must be torch's.
LARGE_NUMEL = 2 * (16 << 20) // 4 + 5


def _data(rank: int, case: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """Rank `rank`'s input of case `case`: any rank can build any rank's input."""
    gen = torch.Generator().manual_seed(1000 * rank + case)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 10).to(dtype)
    return torch.randint(-100, 100, shape, generator=gen).to(dtype)


def _chunk(tensor: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    return torch.tensor_split(tensor.reshape(-1), parts)[index]


def _record(mod, function: str, x: torch.Tensor, expected: torch.Tensor, check: int | None,
            members: list[int], case: str, **kwargs) -> dict:
    """Run mod.<function>(x, **kwargs) once, watched; what the parent needs to judge it.

    `check`: compare only chunk `check` of the flat result with the same chunk of
    `expected` (None: the whole tensor). `members`: the group's global ranks, in group order."""
    given = x
    with PointToPointLog(also_in=(mod,)) as log:
        returned = getattr(mod, function)(x, **kwargs)
    parts = len(members)
    actual = x if check is None else _chunk(x, check, parts)
    want = expected if check is None else _chunk(expected, check, parts)
    tol = dict(rtol=1e-2, atol=1e-2) if x.dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)
    input_key = storage_key(given)
    problem = diff_report(actual, want, "", **tol)
    if problem and check is not None:  # a recognisable shape: the full sum sits in another chunk
        shifted = [j for j in range(parts) if j != check and _chunk(x, j, parts).numel() and
                   torch.allclose(_chunk(x, j, parts), _chunk(expected, j, parts), **tol)]
        if shifted:
            problem += (f" (this rank holds the complete sum in chunk {shifted[0]} instead of chunk {check}: the "
                        f"ring schedule is shifted by {(shifted[0] - check) % parts} step(s); check which chunk a "
                        "rank sends and reduces in each step)")
    return {
        "function": function, "case": case, "rank": dist.get_rank(), "members": members,
        "what": f"{function}({case}{', op=' + repr(kwargs['op']) if 'op' in kwargs else ''}) "
                f"on rank {dist.get_rank()} of {'group ' + str(members) if parts != dist.get_world_size() else parts}",
        "value_problem": problem,
        "returned_input": returned is given,
        "result": x.clone(),
        "numel": x.numel(), "element_size": x.element_size(),
        "forbidden": sorted({n for n in log.names() if n not in P2P}),
        "ops": [(op.kind, op.peer, op.nbytes) for op in log.ops],
        "buffers": len({storage_key(op.tensor) for op in log.ops if op.kind == "recv"
                        and op.tensor.numel() and storage_key(op.tensor) != input_key}),
    }


def _cases(mod, group, members: list[int]) -> list[dict]:
    """Every case of the three functions on `group` (None: the world), on this rank."""
    rank, parts = dist.get_rank(), len(members)
    me = members.index(rank)
    records = []
    for index, (dtype, shape) in enumerate(CASES):
        case = f"{str(dtype).replace('torch.', '')}, shape {tuple(shape)}"
        x = _data(rank, index, dtype, shape)
        for op in ("sum", "avg") if dtype.is_floating_point else ("sum",):
            expected = x.clone()
            dist.all_reduce(expected, group=group)
            if op == "avg":
                expected /= parts
            records.append(_record(mod, "ring_all_reduce", x.clone(), expected, None, members, case, op=op, group=group))
            records.append(_record(mod, "ring_reduce_scatter", x.clone(), expected, me, members, case, op=op, group=group))
        # all-gather: rank c contributes chunk c of its own input; the rest of its tensor is noise
        gathered = torch.cat([_chunk(_data(member, index, dtype, shape), c, parts) for c, member in enumerate(members)])
        start = x.new_full(shape, 77)
        _chunk(start, me, parts).copy_(_chunk(x, me, parts))
        records.append(_record(mod, "ring_all_gather", start, gathered.reshape(shape), None, members, case, group=group))
    return records


def _refuses_integer_avg(mod) -> str | None:
    """None if ring_all_reduce(int tensor, op="avg") raises a clear error (before sending anything)."""
    try:
        with PointToPointLog(also_in=(mod,)) as log:
            mod.ring_all_reduce(torch.arange(5), op="avg")
    except (TypeError, ValueError):
        return None if not log.ops else "ring_all_reduce(int64, op='avg') raised, but only after sending messages"
    return "ring_all_reduce(int64 tensor, op='avg') must raise TypeError or ValueError (AVG needs floating point)"


def _large_case(mod) -> str | None:
    """ring_all_reduce of LARGE_NUMEL floats against dist.all_reduce, judged here (the tensors stay in the rank)."""
    gen = torch.Generator().manual_seed(77 + dist.get_rank())
    x = torch.randn(LARGE_NUMEL, generator=gen)
    expected = x.clone()
    dist.all_reduce(expected)
    try:
        mod.ring_all_reduce(x)
    except Exception as exc:  # noqa: BLE001 - reported as the problem
        return f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return diff_report(x, expected, "", rtol=1e-5, atol=1e-5) or None


def _ring_rank(ref: grading.ModuleRef) -> dict:
    mod = ref.load()
    world = dist.get_world_size()
    out = {"world": _cases(mod, None, list(range(world))), "int_avg": _refuses_integer_avg(mod), "groups": [],
           # ring_neighbours(group) as called: the default, the world's group spelled out, then each subgroup
           "neighbours": [("the default group", list(range(world)), mod.ring_neighbours()),
                          ("group=dist.group.WORLD", list(range(world)), mod.ring_neighbours(dist.group.WORLD))]}
    if world == 2:
        out["large"] = _large_case(mod)
    if world == 4:
        for partition in PARTITIONS:
            groups = [dist.new_group(members) for members in partition]  # every rank creates every group
            for members, group in zip(partition, groups):
                if dist.get_rank() in members:
                    out["neighbours"].append((f"the group {members}", members, mod.ring_neighbours(group)))
                    out["groups"] += _cases(mod, group, members)
        # the world's group spelled out, for the three functions (the object group=None stands for)
        out["groups"] += _cases(mod, dist.group.WORLD, list(range(world)))
    return out


_WORLDS: dict = {}


def _world(ref: grading.ModuleRef, world_size: int) -> dict:
    """The records of a world of `world_size` ranks, run once for all tests (a failure too:
    a deadlock is waited for once, then every test of that world reports it)."""
    key = (ref, world_size)
    if key not in _WORLDS:
        try:
            _WORLDS[key] = run_world(_ring_rank, world_size, args=(ref,))
        except Exception as exc:  # noqa: BLE001 - re-raised, here and in every later test of this world
            _WORLDS[key] = exc
    if isinstance(_WORLDS[key], Exception):
        raise _WORLDS[key]
    return _WORLDS[key]


def _records(ref, world_size: int, functions: tuple, section: str = "world") -> list[dict]:
    return [r for rank in _world(ref, world_size) for r in rank[section] if r["function"] in functions]


def _value_problems(records: list[dict]) -> list[str]:
    problems = []
    for r in records:
        if r["forbidden"]:
            problems.append(f"{r['what']}: called torch.distributed.{', '.join(r['forbidden'])}; build it from "
                            "point-to-point messages only (isend/irecv, send/recv, batch_isend_irecv)")
        if not r["returned_input"]:
            problems.append(f"{r['what']}: must work in place on the given tensor and return it")
        if r["value_problem"]:
            part = "the whole tensor" if r["function"] != "ring_reduce_scatter" else "this rank's own chunk"
            problems.append(f"{r['what']}: {part} differs from torch's result{r['value_problem']}")
    return problems


def _neighbours(r: dict) -> tuple[int, int]:
    members, me = r["members"], r["members"].index(r["rank"])
    return members[(me - 1) % len(members)], members[(me + 1) % len(members)]


def _chunk_bytes(r: dict) -> list[int]:
    parts = len(r["members"])
    return [len(c) * r["element_size"] for c in torch.tensor_split(torch.empty(r["numel"]), parts)]


def _traffic_problems(records: list[dict]) -> list[str]:
    """Each rank sends only to a ring neighbour, receives only from one, and sends exactly the
    chunks a ring must forward: reduce-scatter every chunk but the one it ends up owning,
    all-gather every chunk but the one its receiving neighbour already has at the start."""
    problems = []
    for r in records:
        previous, following = _neighbours(r)
        members, me, parts = r["members"], r["members"].index(r["rank"]), len(r["members"])
        chunks, total = _chunk_bytes(r), r["numel"] * r["element_size"]
        if parts == 1:
            if r["ops"]:
                problems.append(f"{r['what']}: a group of one rank has nobody to talk to, but posted {len(r['ops'])} "
                                "messages")
            continue
        peers = {"send": {p for k, p, _ in r["ops"] if k == "send"}, "recv": {p for k, p, _ in r["ops"] if k == "recv"}}
        for kind, seen in peers.items():
            strangers = seen - {previous, following}
            if strangers:
                problems.append(f"{r['what']}: {kind}s {'to' if kind == 'send' else 'from'} rank(s) {sorted(strangers)}, "
                                f"but its ring neighbours are ranks {previous} and {following} (global ranks; "
                                "in a group, peers are the group's members)")
        phases = 2 if r["function"] == "ring_all_reduce" else 1
        messages = sum(k == "send" for k, _, _ in r["ops"])
        if messages > phases * (parts - 1):
            problems.append(f"{r['what']}: posted {messages} sends; a ring sends one chunk per step, {phases} x (p-1) = "
                            f"{phases * (parts - 1)} messages at most (the cost model's {'' if phases == 1 else 2}"
                            f"(p-1) latencies: a chunk cut into several messages pays alpha for each)")
        sent = sum(b for k, _, b in r["ops"] if k == "send")
        reduce_scatter = total - chunks[me]
        all_gather = {total - chunks[(me + 1) % parts], total - chunks[(me - 1) % parts]}  # either direction
        allowed = {"ring_reduce_scatter": {reduce_scatter}, "ring_all_gather": all_gather,
                   "ring_all_reduce": {reduce_scatter + g for g in all_gather}}[r["function"]]
        if sent not in allowed:
            problems.append(f"{r['what']}: sent {sent} bytes in all, a ring sends {' or '.join(map(str, sorted(allowed)))} "
                            f"(tensor {total} bytes, chunks {chunks}: each step forwards one chunk, never the whole "
                            "tensor, nothing twice)")
    return problems


def _buffer_problems(records: list[dict]) -> list[str]:
    return [f"{r['what']}: received into {r['buffers']} distinct buffers that are not views of the tensor, "
            f"at most {MAX_BUFFERS[r['function']]} expected: allocate the receive buffer once per call, "
            "before the steps, and receive into a slice of it" for r in records
            if r["buffers"] > MAX_BUFFERS[r["function"]]]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_3_1_ring_all_reduce_equals_dist_all_reduce(grade, world_size):
    ranks = _world(grade("3.1"), world_size)
    records = _records(grade("3.1"), world_size, ("ring_all_reduce",))
    problems = _value_problems(records) + [rank["int_avg"] for rank in ranks if rank["int_avg"]][:1]
    by_case = {}
    for r in records:
        by_case.setdefault(r["what"].split(" on rank")[0], []).append(r)
    for what, same in by_case.items():
        for other in same[1:]:
            if not torch.equal(other["result"], same[0]["result"]) and not problems:
                diff = (other["result"].double() - same[0]["result"].double()).abs().max().item()
                problems.append(f"{what}: rank {other['rank']} and rank {same[0]['rank']} hold different results "
                                f"(max diff {diff:.3g}); every rank must end with bitwise the same tensor (each "
                                "chunk reduced once, by one rank, then copied), or replicas drift apart")
    assert_no_problems(problems, f"ring_all_reduce differs from dist.all_reduce in a world of {world_size}:")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_3_1_reduce_scatter_and_all_gather_alone(grade, world_size):
    problems = _value_problems(_records(grade("3.1"), world_size, ("ring_reduce_scatter", "ring_all_gather")))
    assert_no_problems(problems, f"ring_reduce_scatter (group rank r ends with chunk r of the sum, chunks = "
                                 f"torch.tensor_split(flat, p)) or ring_all_gather (chunk c comes from group rank c) "
                                 f"is wrong in a world of {world_size}:")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_3_1_each_rank_sends_what_a_ring_must_send(grade, world_size):
    records = _records(grade("3.1"), world_size, tuple(MAX_BUFFERS))
    assert_no_problems(_traffic_problems(records), f"messages in a world of {world_size}:")


@pytest.mark.parametrize("world_size", [3, 4])
def test_3_1_receive_buffers_allocated_once_per_call(grade, world_size):
    records = _records(grade("3.1"), world_size, tuple(MAX_BUFFERS))
    assert_no_problems(_buffer_problems(records), f"receive buffers in a world of {world_size}:")


def test_3_1_ring_neighbours_are_global_ranks(grade):
    """ring_neighbours(group) returns (r, p, previous, next): the group rank, the group's size and the GLOBAL ranks of
    group ranks r - 1 and r + 1, for the default group, the world's group spelled out and subgroups."""
    problems = []
    for rank, result in enumerate(_world(grade("3.1"), 4)):
        for what, members, got in result["neighbours"]:
            r, p = members.index(rank), len(members)
            expected = (r, p, members[(r - 1) % p], members[(r + 1) % p])
            if tuple(got) != expected:
                problems.append(f"ring_neighbours on global rank {rank}, {what}: returned {tuple(got)}, expected "
                                f"{expected} (group rank, group size, GLOBAL ranks of the previous and next members)")
    assert_no_problems(problems, "ring_neighbours in a world of 4, groups [[0], [1, 2, 3]] and [[0, 2], [1, 3]]:")


def test_3_1_subgroups(grade):
    records = _records(grade("3.1"), 4, tuple(MAX_BUFFERS), section="groups")
    problems = _traffic_problems(records) + _value_problems(records)  # wrong peers first: they name the cause
    assert_no_problems(problems, f"in a world of 4, on the process groups {PARTITIONS[0]} and then {PARTITIONS[1]} "
                                 "(group= given; the group's rank r is not global rank r):")


def test_3_1_a_large_tensor(grade):
    """ring_all_reduce of 33.5 MB of float32 on 2 ranks (chunks of more than 16 MiB, the first one element longer)
    equals dist.all_reduce on every rank: however a solution moves large chunks (one message, or pieces through a
    bounded buffer), every element arrives."""
    problems = [f"ring_all_reduce of {LARGE_NUMEL} float32 on rank {rank} of 2: {result['large']}"
                for rank, result in enumerate(_world(grade("3.1"), 2)) if result["large"]]
    assert_no_problems(problems, "a large tensor:")
