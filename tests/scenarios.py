"""One world of ranks shared by many tests: the ranks run named scenarios in turn, the
parent runs the world once and hands each test the per-rank results of its scenario.

    def _rank(ref):                                   # in the ranks
        mod = ref.load()
        return run_scenarios({name: partial(fn, mod) for name, fn in _SCENARIOS.items()}, agree_s=20)

    _world = SharedWorld(_rank, 3)                    # in the parent, at module level
    per_rank = _world.results("step", ref)            # run_world(_rank, 3, args=(ref,)) once per args

A scenario that raises is reported by its own tests only: a TODO as a TODO, anything else
as a failure naming the rank. After each scenario the ranks agree (on the world's store)
before the next one starts. A rank whose scenario raised waits `agree_s` at most, then
ends the world with its error (the others may be stuck waiting for a message it never
sent). A rank whose scenario finished waits as long as the world lives: a scenario that
hangs is ended by the world's deadline (common/launch.py, COURSE_WORLD_TIMEOUT), and its
tests fail with a message that names it, the ranks that did not finish it and the file
and line where each of those waits.

A world that ends inside a scenario (a hang, a rank that ended the world, a rank that
died) fails that scenario's tests only: every rank leaves each scenario's result in a
folder the parent names as soon as it has it, so the scenarios finished before stay
answered, and a test of a later scenario runs the world again without the scenarios
already answered.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable

import pytest
import torch.distributed as dist

import common.launch  # DEFAULT_TIMEOUT_S read when a world starts: a control may change it
from common.launch import WorldTimeout, describe_stuck_frame, run_world

# From SharedWorld to the ranks (run_world's env): where each scenario's results go, which scenarios to skip.
_FOLDER_ENV, _SKIP_ENV = "COURSE_SCENARIOS_FOLDER", "COURSE_SCENARIOS_SKIP"
_GAVE_UP = 1 << 20  # added to a scenario's count of ranks arrived by a rank that ends the world
_calls = itertools.count()  # run_scenarios calls in this rank: each agrees under its own store keys
_TESTS = Path(__file__).resolve().parent


def _harness(filename: str) -> bool:
    """A file of the tests (a scenario, a wrapper around a torch call), not of the code under test
    (a negative control is the code under test)."""
    path = Path(filename).resolve()
    return path.is_relative_to(_TESTS) and not path.is_relative_to(_TESTS / "negative_controls")


def run_scenarios(scenarios: dict[str, Callable[[], object]], agree_s: float) -> dict:
    """In a rank: {name: ("done", result) | ("todo", message) | ("error", message, traceback)}.

    agree_s: how long a rank whose scenario raised waits for the others before it ends the
    world with its error. A rank whose scenario finished waits for the others as long as the
    world lives (its deadline reports a hang with every rank's stack)."""
    store = dist.distributed_c10d._get_default_store()
    rank, size, call = dist.get_rank(), dist.get_world_size(), next(_calls)
    folder = os.environ.get(_FOLDER_ENV)
    skip = set(json.loads(os.environ.get(_SKIP_ENV, "[]")))
    results = {}
    for index, (name, scenario) in enumerate(scenarios.items()):
        if name in skip:  # answered by an earlier world of the same SharedWorld
            continue
        if folder:
            Path(folder, f"{index}.{rank}.started").write_text(name)
        error = None
        try:
            results[name] = ("done", scenario())
        except Exception as exc:  # noqa: BLE001 - reported by the tests of this scenario only
            error = exc
            todo = isinstance(exc, NotImplementedError) and str(exc).startswith("TODO")
            results[name] = ("todo", str(exc)) if todo else \
                ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        if folder:
            _dump(results[name], Path(folder, f"{index}.{rank}.result"))
        key = f"course/scenarios/{call}/{index}"
        if store.add(f"{key}/arrived", 1) == size:
            store.set(f"{key}/all", "1")
        if error is None:
            store.wait([f"{key}/all"])  # the store's timeout is the process group's, past the world's deadline
            continue
        try:
            store.wait([f"{key}/all"], timedelta(seconds=agree_s))
        except Exception:  # noqa: BLE001 - another rank is stuck where this one left
            # Give up, unless the last rank arrived meanwhile: the count then passes `size` for good,
            # so no rank can go on to the next scenario while this one ends the world.
            if store.add(f"{key}/arrived", _GAVE_UP) != size + _GAVE_UP:
                raise error from None
    return results


def _dump(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(obj, f)
    os.replace(tmp, path)


class ScenarioHang(AssertionError):
    """A scenario still running at the world's deadline; `stacks` maps each rank that had not
    finished it to its stack dump (as common.launch.WorldTimeout's)."""

    def __init__(self, message: str, stacks: dict[int, str]):
        super().__init__(message)
        self.stacks = stacks


class _Stopped:
    """The world ended inside this scenario: `error` (what run_world raised), the ranks that
    had finished it, and the world's deadline then."""

    def __init__(self, error: BaseException, finished: list[int], deadline_s: float):
        self.error, self.finished, self.deadline_s = error, finished, deadline_s


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else \
        "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


class SharedWorld:
    """In the parent: `worker` on `size` ranks, run once per distinct `args`; each scenario's
    per-rank results (or the exception the world ended with inside it) are kept and given to
    every later test. A world that ended inside a scenario is run again, without the scenarios
    already answered, when a test asks for a scenario it never reached."""

    def __init__(self, worker: Callable, size: int):
        self.worker, self.size = worker, size
        self._answers: dict = {}  # args -> {scenario name: per-rank outcomes | _Stopped}
        self._ended: dict = {}  # args -> why no further scenario can be answered (None: the world ran to its end)

    def results(self, name: str, *args, world: str | None = None, hang_hint: str = "",
                what: str | None = None, ranks: int | None = None) -> list:
        """Per rank (the first `ranks`, default all), the result of scenario `name`.

        `world` names the world in the message of a deadlock (default "the world of N
        ranks"), followed by `hang_hint`; `what` names the scenario in the messages of a
        deadlock and of a rank's error (default "scenario 'name'")."""
        world = world or f"the world of {self.size} ranks"
        what = what or f"scenario {name!r}"
        answers = self._answers.setdefault(args, {})
        while name not in answers and args not in self._ended:
            self._run(args, answers)
        if name not in answers:
            ended = self._ended[args]
            if ended is None:
                raise KeyError(f"the world's ranks ran no scenario named {name!r}")
            if isinstance(ended, WorldTimeout) and not ended.not_started:
                hint = f" ({hang_hint})" if hang_hint else ""
                raise AssertionError(f"{world} did not finish{hint}: {ended}") from ended
            raise ended
        got = answers[name]
        if isinstance(got, _Stopped):
            if isinstance(got.error, WorldTimeout) and not got.error.not_started:
                raise self._hang(got, what, world, hang_hint) from got.error
            raise got.error
        per_rank = got[:ranks]
        todo = next((r[1] for r in per_rank if r[0] == "todo"), None)
        if todo:
            raise NotImplementedError(todo)
        for rank, r in enumerate(per_rank):
            if r[0] == "error":
                pytest.fail(f"{what}: rank {rank} raised {r[1]}\n{r[2]}", pytrace=False)
        return [r[1] for r in per_rank]

    def _run(self, args: tuple, answers: dict) -> None:
        """Run the world once, skipping the scenarios already answered; record what it answers."""
        deadline_s = common.launch.DEFAULT_TIMEOUT_S
        with tempfile.TemporaryDirectory(prefix="course-scenarios-") as folder:
            env = {_FOLDER_ENV: folder, _SKIP_ENV: json.dumps(sorted(answers))}
            try:
                per_rank = run_world(self.worker, self.size, args=args, env=env)
            except Exception as exc:  # noqa: BLE001 - kept for the tests of the scenario it ended in
                self._record_stop(exc, Path(folder), args, answers, deadline_s)
                return
        for name in per_rank[0]:
            answers[name] = [r[name] for r in per_rank]
        self._ended[args] = None

    def _record_stop(self, exc: BaseException, folder: Path, args: tuple, answers: dict, deadline_s: float) -> None:
        """The world ended with `exc`: the scenarios before the last one it started keep their results
        (every rank finished them: they agreed), the last one gets `exc` (unless every rank finished it
        without an error). None started: `exc` answers every later scenario too."""
        started: dict[int, str] = {}
        outcomes: dict[int, dict[int, tuple]] = {}
        for path in folder.glob("*.started"):
            started[int(path.name.split(".")[0])] = path.read_text()
        for path in folder.glob("*.result"):
            index, rank = map(int, path.name.split(".")[:2])
            with open(path, "rb") as f:
                outcomes.setdefault(index, {})[rank] = pickle.load(f)
        if not started:
            self._ended[args] = exc
            return
        last = max(started)
        for index in sorted(started):
            done = outcomes.get(index, {})
            if len(done) == self.size and (index < last or all(o[0] == "done" for o in done.values())):
                answers[started[index]] = [done[r] for r in range(self.size)]
            else:  # a rank that raised here may have ended the world while the others were still in it
                answers[started[index]] = _Stopped(exc, sorted(done), deadline_s)
                return

    def _hang(self, stopped: _Stopped, what: str, world: str, hint: str) -> ScenarioHang:
        """The message of a scenario that hung: which ranks never finished it, and where each of them waits."""
        timeout = stopped.error
        left = [r for r in range(self.size) if r not in stopped.finished]
        head = f"{what}, in {world}, did not finish within the world's deadline ({stopped.deadline_s:.0f} s): " \
               f"{_ranks(left)} never finished it"
        if stopped.finished:
            head += f"; {_ranks(stopped.finished)} finished it and waited for {'it' if len(left) == 1 else 'them'}"
        head += f" ({hint})" if hint else " (a deadlock?)"
        lines = [head + ".", "Where each rank waits (innermost frame outside torch):"]
        for r in range(self.size):
            if r in stopped.finished:
                lines.append(f"  rank {r}: finished this scenario, waiting for the others (tests/scenarios.py)")
            else:
                lines.append(f"  rank {r}: {describe_stuck_frame(timeout.stacks.get(r, ''), _harness)}")
        stacks = {r: timeout.stacks[r] for r in left if r in timeout.stacks}
        lines += [f"--- stack of rank {r} ---\n{s or '(no dump)'}" for r, s in stacks.items()]
        return ScenarioHang("\n".join(lines), stacks)
