"""Graded tests of exercise 4.6, hung collectives (phase4_production/guidelines.md, section 4.6).

Run them with `python tests/test_phase4.py -k 4_6` (your code) or
`pytest tests/test_phase4.py -k 4_6` (the reference); tests/test_phase4.py collects them.

The recorder is graded in real gloo worlds of 2, 3 and 4 ranks: one rank skips a collective
(it stops issuing collectives on that group, as a rank stuck elsewhere would), the others
must get CollectiveTimeout after the recorder's short timeout, with their dump written,
instead of waiting for the world's deadline. Every scenario runs on process groups made for
it, so a collective abandoned by a timeout never meets the next scenario's. No test asserts
how long anything took: a recorder that does not bound its wait deadlocks the world, which
then fails with every rank's stack.

`diagnose` is graded on dumps in the documented format, built here from per-rank lists of
collectives (ring buffer and per-group counts included), and end to end on the dumps the
recorder wrote in those worlds.
"""

from __future__ import annotations

import atexit
import copy
import json
import math
import os
import random
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist

import grading
from common.launch import run_world
from compare import assert_no_problems

TIMEOUT_S = 3.0  # the recorder's timeout in the worlds: far above a healthy collective's milliseconds
# The skip in each world: (world size, skipping rank, the seq it never starts, collectives planned)
SKIPS = {2: (1, 0, 3), 3: (0, 4, 6), 4: (2, 17, 20)}
SUB_A, SUB_B, SUB_SKIPPER, SUB_SEQ = [0, 2], [1, 3], 3, 2  # world 4: rank 3 never starts #2 of group [1, 3]
WRAP_CAPACITY, WRAP_SKIPPER, WRAP_SEQ, WRAP_PLANNED = 6, 0, 13, 16  # world 4, ring buffer of 6
RESHAPED_RANK, RESHAPED_SEQ = 1, 3  # world 4: rank 1 all-reduces a [2, 2] where the others have a [4]
RING_CAPACITY, RING_CALLS = 5, 12


# ------------------------------------------------------------------ the worlds

def _error(exc: BaseException, mod) -> dict:
    return {"type": type(exc).__name__, "message": str(exc),
            "timeout": isinstance(exc, mod.CollectiveTimeout), "runtime_error": isinstance(exc, RuntimeError)}


def _run_calls(mod, rec, calls) -> dict:
    """Issue calls [(collective, args, kwargs)] through `rec` until one raises; what happened."""
    for i, (collective, args, kwargs) in enumerate(calls):
        try:
            rec(collective, *args, **kwargs)
        except NotImplementedError as exc:
            if str(exc).startswith("TODO"):
                raise
            return {"raised_at": i, "error": _error(exc, mod)}
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which asserts
            return {"raised_at": i, "error": _error(exc, mod)}
    return {"raised_at": None, "error": None}


def _read_file(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except ValueError as exc:
        return {"unreadable": str(exc)}


def _scenario(mod, folder: str, name: str, plan_for_rank, capacity: int = 2000) -> dict:
    """One recorder on this rank, the calls plan_for_rank() gives, then its dump and dump file."""
    template = os.path.join(folder, f"{name}_{{rank}}.json")
    rec = mod.CollectiveRecorder(capacity=capacity, timeout=TIMEOUT_S, dump_path=template)
    out = _run_calls(mod, rec, plan_for_rank())
    out["dump"] = rec.dump()
    out["file"] = _read_file(template.replace("{rank}", str(dist.get_rank())))
    return out


def _all_reduces(n: int, numel: int = 1024, group=None, dtype=torch.float32) -> list:
    rank = dist.get_rank()
    return [(dist.all_reduce, (torch.full((numel,), float(rank + 1), dtype=dtype),), {"group": group})
            for _ in range(n)]


def _flight_recorder() -> list[dict]:
    """torch's own flight recorder on this rank (torch 2.14.1: gloo records into it too, 2000 entries by default,
    TORCH_FR_BUFFER_SIZE), stack traces left out: its entries, oldest first."""
    import pickle
    return pickle.loads(torch._C._distributed_c10d._dump_fr_trace(includeStackTraces=False)).get("entries", [])


def _hang_rank(ref: grading.ModuleRef, folder: str) -> dict:
    mod = ref.load()
    rank, world = dist.get_rank(), dist.get_world_size()
    everyone = list(range(world))
    sync = dist.new_group(everyone)  # the test's own, never handed to the recorder
    out = {}

    skipper, seq, planned = SKIPS[world]
    group = dist.new_group(everyone)
    out["skip"] = _scenario(mod, folder, "skip",
                            lambda: _all_reduces(seq if rank == skipper else planned, group=group))
    dist.barrier(group=sync)
    if world != 4:
        return out

    full, a, b = dist.new_group(everyone), dist.new_group(SUB_A), dist.new_group(SUB_B)

    def subgroups():
        calls = _all_reduces(2, numel=8, group=full)
        if rank in SUB_A:
            return calls + _all_reduces(3, numel=16, group=a)
        return calls + _all_reduces(SUB_SEQ if rank == SUB_SKIPPER else 4, numel=5, group=b, dtype=torch.int64)
    out["subgroup"] = _scenario(mod, folder, "subgroup", subgroups)
    dist.barrier(group=sync)

    group = dist.new_group(everyone)
    out["wrap"] = _scenario(mod, folder, "wrap", lambda: _all_reduces(
        WRAP_SEQ if rank == WRAP_SKIPPER else WRAP_PLANNED, numel=4, group=group), capacity=WRAP_CAPACITY)
    dist.barrier(group=sync)

    group = dist.new_group(everyone)

    def reshaped():
        calls = _all_reduces(5, numel=4, group=group)
        if rank == RESHAPED_RANK:  # the same 4 floats, another shape: gloo cannot tell, the record can
            calls[RESHAPED_SEQ] = (dist.all_reduce, (torch.full((2, 2), float(rank + 1)),), {"group": group})
        return calls
    out["reshaped"] = _scenario(mod, folder, "reshaped", reshaped)
    dist.barrier(group=sync)

    group = dist.new_group(everyone)
    rec = mod.CollectiveRecorder(capacity=RING_CAPACITY, timeout=TIMEOUT_S)
    for i in range(RING_CALLS):  # shapes [1] .. [12]: the entries kept say which calls they were
        rec(dist.all_reduce, torch.ones(i + 1), group=group)
    first = rec.dump()
    first_copy = json.loads(json.dumps(first))
    newest = first["entries"][-1]  # still held after one more collective
    newest["state"], first["groups"][0]["issued"] = "tampered", -1
    newest["shape"].append(99)
    rec(dist.all_reduce, torch.ones(RING_CALLS + 1), group=group)
    out["ring"] = {"dump": first_copy, "after_tampering": rec.dump()}
    dist.barrier(group=sync)

    whole, pair = dist.new_group(everyone), dist.new_group([0, 1])

    def wrapped_groups():  # capacity 3: ranks 0 and 1 keep no entry of `whole`, only how many they issued
        calls = _all_reduces(2, numel=3, group=whole)
        return calls + (_all_reduces(4, numel=6, group=pair) if rank in (0, 1) else [])
    out["wrapped_groups"] = _scenario(mod, folder, "wrapped_groups", wrapped_groups, capacity=3)
    dist.barrier(group=sync)

    # Last, on the default group (a recorder may change a group's timeout): an invalid root.
    out["error"] = _scenario(mod, folder, "error",
                             lambda: [(dist.broadcast, (torch.ones(3),), {"src": world})])
    dist.barrier(group=sync)

    sub = dist.new_group([1, 2, 3])

    def healthy():
        x = torch.full((3,), float(rank + 1))
        y = torch.full((2, 2), rank, dtype=torch.int64)
        z = torch.full((5,), float(rank), dtype=torch.bfloat16)
        gathered, piece = torch.zeros(2 * world), torch.full((2,), float(rank))
        m = torch.tensor([float(rank)], dtype=torch.float64)
        scattered, pieces = torch.zeros(2), torch.full((2 * world,), float(rank + 1))
        listed, mine = [torch.zeros(3, dtype=torch.int64) for _ in range(world)], torch.full((3,), rank)
        healthy.tensors = {"x": x, "y": y, "z": z, "gathered": gathered, "m": m, "scattered": scattered}
        healthy.listed = listed
        calls = [(dist.all_reduce, (x,), {}),
                 (dist.broadcast, (y,), {"src": 3}),
                 *([(dist.all_reduce, (z,), {"group": sub})] if rank in (1, 2, 3) else []),
                 (dist.all_gather_into_tensor, (gathered, piece), {}),
                 (dist.barrier, (), {}),
                 (dist.all_reduce, (m,), {"op": dist.ReduceOp.MAX}),
                 (dist.reduce_scatter_tensor, (scattered, pieces), {}),
                 (dist.all_gather, (listed, mine), {})]  # a list first: the entry describes `mine`
        return calls
    before = max((e["record_id"] for e in _flight_recorder()), default=-1)
    out["healthy"] = _scenario(mod, folder, "healthy", healthy)
    healthy.tensors["listed"] = torch.cat(healthy.listed)
    out["healthy"]["values"] = {k: t.float().tolist() for k, t in healthy.tensors.items()}
    names = {dist.group.WORLD.group_name: everyone, **({sub.group_name: [1, 2, 3]} if rank in (1, 2, 3) else {})}
    out["healthy"]["torch_fr"] = [  # what torch recorded of the same calls, and each group's ranks
        {"group": names.get(e["process_group"][0]), "seq": e["collective_seq_id"], "op": e["profiling_name"],
         "input_sizes": e["input_sizes"], "input_dtypes": e["input_dtypes"], "output_sizes": e["output_sizes"]}
        for e in _flight_recorder() if e["record_id"] > before and not e.get("is_p2p")]
    return out


_worlds: dict = {}


def _world(ref: grading.ModuleRef, world_size: int) -> list[dict]:
    """Every rank's scenario results for `ref` in a world of `world_size` (run once, shared)."""
    key = (ref, world_size)
    if key not in _worlds:
        folder = tempfile.mkdtemp(prefix=f"course-4_6-{world_size}-")
        atexit.register(shutil.rmtree, folder, True)
        try:
            _worlds[key] = run_world(_hang_rank, world_size, args=(ref, folder))
        except Exception as exc:  # noqa: BLE001 - every test that needs the world reports it
            _worlds[key] = exc
    if isinstance(_worlds[key], BaseException):
        todo = grading.todo_of(_worlds[key])
        if todo:
            raise NotImplementedError(todo)
        raise _worlds[key]
    return _worlds[key]


# ------------------------------------------------------------- the recorder


def _expected_entry(seq: int, group: list[int], shape, dtype, state: str, op: str = "all_reduce") -> dict:
    return {"seq": seq, "op": op, "group": group, "shape": shape, "dtype": dtype, "state": state}


def _entry_problems(got: dict, want: dict, where: str) -> list[str]:
    wrong = [f"{k}={got.get(k)!r} (expected {v!r})" for k, v in want.items() if got.get(k) != v]
    return [f"{where}: " + ", ".join(wrong)] if wrong else []


def _waiting_problems(world_size: int, name: str, results: list[dict], members: list[int], skipper: int,
                      seq_index: int) -> list[str]:
    """The skipper returns normally; every other member raised CollectiveTimeout at call seq_index."""
    problems = []
    for rank in members:
        r = results[rank][name]
        err = r["error"]
        if rank == skipper:
            if err is not None:
                problems.append(f"world of {world_size}, {name}: rank {rank} (it skipped the collective) raised "
                                f"{err['type']}: {err['message'][:200]} at call {r['raised_at']}")
            continue
        if err is None:
            problems.append(f"world of {world_size}, {name}: rank {rank} returned normally from the collective "
                            f"rank {skipper} never started: expected CollectiveTimeout")
        elif not err["timeout"]:
            problems.append(f"world of {world_size}, {name}: rank {rank} raised {err['type']}: "
                            f"{err['message'][:200]}, not CollectiveTimeout")
        elif r["raised_at"] != seq_index:
            problems.append(f"world of {world_size}, {name}: rank {rank} timed out in its call {r['raised_at']}, "
                            f"expected call {seq_index} (the one rank {skipper} skipped; the earlier ones complete)")
        elif not err["runtime_error"] or "timed out" not in err["message"].lower():
            problems.append(f"world of {world_size}, {name}: rank {rank}'s CollectiveTimeout must be a RuntimeError "
                            f"whose message says \"timed out\"; got {err['type']}: {err['message'][:200]}")
    return problems


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_4_6_skipped_collective_times_out_instead_of_hanging(grade, world_size):
    results = _world(grade("4.6"), world_size)
    skipper, seq, planned = SKIPS[world_size]
    problems = _waiting_problems(world_size, "skip", results, list(range(world_size)), skipper, seq)
    if world_size == 4:
        problems += _waiting_problems(4, "subgroup", results, SUB_B, SUB_SKIPPER, 2 + SUB_SEQ)
        problems += _waiting_problems(4, "wrap", results, list(range(4)), WRAP_SKIPPER, WRAP_SEQ)
        for name in ("subgroup", "reshaped", "wrapped_groups", "healthy"):
            for rank, per_rank in enumerate(results):
                r = per_rank[name]
                if name == "subgroup" and rank in SUB_B:
                    continue
                if r["error"] is not None:
                    problems.append(f"world of 4, {name}: rank {rank} raised {r['error']['type']}: "
                                    f"{r['error']['message'][:200]} at call {r['raised_at']}, but every rank "
                                    "of every group reached that collective")
    assert_no_problems(problems, f"CollectiveRecorder(timeout={TIMEOUT_S}) in a world of {world_size}: rank "
                                 f"{skipper} never starts collective #{seq} of {planned} all-reduces (it stops "
                                 "there, as a rank stuck elsewhere would); the others must time out in it:")


def test_4_6_timeout_writes_the_record_first(grade):
    problems = []
    for world_size in (2, 3, 4):
        results = _world(grade("4.6"), world_size)
        skipper, seq, _ = SKIPS[world_size]
        cases = [("skip", list(range(world_size)), skipper, seq, 1024, "float32")]
        if world_size == 4:
            cases += [("subgroup", SUB_B, SUB_SKIPPER, SUB_SEQ, 5, "int64"),
                      ("wrap", list(range(4)), WRAP_SKIPPER, WRAP_SEQ, 4, "float32")]
        for name, members, culprit, hung_seq, numel, dtype in cases:
            for rank in members:
                if rank == culprit:
                    continue
                r = results[rank][name]
                where = f"world of {world_size}, {name}, rank {rank}"
                if r["file"] is None:
                    problems.append(f"{where}: no dump file at dump_path ('{name}_{{rank}}.json' with "
                                    f"{{rank}} = {rank}) after the timeout")
                    continue
                if "unreadable" in r["file"]:
                    problems.append(f"{where}: the dump file is not JSON: {r['file']['unreadable']}")
                    continue
                if r["file"] != r["dump"]:
                    problems.append(f"{where}: the dump file differs from rec.dump() taken after the timeout "
                                    f"(file entries {r['file'].get('entries', [])[-2:]}, dump() entries "
                                    f"{r['dump'].get('entries', [])[-2:]})")
                entries = r["file"].get("entries") or [{}]
                problems += _entry_problems(entries[-1], _expected_entry(hung_seq, members, [numel], dtype, "started"),
                                            f"{where}: the dump's newest entry (the collective that timed out)")
                if len(entries) > 1:
                    problems += _entry_problems(entries[-2], {"seq": hung_seq - 1, "state": "completed"},
                                                f"{where}: the entry before it")
    assert_no_problems(problems, "CollectiveRecorder: the dump a timed-out collective writes to dump_path "
                                 "(\"{rank}\" replaced by the rank) is this rank's dump(), the hung collective last "
                                 "and \"started\":")


def test_4_6_collective_errors_propagate_unchanged(grade):
    results = _world(grade("4.6"), 4)
    problems = []
    for rank, per_rank in enumerate(results):
        r = per_rank["error"]
        err = r["error"]
        if err is None:
            problems.append(f"rank {rank}: rec(dist.broadcast, t, src=4) in a world of 4 returned normally")
        elif err["timeout"] or err["type"] != "RuntimeError":
            problems.append(f"rank {rank}: raised {err['type']} ({'a CollectiveTimeout' if err['timeout'] else ''}): "
                            f"{err['message'][:160]}; gloo's own RuntimeError (invalid root rank) must propagate "
                            "unchanged: it is no timeout")
        if r["file"] is None:
            problems.append(f"rank {rank}: no dump file after the collective failed (a failing collective is "
                            "dumped, then its error propagates)")
        elif "unreadable" not in r["file"]:
            entries = r["file"].get("entries") or [{}]
            problems += _entry_problems(entries[-1], _expected_entry(0, [0, 1, 2, 3], [3], "float32", "started",
                                                                     op="broadcast"),
                                        f"rank {rank}: the dump's entry of the failed broadcast")
    assert_no_problems(problems, "CollectiveRecorder: a collective that fails by itself (gloo: \"invalid root rank\") "
                                 "is not a timeout:")


def test_4_6_records_every_collective(grade):
    results = _world(grade("4.6"), 4)
    world, everyone, sub = 4, [0, 1, 2, 3], [1, 2, 3]
    problems = []
    for rank, per_rank in enumerate(results):
        r = per_rank["healthy"]
        if r["error"] is not None:
            problems.append(f"rank {rank}: call {r['raised_at']} raised {r['error']['type']}: {r['error']['message'][:200]}")
            continue
        values = r["values"]
        expect_values = {"x": [10.0] * 3, "y": [[3.0, 3.0]] * 2, "gathered": [float(q) for q in range(world) for _ in (0, 1)],
                         "m": [3.0], "scattered": [10.0, 10.0], "listed": [float(q) for q in range(world) for _ in range(3)]}
        if rank in sub:
            expect_values["z"] = [6.0] * 5
        for k, v in expect_values.items():
            if values[k] != v:
                problems.append(f"rank {rank}: after the recorded collectives {k} = {values[k]}, expected {v} "
                                "(the recorder must issue the collective it is given, with its arguments)")
        want = [_expected_entry(0, everyone, [3], "float32", "completed"),
                _expected_entry(1, everyone, [2, 2], "int64", "completed", op="broadcast"),
                *([_expected_entry(0, sub, [5], "bfloat16", "completed")] if rank in sub else []),
                _expected_entry(2, everyone, [2 * world], "float32", "completed", op="all_gather_into_tensor"),
                _expected_entry(3, everyone, None, None, "completed", op="barrier"),
                _expected_entry(4, everyone, [1], "float64", "completed"),
                _expected_entry(5, everyone, [2], "float32", "completed", op="reduce_scatter_tensor"),
                _expected_entry(6, everyone, [3], "int64", "completed", op="all_gather")]
        dump = r["dump"]
        head = {"rank": rank, "world_size": world, "capacity": 2000}
        problems += _entry_problems(dump, head, f"rank {rank}: dump()")
        entries = dump.get("entries", [])
        if len(entries) != len(want):
            problems.append(f"rank {rank}: dump() holds {len(entries)} entries after {len(want)} collectives")
        for i, (got, expected) in enumerate(zip(entries, want)):
            problems += _entry_problems(got, expected, f"rank {rank}: entry {i}")
        groups = sorted((g.get("ranks"), g.get("issued")) for g in dump.get("groups", []))
        want_groups = sorted([(everyone, 7)] + ([(sub, 1)] if rank in sub else []))
        if groups != want_groups:
            problems.append(f"rank {rank}: dump()['groups'] = {dump.get('groups')}, expected "
                            f"{[{'ranks': g, 'issued': n} for g, n in want_groups]}")
        if json.loads(json.dumps(dump)) != dump:
            problems.append(f"rank {rank}: dump() does not survive a JSON round trip unchanged (tuples? numpy?)")
    assert_no_problems(problems, "CollectiveRecorder's record of all_reduce, broadcast (src=3), an all_reduce on the "
                                 "subgroup [1, 2, 3], all_gather_into_tensor, barrier, all_reduce(MAX), "
                                 "reduce_scatter_tensor, all_gather (a list of tensors, then this rank's: the entry "
                                 "describes the first argument that is a tensor), each numbered per group:")


# torch's flight recorder names dtypes by their c10 ScalarType (torch 2.14.1), the recorder as str(dtype) without "torch."
_SCALAR_TYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
                 "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool"}
# What gloo records for a collective the recorder names by its Python function (torch 2.14.1, ProcessGroupGloo):
# all_gather_into_tensor runs as gloo's all_gather (output [world, n]), reduce_scatter_tensor as an all_reduce of the
# whole input (then a copy of this rank's part); the others under their own name.
_GLOO_OPS = {"all_gather_into_tensor": "gloo:all_gather", "reduce_scatter_tensor": "gloo:all_reduce"}


def test_4_6_record_agrees_with_torchs_flight_recorder(grade):
    """Differential test against torch's own flight recorder (torch._C._distributed_c10d._dump_fr_trace, which gloo
    fills too), read on every rank of the world of 4 right after the recorder's healthy calls: the recorder's
    entries and torch's describe the same collectives, in the same order, each on the same group, numbered alike
    per group (torch counts from its group's creation, 1-based: the steps must agree), under the op torch records
    for it; where the recorder's first tensor is the collective's input (all_reduce, broadcast, all_gather of a
    list: its second argument), the same shape
    and dtype; all_gather_into_tensor's output the same number of elements and dtype; a barrier no tensor."""
    results = _world(grade("4.6"), 4)
    problems = []
    for rank, per_rank in enumerate(results):
        r = per_rank["healthy"]
        if r["error"] is not None:
            problems.append(f"rank {rank}: call {r['raised_at']} raised {r['error']['type']}: {r['error']['message'][:200]}")
            continue
        theirs, ours = r["torch_fr"], r["dump"].get("entries", [])
        if not theirs:
            pytest.skip("torch's flight recorder recorded nothing here (TORCH_FR_BUFFER_SIZE=0?): nothing to compare")
        where = f"rank {rank}"
        if len(ours) != len(theirs):
            problems.append(f"{where}: the recorder holds {len(ours)} entries, torch's flight recorder recorded "
                            f"{len(theirs)} collectives for the same calls: {[t['op'] for t in theirs]}")
            continue
        first_seq: dict = {}
        for i, (mine, torch_entry) in enumerate(zip(ours, theirs)):
            at = f"{where}, entry {i} ({mine.get('op')} #{mine.get('seq')} of group {mine.get('group')})"
            group = torch_entry["group"]
            if mine.get("group") != group:
                problems.append(f"{at}: torch recorded this collective on group {group} (global ranks)")
            start = first_seq.setdefault(str(group), (mine.get("seq"), torch_entry["seq"]))
            if isinstance(mine.get("seq"), int) and mine["seq"] - start[0] != torch_entry["seq"] - start[1]:
                problems.append(f"{at}: torch numbers it #{torch_entry['seq']} on its group, {torch_entry['seq'] - start[1]} "
                                f"after the group's first collective here (#{start[1]}); the recorder "
                                f"{mine['seq'] - start[0]} after its #{start[0]} (seq counts per group)")
            op = _GLOO_OPS.get(mine.get("op"), f"gloo:{mine.get('op')}")
            if torch_entry["op"] != op:
                problems.append(f"{at}: torch recorded {torch_entry['op']} here, the recorder {mine.get('op')!r}")
                continue
            dtypes = [_SCALAR_TYPES.get(d, d) for d in torch_entry["input_dtypes"]]
            if mine.get("op") == "barrier":
                if (mine.get("shape"), mine.get("dtype")) != (None, None) or torch_entry["input_sizes"]:
                    problems.append(f"{at}: shape {mine.get('shape')}, dtype {mine.get('dtype')}; torch's input sizes "
                                    f"{torch_entry['input_sizes']} (a barrier has no tensor: None, None)")
            elif mine.get("op") in ("all_reduce", "broadcast", "all_gather"):
                if [mine.get("shape")] != torch_entry["input_sizes"] or [mine.get("dtype")] != dtypes:
                    problems.append(f"{at}: shape {mine.get('shape')}, dtype {mine.get('dtype')}; torch recorded the "
                                    f"input {torch_entry['input_sizes']}, {dtypes}")
            elif mine.get("op") == "all_gather_into_tensor":
                numel = [math.prod(size) for size in torch_entry["output_sizes"]]
                if [math.prod(mine.get("shape") or [0])] != numel or [mine.get("dtype")] != dtypes:
                    problems.append(f"{at}: shape {mine.get('shape')}, dtype {mine.get('dtype')}; torch recorded an "
                                    f"output of {torch_entry['output_sizes']} ({numel} elements), {dtypes}")
    assert_no_problems(problems, "the recorder's entries against torch's flight recorder for the same calls "
                                 "(all_reduce, broadcast, an all_reduce on [1, 2, 3], all_gather_into_tensor, barrier, "
                                 "all_reduce(MAX), reduce_scatter_tensor, all_gather of a list):")


def test_4_6_ring_buffer_keeps_the_newest(grade):
    results = _world(grade("4.6"), 4)
    problems = []
    for rank, per_rank in enumerate(results):
        dump, after = per_rank["ring"]["dump"], per_rank["ring"]["after_tampering"]
        kept = list(range(RING_CALLS - RING_CAPACITY, RING_CALLS))
        entries = dump.get("entries", [])
        got = [(e.get("seq"), e.get("shape")) for e in entries]
        want = [(s, [s + 1]) for s in kept]
        if got != want:
            problems.append(f"rank {rank}: after {RING_CALLS} all-reduces (shapes [1]..[{RING_CALLS}]) with capacity "
                            f"{RING_CAPACITY}, the entries are (seq, shape) {got}; expected the newest "
                            f"{RING_CAPACITY}, oldest first: {want}")
        issued = [g.get("issued") for g in dump.get("groups", [])]
        if issued != [RING_CALLS]:
            problems.append(f"rank {rank}: groups' issued counts {issued}, expected [{RING_CALLS}]: the count "
                            "keeps every collective, also those the ring buffer dropped")
        if got != want or issued != [RING_CALLS]:
            continue  # what it keeps is wrong already: whether dump() copies it cannot be told
        after_entries = after.get("entries", [])
        got_after = [(e.get("seq"), e.get("state"), e.get("shape")) for e in after_entries]
        want_after = [(s, "completed", [s + 1]) for s in range(RING_CALLS - RING_CAPACITY + 1, RING_CALLS + 1)]
        if got_after != want_after or [g.get("issued") for g in after.get("groups", [])] != [RING_CALLS + 1]:
            problems.append(f"dump() returns the recorder's own entries, not a copy: rank {rank}: after changing a "
                            f"dict dump() returned and one more collective, dump() gives (seq, state, shape) "
                            f"{got_after} and groups {after.get('groups')}; expected {want_after} and issued "
                            f"{RING_CALLS + 1}")
    for rank, per_rank in enumerate(results):  # capacity 3 for all groups together, not per group
        dump = per_rank["wrapped_groups"]["dump"]
        pair = rank in (0, 1)
        got = [(e.get("group"), e.get("seq"), e.get("shape")) for e in dump.get("entries", [])]
        want = [([0, 1], s, [6]) for s in (1, 2, 3)] if pair else [([0, 1, 2, 3], s, [3]) for s in (0, 1)]
        if got != want:
            problems.append(f"rank {rank}: capacity 3, 2 all-reduces on [0, 1, 2, 3]" + (", then 4 on [0, 1]"
                            if pair else "") + f": the entries are (group, seq, shape) {got}; expected {want}, the "
                            "newest 3 this rank issued on any group (one ring buffer for all groups)")
    assert_no_problems(problems, "CollectiveRecorder's ring buffer (like the TORCH_FR_BUFFER_SIZE entries of "
                                 "torch's flight recorder):")


# --------------------------------------------------------------- diagnose


def _dump(rank: int, world: int, calls: list[tuple], capacity: int = 2000, stuck: bool = False) -> dict:
    """The documented dump of a rank that issued `calls` [(group, op, dtype, shape)] in order,
    all completed except the last one when `stuck`."""
    issued, entries = {}, []
    for i, (group, op, dtype, shape) in enumerate(calls):
        seq = issued.get(tuple(group), 0)
        issued[tuple(group)] = seq + 1
        entries.append({"seq": seq, "op": op, "group": list(group), "shape": shape, "dtype": dtype,
                        "state": "started" if stuck and i == len(calls) - 1 else "completed"})
    return {"rank": rank, "world_size": world, "capacity": capacity,
            "groups": [{"ranks": list(g), "issued": n} for g, n in sorted(issued.items())],
            "entries": entries[-capacity:]}


def _ar(group, n: int, numel: int = 1024, dtype: str = "float32") -> list[tuple]:
    return [(group, "all_reduce", dtype, [numel])] * n


W4, W3, W2 = [0, 1, 2, 3], [0, 1, 2], [0, 1]


def _finding(group, seq, kind, ranks, waiting, op="all_reduce", dtype="float32", shape=(1024,)) -> dict:
    return {"group": group, "seq": seq, "kind": kind, "ranks": ranks, "waiting": waiting,
            "expected": {"op": op, "dtype": dtype, "shape": None if shape is None else list(shape)}}


def _cases() -> dict[str, tuple[list[dict], list[dict]]]:
    """name -> (every rank's dump, the findings expected)."""
    cases = {}
    cases["rank 2 of 4 never starts #17 (the issue's example)"] = (
        [_dump(r, 4, _ar(W4, 17 if r == 2 else 18), stuck=r != 2) for r in W4],
        [_finding(W4, 17, "skipped", [2], [0, 1, 3])])
    cases["rank 1 of 2 never starts the first collective (its dump is empty)"] = (
        [_dump(0, 2, _ar(W2, 1), stuck=True), _dump(1, 2, [])],
        [_finding(W2, 0, "skipped", [1], [0])])
    cases["ranks 1 and 3 of 4 never start #5"] = (
        [_dump(r, 4, _ar(W4, 5 if r in (1, 3) else 6), stuck=r in (0, 2)) for r in W4],
        [_finding(W4, 5, "skipped", [1, 3], [0, 2])])
    cases["rank 0 of 3 never starts barrier #3"] = (
        [_dump(r, 3, [(W3, "barrier", None, None)] * (3 if r == 0 else 4), stuck=r != 0) for r in W3],
        [_finding(W3, 3, "skipped", [0], [1, 2], op="barrier", dtype=None, shape=None)])
    cases["rank 0 of 3 all-reduces bfloat16 at #4"] = (
        [_dump(r, 3, _ar(W3, 4) + _ar(W3, 1, dtype="bfloat16" if r == 0 else "float32") + _ar(W3, 3)) for r in W3],
        [_finding(W3, 4, "mismatch", [0], [])])
    cases["rank 3 of 4 broadcasts where the others all-reduce, #6, all stuck in it"] = (
        [_dump(r, 4, _ar(W4, 6) + [(W4, "broadcast" if r == 3 else "all_reduce", "float32", [1024])], stuck=True)
         for r in W4],
        [_finding(W4, 6, "mismatch", [3], [0, 1, 2, 3])])
    cases["rank 1 of 3 reshapes at #2, rank 2 later never starts #5: the first divergence"] = (
        [_dump(r, 3, _ar(W3, 2, 4) + [(W3, "all_reduce", "float32", [2, 2] if r == 1 else [4])]
               + _ar(W3, 2 if r == 2 else 3, 4), stuck=r != 2) for r in W3],
        [_finding(W3, 2, "mismatch", [1], [], shape=(4,))])
    cases["ring buffers of 6 that wrapped: rank 0 stops at #13, the others hold #8..#13"] = (
        [_dump(r, 4, [(W4, "all_reduce", "float32", [4])] * (13 if r == 0 else 14), capacity=6, stuck=r != 0)
         for r in W4],
        [_finding(W4, 13, "skipped", [0], [1, 2, 3], shape=(4,))])
    sub = [1, 3]
    cases["subgroup [1, 3]: rank 3 never starts its #2; ranks 0 and 2 are done"] = (
        [_dump(r, 4, _ar(W4, 2, 8) + (_ar([0, 2], 3, 16) if r in (0, 2) else _ar(sub, 2 if r == 3 else 3, 5, "int64")),
               stuck=r == 1) for r in W4],
        [_finding(sub, 2, "skipped", [3], [1], dtype="int64", shape=(5,))])
    cases["two groups diverge: in [0, 1, 2] rank 1 reshapes #0, in [3, 4] rank 4 skips #1; one finding each"] = (
        [_dump(r, 5, [(W3, "all_reduce", "float32", [2, 2] if r == 1 else [4])]) for r in W3]
        + [_dump(3, 5, _ar([3, 4], 2), stuck=True), _dump(4, 5, _ar([3, 4], 1))],
        [_finding(W3, 0, "mismatch", [1], [], shape=(4,)), _finding([3, 4], 1, "skipped", [4], [3])])
    cases["no divergence: the same collectives on every rank of every group"] = (
        [_dump(r, 4, _ar(W4, 3) + (_ar(sub, 2, 5) if r in sub else []) + [(W4, "barrier", None, None)]) for r in W4],
        [])
    cases["no divergence, ring buffers of 3: ranks 0, 1 hold no entry of [0, 1, 2] any more"] = (
        [_dump(r, 3, _ar(W3, 2) + (_ar(W2, 4, 6) if r in W2 else []), capacity=3) for r in W3],
        [])
    cases["ring buffers of 3, [0, 1, 2] gone from ranks 0, 1's; rank 1 never starts #3 of [0, 1]"] = (
        [_dump(r, 3, _ar(W3, 2) + (_ar(W2, 4 if r == 0 else 3, 6) if r in W2 else []), capacity=3, stuck=r == 0)
         for r in W3],
        [_finding(W2, 3, "skipped", [1], [0], shape=(6,))])
    return cases


_COMPARED = ("group", "seq", "kind", "ranks", "waiting", "expected")


def _group_inputs(dumps: list[dict], group: list[int]) -> tuple[list[int], dict[int, dict[int, dict]]]:
    """_first_divergence's documented arguments for `group`, from every rank's dump: how many
    collectives each rank of the group issued on it, and the entries each rank still holds, by seq."""
    issued = [next((g["issued"] for d in dumps if d["rank"] == r for g in d["groups"] if g["ranks"] == group), 0)
              for r in group]
    entries = {d["rank"]: {e["seq"]: dict(e) for e in d["entries"] if e["group"] == group}
               for d in dumps if d["rank"] in group}
    return issued, {r: held for r, held in entries.items() if held}


def _whose(mod, dumps: list[dict], group: list[int], want: dict | None) -> str:
    """Who a wrong finding of `group` comes from, said first in the message for the report (tests/grading.py
    blames the function a message opens with): your _first_divergence, given the group's documented
    arguments, returns another finding than the reference's on the same arguments (or raises):
    "_first_divergence(...) ..."; it returns the reference's, and the reference's diagnose on these dumps
    gives the expected finding: "diagnose(dumps) ..."; it does not (the dumps themselves are wrong, as
    the recorder wrote them): "CollectiveRecorder's dumps ...". "" when it cannot be asked (not written
    yet: your diagnose may do everything itself, which is fine)."""
    first = getattr(mod, "_first_divergence", None)
    if not callable(first):
        return ""
    reference = grading.reference("4.6")
    issued, entries = _group_inputs(dumps, group)
    try:
        got = first(list(group), list(issued), copy.deepcopy(entries))
    except Exception as exc:  # noqa: BLE001 - reported, unless it is the template's TODO
        if grading.todo_of(exc):
            return ""
        return f"_first_divergence(group {group}, ...) raised {type(exc).__name__}: {exc}; "
    right = reference._first_divergence(list(group), list(issued), copy.deepcopy(entries))
    if not _same_finding(got, right):
        return (f"_first_divergence(group {group}, ...) returns {_short(got)} on the group's documented arguments, "
                f"where the contract gives {_short(right)}; ")
    try:
        by_reference = {tuple(f["group"]): f for f in reference.diagnose(copy.deepcopy(dumps))}
    except ValueError:
        by_reference = {}
    if _same_finding(by_reference.get(tuple(group)), want):
        return f"diagnose(dumps) (its _first_divergence is right on group {group}'s arguments): "
    return (f"CollectiveRecorder's dumps (diagnose is right on them: they do not record what the ranks did), "
            f"group {group}: ")


def _same_finding(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return isinstance(a, dict) and all(a.get(k) == b.get(k) for k in _COMPARED)


def _diagnosis_problems(mod, name: str, dumps: list[dict], want: list[dict]) -> list[str]:
    got = mod.diagnose(json.loads(json.dumps(dumps)))
    if not isinstance(got, list):
        return [f"{name}: diagnose(dumps) returned {type(got).__name__}, expected a list of findings"]
    problems = []
    if len(got) != len(want):
        got_groups = [f.get("group") for f in got if isinstance(f, dict)]
        group = next((w["group"] for w in want if w["group"] not in got_groups),
                     next((g for g in got_groups if g not in [w["group"] for w in want]), None))
        who = _whose(mod, dumps, group, next((w for w in want if w["group"] == group), None)) if group else ""
        return [f"{who}{name}: {len(got)} finding(s) {[{k: f.get(k) for k in _COMPARED} for f in got]}, expected "
                f"{len(want)}: {want}"]
    for f, w in zip(got, want):
        wrong = [f"{k}={f.get(k)!r} (expected {w[k]!r})" for k in _COMPARED if f.get(k) != w[k]]
        if wrong:
            problems.append(f"{_whose(mod, dumps, w['group'], w)}{name}: " + ", ".join(wrong))
            continue
        message = f.get("message")
        needed = [f"#{w['seq']}", w["expected"]["op"], *(str(r) for r in w["ranks"])]
        if not isinstance(message, str) or not all(n in message for n in needed):
            problems.append(f"{name}: the finding's message {message!r} must name the collective as #{w['seq']}, "
                            f"its op and the rank(s) {w['ranks']}")
    reversed_got = mod.diagnose(list(reversed(json.loads(json.dumps(dumps)))))
    if [{k: f.get(k) for k in _COMPARED} for f in reversed_got] != [{k: f.get(k) for k in _COMPARED} for f in got]:
        problems.append(f"{name}: diagnose(dumps) with the dumps in reverse order gives another diagnosis: "
                        f"{reversed_got}")
    return problems


def test_4_6_diagnose_names_who_diverged_and_where(grade):
    mod = grade("4.6").load()
    problems = []
    for name, (dumps, want) in _cases().items():
        problems += _diagnosis_problems(mod, name, dumps, want)
    assert_no_problems(problems, "diagnose(dumps) on dumps in the documented format (per group: the first seq "
                                 "where a rank never started it, or issued another op/dtype/shape):")


def test_4_6_diagnose_refuses_incomplete_dumps(grade):
    mod = grade("4.6").load()
    healthy = [_dump(r, 3, _ar(W3, 2)) for r in W3]
    got = mod.diagnose(healthy)
    assert got == [], f"diagnose of 3 identical healthy dumps returned {got}, expected [] (no divergence)"
    problems = []
    for what, dumps in {"no dumps at all": [],
                        "rank 1's dump twice (and no rank 2)": [healthy[0], healthy[1], healthy[1]],
                        "no dump of rank 2": healthy[:2],
                        "dumps that disagree on the world size": healthy[:2] + [_dump(2, 4, _ar(W3, 2))]}.items():
        try:
            result = mod.diagnose(dumps)
        except ValueError:
            continue
        except Exception as exc:  # noqa: BLE001
            problems.append(f"diagnose({what}): raised {type(exc).__name__}: {exc}, expected ValueError")
        else:
            problems.append(f"diagnose({what}): returned {result}, expected ValueError")
    assert_no_problems(problems, "diagnose needs exactly one dump per rank of one world:")


# The property test: random dump sets of the variety real runs produce, each diagnosed by your
# diagnose and by the reference (a deterministic function the docstring specifies fully).
_PROPERTY_SEEDS, _PROPERTY_SETS = (0, 1, 2, 3), 100  # 400 dump sets
_OPS = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier")
_DTYPES = ("float32", "bfloat16", "float16", "int64")


def _random_signature(rng) -> tuple:
    """(op, dtype, shape) of a random collective; a barrier has no tensor."""
    op = rng.choice(_OPS)
    if op == "barrier":
        return (op, None, None)
    shape = [rng.choice((1, 4, 8, 1024))] if rng.random() < 0.7 else [rng.randint(1, 4), rng.randint(1, 4)]
    return (op, rng.choice(_DTYPES), shape)


def _other_signature(rng, sig: tuple) -> tuple:
    """The same collective with another op, dtype or shape (what a diverging rank issues)."""
    while True:
        field = rng.choice(("op", "dtype", "shape"))
        if field == "op" or sig[0] == "barrier":
            other = _random_signature(rng)
            other = (other[0], *sig[1:]) if sig[0] != "barrier" and other[0] != "barrier" else other
        elif field == "dtype":
            other = (sig[0], rng.choice(_DTYPES), sig[2])
        else:
            other = (sig[0], sig[1], [n * 2 for n in sig[2]] if rng.random() < 0.5 else [*sig[2], 1])
        if other != sig:
            return other


def _random_groups(rng, world: int) -> list[tuple[int, ...]]:
    """The world and up to 3 overlapping subgroups, sorted by rank list (as diagnose reports them)."""
    groups = {tuple(range(world))}
    for _ in range(rng.choice((0, 1, 2, 3)) if world > 2 else 0):
        groups.add(tuple(sorted(rng.sample(range(world), rng.randint(2, world - 1)))))
    return sorted(groups)


def _random_issued(rng, group: tuple[int, ...], planned: int) -> dict[int, int]:
    """Per rank, collectives issued on the group: all the same, some one short (the hang), or
    some 2 or more short (the others caught CollectiveTimeout and went on)."""
    issued = {r: planned for r in group}
    mode = rng.choice(("equal", "equal", "short by 1", "short by 2+", "short by 2+"))
    if mode == "equal":
        return issued
    for r in rng.sample(group, rng.randint(1, len(group) - 1)):
        issued[r] = planned - (1 if mode == "short by 1" else rng.randint(min(2, planned), planned))
    if mode == "short by 2+" and rng.random() < 0.5:  # those that went on did not all get as far
        for r in group:
            if issued[r] == planned and rng.random() < 0.4:
                issued[r] = planned - 1
    return issued


def _random_run(rng) -> dict:
    """One run: its world size, its groups, and per rank the collectives it issued
    [(group, seq, signature, state)] in order and its ring buffer's capacity."""
    world = rng.randint(2, 6)
    groups = _random_groups(rng, world)
    per_group: dict[int, list[list[tuple]]] = {r: [] for r in range(world)}
    for group in groups:
        pool = [_random_signature(rng) for _ in range(rng.randint(1, 3))]  # a loop issues few kinds
        planned = rng.randint(1, 12)
        program = [rng.choice(pool) for _ in range(planned)]
        issued = _random_issued(rng, group, planned)
        sigs = {r: program[:issued[r]] for r in group}
        lowest, highest = min(issued.values()), max(issued.values())
        odd_seqs = set()
        for _ in range(rng.choice((0, 0, 1, 1, 2)) if highest else 0):
            # a random seq, or the one some rank never started (its holders then disagree too)
            seq = lowest if lowest < highest and rng.random() < 0.4 else rng.randrange(highest)
            holders = [r for r in group if issued[r] > seq]
            if len(holders) < 2:
                continue
            if len(holders) % 2 == 0 and rng.random() < 0.4:  # a tie between two signatures
                odd = rng.sample(holders, len(holders) // 2)
            else:
                odd = rng.sample(holders, rng.randint(1, (len(holders) - 1) // 2 or 1))
            other = _other_signature(rng, program[seq])
            for r in odd:
                sigs[r][seq] = other
            odd_seqs.add(seq)
        hung = {seq for seq in odd_seqs if rng.random() < 0.5}  # a mismatch hangs, or gloo does not notice
        for r in group:
            per_group[r].append([(group, seq, sig, "started" if seq >= lowest or seq in hung else "completed")
                                 for seq, sig in enumerate(sigs[r])])
    runs = {}
    capacity_mode = rng.choice(("large", "same", "same", "per rank"))
    same = rng.randint(1, 16)
    for r in range(world):
        queues = [q for q in per_group[r] if q]
        calls = []
        in_turn = rng.random() < 0.3  # one group after the other (a rank that went on elsewhere)
        while queues:
            q = queues[0] if in_turn else rng.choice(queues)
            calls.append(q.pop(0))
            queues = [q for q in queues if q]
        capacity = {"large": 2000, "same": same, "per rank": rng.randint(1, 16)}[capacity_mode]
        runs[r] = {"calls": calls, "capacity": capacity}
    return {"world": world, "groups": groups, "ranks": runs}


def _rank_dump(run: dict, rank: int, calls: int | None = None) -> dict:
    """The documented dump of `rank` in a run from _random_run, after its first `calls` collectives
    (all of them when None)."""
    mine = run["ranks"][rank]
    issued: dict[tuple, int] = {}
    for group, seq, _, _ in mine["calls"][:calls]:
        issued[group] = seq + 1
    entries = [{"seq": seq, "op": op, "group": list(group), "shape": None if shape is None else list(shape),
                "dtype": dtype, "state": state} for group, seq, (op, dtype, shape), state in mine["calls"][:calls]]
    return {"rank": rank, "world_size": run["world"], "capacity": mine["capacity"],
            "groups": [{"ranks": list(g), "issued": n} for g, n in sorted(issued.items())],
            "entries": entries[-mine["capacity"]:]}


def _spoil(rng, run: dict, dumps: list[dict]) -> tuple[str, list[dict]] | None:
    """Sometimes a set diagnose must refuse (ValueError): what is wrong with it, and the set."""
    world, pick = len(dumps), rng.random()
    if pick < 0.75:
        return None
    victim, other = rng.sample(range(world), 2)
    if pick < 0.81:
        return f"no dump of rank {victim}", [d for d in dumps if d["rank"] != victim]
    if pick < 0.87:  # the dump a rank wrote at an earlier timeout, beside its last one
        earlier = _rank_dump(run, victim, rng.randint(0, len(run["ranks"][victim]["calls"])))
        return f"rank {victim}'s dump twice (an earlier one too), no rank missing", dumps + [earlier]
    if pick < 0.92:
        return (f"rank {other}'s dump twice, none of rank {victim}",
                [d for d in dumps if d["rank"] != victim] + [json.loads(json.dumps(dumps[other]))])
    if pick < 0.99:  # a stale dump of another run mixed in
        return (f"rank {victim}'s dump says world_size {world + 1}",
                [{**d, "world_size": world + 1} if d["rank"] == victim else d for d in dumps])
    return "no dumps at all", []


def _random_dump_sets(seed: int, n: int) -> list[dict]:
    """n dump sets from random.Random(seed): {"name", "run", "dumps" (shuffled), "invalid"}."""
    rng = random.Random(seed)
    sets = []
    for i in range(n):
        run = _random_run(rng)
        dumps, invalid = [_rank_dump(run, r) for r in range(run["world"])], None
        spoiled = _spoil(rng, run, dumps)
        if spoiled is not None:
            invalid, dumps = spoiled
        rng.shuffle(dumps)  # diagnose takes the dumps in any order
        sets.append({"name": f"seed {seed}, set {i}", "run": run, "dumps": dumps, "invalid": invalid})
    return sets


def _sig_text(op, dtype, shape) -> str:
    return f"{op}" if dtype is None else f"{op} {dtype}{list(shape) if isinstance(shape, (list, tuple)) else shape}"


def _describe_group(run: dict, dumps: list[dict], group: list[int], seq: int | None) -> str:
    """A group as each rank's dump shows it: issued count, seqs held, and its entry #seq."""
    lines = [f"  group {group}:"]
    seq = seq if isinstance(seq, int) else None
    by_rank = {d["rank"]: d for d in dumps}
    for r in group:
        d = by_rank.get(r)
        if d is None:
            lines.append(f"    rank {r}: no dump")
            continue
        issued = next((g["issued"] for g in d["groups"] if g["ranks"] == group), 0)
        held = {e["seq"]: e for e in d["entries"] if e["group"] == group}
        window = f"holds #{min(held)}..#{max(held)}" if held else "holds none of its entries"
        line = f"    rank {r}: issued {issued}, {window} (capacity {d['capacity']})"
        if seq is not None:
            e = held.get(seq)
            at = (f"{_sig_text(e['op'], e['dtype'], e['shape'])} {e['state']}" if e is not None
                  else "never started" if issued <= seq else "left its ring buffer")
            line += f"; #{seq}: {at}"
        lines.append(line)
    return "\n".join(lines)


def _structured(findings) -> list:
    return [{k: f.get(k) for k in _COMPARED} if isinstance(f, dict) else f for f in findings]


def _short(finding) -> str:
    """A finding on one line: 'skipped #3, ranks [2], waiting [0, 1], expected all_reduce float32[4]'."""
    if finding is None:
        return "no finding"
    if not isinstance(finding, dict):
        return repr(finding)
    e = finding.get("expected")
    what = (_sig_text(e.get("op"), e.get("dtype"), e.get("shape")) if isinstance(e, dict) else repr(e))
    return (f"group {finding.get('group')}: {finding.get('kind')} #{finding.get('seq')}, ranks {finding.get('ranks')}, "
            f"waiting {finding.get('waiting')}, expected {what}")


def _property_problem(mod, reference, case: dict) -> tuple[str, str] | None:
    """None if `mod` diagnoses the set as the reference does, else (one line, a readable report)."""
    dumps, run = case["dumps"], case["run"]
    name = f"{case['name']}, world of {run['world']}"
    head = (f"{case['name']}: world of {run['world']}, groups {[list(g) for g in run['groups']]}, dumps in the "
            f"order of ranks {[d['rank'] for d in dumps]}")
    try:
        want = reference.diagnose(json.loads(json.dumps(dumps)))
    except ValueError as exc:
        want = exc
    try:
        got = mod.diagnose(json.loads(json.dumps(dumps)))
    except Exception as exc:  # noqa: BLE001 - reported, unless it is the template's TODO
        if grading.todo_of(exc):
            raise
        if isinstance(want, ValueError) and isinstance(exc, ValueError):
            return None
        who = "diagnose(dumps): " if isinstance(want, ValueError) or not want else \
            _whose(mod, dumps, want[0]["group"], want[0])
        line = (f"{who}{name}, {case['invalid'] or 'a valid set'}: raised {type(exc).__name__}: {exc}; expected "
                + ("ValueError" if isinstance(want, ValueError) else
                   "; ".join(_short(f) for f in want) or "no finding"))
        details = [] if isinstance(want, ValueError) else [_describe_group(run, dumps, f["group"], f["seq"])
                                                            for f in want]
        return line, "\n".join([head, *details, f"  {line}"])
    if isinstance(want, ValueError):
        returned = _structured(got) if isinstance(got, list) else got
        line = f"diagnose(dumps): {name}, {case['invalid']}: returned {returned!r}, expected ValueError"
        return line, f"{head}\n  {line}"
    if not isinstance(got, list):
        line = f"{name}: diagnose(dumps) returned {type(got).__name__}, expected a list of findings"
        return line, f"{head}\n  {line}"
    got_s, want_s = _structured(got), _structured(want)
    if got_s == want_s:
        bad = next((f for f in got if not isinstance(f.get("message"), str)), None)
        if bad is None:
            return None
        line = f"{name}: the finding of group {bad['group']} has message {bad.get('message')!r}, not a str"
        return line, f"{head}\n  {line}"
    got_by = {tuple(f["group"]): f for f in got_s if isinstance(f, dict) and isinstance(f.get("group"), list)}
    want_by = {tuple(f["group"]): f for f in want_s}
    differing = [g for g in sorted(set(got_by) | set(want_by)) if got_by.get(g) != want_by.get(g)]
    if differing:
        group = differing[0]
        who = _whose(mod, dumps, list(group), want_by.get(group))
        line = f"{who}{name}: got {_short(got_by.get(group))}; expected {_short(want_by.get(group))}"
        details = []
        for g in differing:
            details += [_describe_group(run, dumps, list(g), (want_by.get(g) or got_by[g]).get("seq")),
                        f"    got:      {_short(got_by.get(g))}", f"    expected: {_short(want_by.get(g))}"]
        return line, "\n".join([head, *details])
    line = (f"diagnose(dumps): {name}: findings for groups "
            f"{[f.get('group') if isinstance(f, dict) else f for f in got_s]}, "
            f"expected one per diverged group in the order of their rank lists: {[f['group'] for f in want_s]}")
    return line, f"{head}\n  {line}"


def test_4_6_diagnose_agrees_with_the_contract_on_random_dumps(grade):
    """Random dump sets (worlds of 2 to 6, the world and overlapping subgroups, issued counts equal
    or 1 or 2+ apart, mismatches (ties, and at the seq a rank skipped), wrapped ring buffers,
    invalid sets): every finding's documented fields as the reference's, in the same order."""
    from solutions.phase4_production import hangs as reference_hangs

    mod = grade("4.6").load()
    mod.diagnose([_dump(r, 2, _ar(W2, 1)) for r in W2])  # the template's TODO, before anything else
    problems, total = [], 0
    for seed in _PROPERTY_SEEDS:
        for case in _random_dump_sets(seed, _PROPERTY_SETS):
            total += 1
            problem = _property_problem(mod, reference_hangs, case)
            if problem is not None:
                problems.append(problem)
    if not problems:
        return
    header = (f"diagnose differs from the contract on {len(problems)} of {total} random dump sets (findings per "
              "group in the order of the groups' rank lists; each the group's first seq where a rank never started "
              "it (\"skipped\", which wins over a mismatch at that seq) or holds another (op, dtype, shape) than "
              "most holders (a tie: the lowest rank's); a rank whose #seq left its ring buffer is neither blamed nor "
              "waiting; \"expected\" None when no dump holds #seq; ValueError for a missing rank, a rank twice, "
              "mixed world sizes):")
    shown = [detail for _, detail in problems[:3]]
    error = AssertionError(header + "\n" + "\n".join(shown)
                           + (f"\n... and {len(problems) - 3} more sets" if len(problems) > 3 else ""))
    error.problems, error.header = [line for line, _ in problems], header  # one line per set for the report
    raise error

def test_4_6_diagnose_the_recorded_hangs(grade):
    """End to end: the dumps the recorder wrote in the worlds, given to diagnose."""
    ref = grade("4.6")
    mod = ref.load()
    problems = []
    for world_size in (2, 3, 4):
        results = _world(ref, world_size)
        everyone = list(range(world_size))
        skipper, seq, _ = SKIPS[world_size]
        cases = {"skip": [_finding(everyone, seq, "skipped", [skipper], [r for r in everyone if r != skipper])]}
        if world_size == 4:
            cases.update({
                "subgroup": [_finding(SUB_B, SUB_SEQ, "skipped", [SUB_SKIPPER], [1], dtype="int64", shape=(5,))],
                "wrap": [_finding(everyone, WRAP_SEQ, "skipped", [WRAP_SKIPPER], [1, 2, 3], shape=(4,))],
                "reshaped": [_finding(everyone, RESHAPED_SEQ, "mismatch", [RESHAPED_RANK], [], shape=(4,))],
                "wrapped_groups": [],
                "healthy": []})
        for name, want in cases.items():
            dumps = [per_rank[name]["dump"] for per_rank in results]
            problems += _diagnosis_problems(mod, f"world of {world_size}, {name}", dumps, want)
    assert_no_problems(problems, "diagnose on the dumps the recorder wrote in real gloo worlds:")
