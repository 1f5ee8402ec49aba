"""4.6 Hung collectives: a bounded wait, a per-rank flight recorder, and who diverged.

A rank that is alive but never reaches a collective (a collective under `if rank == 0:`, one
batch more on one rank, a dead NIC, a GPU hang) leaves every other rank waiting in it, and
torchrun sees nothing wrong: no process died. Two things turn that hang into a diagnosis:

    rec = CollectiveRecorder(capacity=2000, timeout=60.0, dump_path="run/fr_rank{rank}.json")
    rec(dist.all_reduce, grad)                        # dist.all_reduce(grad), recorded and
    rec(dist.broadcast, weights, src=0, group=dp)     # bounded: after 60 s CollectiveTimeout,
    rec(dist.barrier)                                 # with this rank's dump written first

    # later, with every rank's dump (the files, or rec.dump() gathered):
    for finding in diagnose([json.load(open(p)) for p in sorted(glob.glob("run/fr_rank*.json"))]):
        print(finding["message"])
    # rank 2 never started collective #17 (all_reduce float32[1024]) of group [0, 1, 2, 3];
    # ranks 0, 1, 3 wait in it

The recorder keeps, like torch's flight recorder (TORCH_FR_BUFFER_SIZE entries, 2000 by
default; TORCH_NCCL_TRACE_BUFFER_SIZE is its older name), the newest `capacity` collectives
this rank issued through it, each numbered per process group, and dumps them as plain JSON
when one fails. `diagnose` lines the ranks' dumps up by those numbers. `Work.wait(timeout)`
bounds the wait on the host on gloo and on NCCL alike (torch 2.14.1's ProcessGroupNCCL.hpp:
with a timeout it "will block the CPU thread until the NCCL work is completed or timed out");
a wait without one (DDP's, FSDP's) only orders CUDA streams on NCCL, which is why NCCL has a
watchdog and its own flight recorder (phase4_production/guidelines.md, section 4.6).
"""

from __future__ import annotations

import datetime
import json
import os
from collections import Counter, deque
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the recorder's timeout: some rank of its group
    never reached it (or is stuck in it). Its message must contain "timed out" (what the tests
    check, as readers of logs grep for it) and should name the collective, e.g.
    "rank 0: collective #17 (all_reduce float32[1024]) of group [0, 1, 2, 3] timed out after 60 s"."""


def signature(op: str, dtype: str | None, shape: list[int] | None) -> str:
    """How a collective is named in messages: "all_reduce float32[1024]", "barrier"."""
    if dtype is None:
        return op
    return f"{op} {dtype}[{', '.join(str(n) for n in shape or [])}]"


class CollectiveRecorder:
    """A per-rank flight recorder: collectives issued through it are recorded, waited for at
    most `timeout` seconds, and dumped when they fail.

        rec(collective, *args, group=None, **kwargs)

    issues `collective(*args, group=group, async_op=True, **kwargs)` (any torch.distributed
    collective that takes `group` and `async_op`: all_reduce, broadcast, all_gather_single,
    reduce_scatter_single, barrier, ...; pass the group by keyword) and returns once it has
    completed. Before issuing, it records an entry:

        {"seq": n,             # this collective's number on its group: 0, 1, 2, ... per group
         "op": "all_reduce",   # collective.__name__
         "group": [0, 1, 2],   # the group's global ranks, sorted (every rank for group=None)
         "shape": [1024],      # of the first argument that is a torch.Tensor; None if none
         "dtype": "float32",   # its dtype without "torch."; None if none
         "state": "started"}   # "completed" once the wait returned

    If it has not completed after `timeout` seconds, the recorder writes the dump to
    `dump_path` ("{rank}" in it becomes this rank; nothing written when None), then raises
    CollectiveTimeout. An error of the collective itself (invalid arguments, a peer's
    connection closed) is dumped too and then propagates unchanged (the same exception, not
    a CollectiveTimeout). Either way the entry stays "started". How to tell them apart: the
    backend's own message says "timed out" (gloo: "Timed out waiting 3000ms for recv",
    "Operation timed out!"; NCCL: "... timed out in blocking wait.").

    `dump()` returns this rank's record as plain JSON data (a copy):

        {"rank": r, "world_size": n, "capacity": c,
         "groups": [{"ranks": [0, 1, 2], "issued": 18}, ...],   # per group used: collectives issued
         "entries": [entry, ...]}                                # the newest `capacity`, oldest first

    "issued" counts every collective ever issued on the group, so a reader knows how far a
    rank got even after its oldest entries left the ring buffer.
    """

    def __init__(self, capacity: int = 2000, timeout: float = 300.0, dump_path: str | os.PathLike | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (entries kept), got {capacity}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.capacity, self.timeout = int(capacity), float(timeout)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dump_path = None if dump_path is None else str(dump_path).replace("{rank}", str(self.rank))
        # EXERCISE 4.6: hold the newest `capacity` entries and, per group, how many collectives were issued on it; see collections.deque
        self._entries: deque[dict[str, Any]] = deque(maxlen=self.capacity)
        self._issued: dict[tuple[int, ...], int] = {}
        # END EXERCISE

    def __call__(self, collective: Callable[..., Any], *args: Any, group: dist.ProcessGroup | None = None,
                 **kwargs: Any) -> None:
        """Issue `collective` on `group`, recorded, and wait for it at most `timeout` seconds."""
        # EXERCISE 4.6: record the entry before issuing the collective; bound the wait by self.timeout (Work.wait); dump a failure, then raise
        ranks = tuple(sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)))
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        seq = self._issued.get(ranks, 0)
        self._issued[ranks] = seq + 1
        entry = {"seq": seq, "op": collective.__name__, "group": list(ranks),
                 "shape": None if tensor is None else list(tensor.shape),
                 "dtype": None if tensor is None else str(tensor.dtype).removeprefix("torch."),
                 "state": "started"}
        self._entries.append(entry)
        try:
            work = collective(*args, group=group, async_op=True, **kwargs)
            if work is not None:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except Exception as exc:
            self.write_dump()
            if "timed out" in str(exc).lower():  # gloo: "Operation timed out!", "Timed out waiting 3000ms for recv"
                raise CollectiveTimeout(f"rank {self.rank}: collective #{seq} "
                                        f"({signature(entry['op'], entry['dtype'], entry['shape'])}) of group "
                                        f"{list(ranks)} timed out after {self.timeout:g} s: a rank of the group "
                                        f"never reached it or is stuck in it; dump: {self.dump_path}") from exc
            raise
        entry["state"] = "completed"
        # END EXERCISE

    def dump(self) -> dict[str, Any]:
        """This rank's record (see the class docstring): JSON-serialisable, a copy."""
        # EXERCISE 4.6: the documented dict of plain lists, ints and strings, entries oldest first; a copy that later collectives do not change
        return {"rank": self.rank, "world_size": self.world_size, "capacity": self.capacity,
                "groups": [{"ranks": list(ranks), "issued": n} for ranks, n in sorted(self._issued.items())],
                "entries": [{**e, "group": list(e["group"]), "shape": None if e["shape"] is None else list(e["shape"])}
                            for e in self._entries]}
        # END EXERCISE

    def write_dump(self) -> None:
        """Write dump() to dump_path as JSON, atomically (a reader never sees half a dump)."""
        if self.dump_path is None:
            return
        path = Path(self.dump_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(path.name + ".tmp")
        temp.write_text(json.dumps(self.dump(), indent=1))
        os.replace(temp, path)


def diagnose(dumps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where the ranks' records diverge, from every rank's dump (CollectiveRecorder.dump(),
    in any order). One finding per process group whose ranks disagree, in the order of the
    groups' rank lists; [] when no group diverged:

        {"group": [0, 1, 2, 3],   # the group's global ranks
         "seq": 17,               # the first collective number of that group where ranks disagree
         "kind": "skipped",       # "skipped": some ranks never started #seq;
                                  # "mismatch": all started it, some with another op, dtype or shape
         "ranks": [2],            # the ranks that diverged: never started it, or issued the odd one
         "waiting": [0, 1, 3],    # the ranks whose #seq is "started" and not completed
         "expected": {"op": "all_reduce", "dtype": "float32", "shape": [1024]},  # what most issued
         "message": "rank 2 never started collective #17 (all_reduce float32[1024]) of group "
                    "[0, 1, 2, 3]; ranks 0, 1, 3 wait in it"}

    A rank never started #seq when it issued at most seq collectives on the group (its
    "issued" count). A rank whose entry #seq has left its ring buffer is neither blamed nor
    waiting. "expected" is the (op, dtype, shape) issued by most ranks holding #seq (a tie
    goes to the lowest rank's); None if no dump holds #seq any more. When some ranks never
    started #seq, the finding is "skipped", whatever the others issued there, and "ranks" holds
    only those that never started it.

    "waiting": the ranks whose dump holds entry #seq with "state" "started", in rank order,
    whatever the kind. So a rank that never started #seq never waits in it; in a mismatch
    the odd rank waits too while its entry is "started" (a broadcast where the others
    all-reduce leaves all four "started": waiting [0, 1, 2, 3]), and nobody waits when the
    backend let the odd collective complete (gloo does when the byte counts agree):

        {"group": [0, 1, 2, 3], "seq": 3, "kind": "mismatch", "ranks": [1], "waiting": [],
         "expected": {"op": "all_reduce", "dtype": "float32", "shape": [4]},
         "message": "rank 1 issued all_reduce float32[2, 2] as collective #3 of group "
                    "[0, 1, 2, 3], where the others issued all_reduce float32[4]"}

    "message": one line for a person, any wording, but it must name the collective as "#"
    and its number ("#3"), the expected op ("all_reduce") and every rank of "ranks" by its
    number, as both examples do; signature() names a collective the way they do.

    Raises ValueError when `dumps` is empty, names a rank twice, disagrees on the world
    size, or lacks a rank of the world (a dump per rank is needed, as torchfrtrace needs).
    """
    # EXERCISE 4.6: ValueError unless one dump per rank of one world; per group: each rank's issued count, entries by seq; _first_divergence
    if not dumps:
        raise ValueError("diagnose needs every rank's dump, got none")
    sizes = {d["world_size"] for d in dumps}
    if len(sizes) != 1:
        raise ValueError(f"the dumps disagree on the world size: {sorted(sizes)}")
    world = sizes.pop()
    by_rank: dict[int, dict] = {}
    for d in dumps:
        if d["rank"] in by_rank:
            raise ValueError(f"two dumps of rank {d['rank']}")
        by_rank[d["rank"]] = d
    missing = sorted(set(range(world)) - set(by_rank))
    if missing:
        raise ValueError(f"no dump of rank(s) {missing} (world of {world}): every rank's dump is needed")
    issued: dict[tuple[int, ...], dict[int, int]] = {}  # group -> rank -> collectives issued on it
    held: dict[tuple[int, ...], dict[int, dict[int, dict]]] = {}  # group -> rank -> seq -> entry
    for rank, d in by_rank.items():
        for g in d["groups"]:
            issued.setdefault(tuple(g["ranks"]), {})[rank] = g["issued"]
        for e in d["entries"]:
            held.setdefault(tuple(e["group"]), {}).setdefault(rank, {})[e["seq"]] = e
    findings = []
    for group in sorted(set(issued) | set(held)):
        counts = [issued.get(group, {}).get(r, 0) for r in group]
        finding = _first_divergence(list(group), counts, held.get(group, {}))
        if finding is not None:
            findings.append(finding)
    return findings
    # END EXERCISE


def _first_divergence(group: list[int], issued: list[int], entries: dict[int, dict[int, dict]]) -> dict | None:
    """diagnose's finding for one group, or None if its ranks agree. issued[i]: how many
    collectives rank group[i] issued on the group; entries[rank][seq]: the entries of the
    group that rank's dump still holds (a rank may hold none)."""
    # EXERCISE 4.6: the first seq a rank never started (issued <= seq) or holds with another (op, dtype, shape); ring-dropped: unknown
    candidates = {seq for per_rank in entries.values() for seq in per_rank}
    if min(issued) < max(issued):  # someone never started #min(issued): nothing after it matters
        candidates = {seq for seq in candidates if seq < min(issued)} | {min(issued)}
    for seq in sorted(candidates):
        holders = {r: entries[r][seq] for r in group if seq in entries.get(r, {})}
        sigs = {r: (e["op"], e["dtype"], None if e["shape"] is None else tuple(e["shape"])) for r, e in holders.items()}
        votes = Counter(sigs.values())
        expected = max(votes, key=lambda s: (votes[s], -min(r for r in sigs if sigs[r] == s))) if votes else None
        never = [r for r, n in zip(group, issued) if n <= seq]
        odd = [r for r in sorted(sigs) if sigs[r] != expected]
        if not never and not odd:
            continue
        waiting = [r for r in sorted(holders) if holders[r]["state"] != "completed"]
        what = "a collective whose entries have left every ring buffer" if expected is None else signature(*expected)
        if never:
            message = (f"{_ranks(never)} never started collective #{seq} ({what}) of group {group}"
                       + (f"; {_ranks(waiting)} wait in it" if waiting else ""))
        else:
            message = (", ".join(f"rank {r} issued {signature(*sigs[r])}" for r in odd)
                       + f" as collective #{seq} of group {group}, where the others issued {what}")
        return {"group": group, "seq": seq, "kind": "skipped" if never else "mismatch",
                "ranks": never or odd, "waiting": waiting,
                "expected": None if expected is None else
                {"op": expected[0], "dtype": expected[1], "shape": None if expected[2] is None else list(expected[2])},
                "message": message}
    return None
    # END EXERCISE


def _ranks(ranks: list[int]) -> str:
    """"rank 2", "ranks 0, 1, 3"."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
