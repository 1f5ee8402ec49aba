"""Which code is graded, and how its results are reported.

Three kinds of implementation can stand behind an exercise:

  solution  solutions/<phase>/<module>.py           (the reference; `pytest` grades this)
  learner   <learner root>/<phase>/<module>.py      (templates you fill in)
  file      any .py file, e.g. a negative control   (a deliberately buggy variant), or a
            package folder (a mutant of 2.4's zero/)

An exercise's module may be a package, <phase>/<module>/__init__.py with one file per part
(2.4's zero/: one per stage); it is graded as one module: what its __init__.py imports.

A test asks for one exercise (`grade("1.2")`) and gets a picklable `ModuleRef` that
ranks in other processes can load too. Loading a learner's module rebinds whatever it
imported from *other* exercises' modules (of its own phase or of an earlier one) to the
reference, and gives it an `__import__` that does the same for the imports its functions
run when called, so one unfinished exercise never fails the tests of another.

What a run reports (conftest.py calls the functions below):

  * the table, one row per exercise that ran (`summarize`, `format_table`): PASS / FAIL /
    TODO and tests passed of tests run. A row also says how much of the exercise ran: a
    filter (-k, -m, --deselect, node ids) that left some of its tests out makes the row
    "not complete" ("15 of 41 of its tests selected: ... not its verdict"), and the closing
    line (`verdict`) then never says "all done".
  * parts: an exercise made of parts (2.4's stages, 2.6's schedules) declares them in its
    tests, one marker per test, and the table shows one sub-row per part:

        @pytest.mark.part("stage 3")
        def test_2_4_peak_memory_stage3(grade): ...

        @pytest.mark.parametrize("schedule", [pytest.param("gpipe", marks=pytest.mark.part("GPipe")),
                                              pytest.param("1f1b", marks=pytest.mark.part("1F1B"))])
        def test_2_6_matches_one_process(grade, schedule): ...

    Parts appear in the order their first test is collected; an exercise's tests without
    the marker count in a part named "shared". Nothing else to register: conftest.py
    declares the marker, and an exercise without marked tests has no sub-rows.
  * a failing exercise's report (`exercise_report`): one line per graded function (a
    function of the reference holding an EXERCISE region), from `blame`: a failure line
    that opens with a function's name is that function's; one that names it elsewhere, or
    an exception raised in it, is its or its callees' or (a method) its class's; a class
    named is any of its methods; a header or test name naming a function is it or its
    callees; else the report says it cannot tell. Write messages that open with the
    function whose contract failed where the test knows it (4.6's `_whose` asks the
    learner's helper apart to know it).
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Exercise:
    id: str
    title: str
    phase: str  # package folder, e.g. "phase1_data_parallel"
    module: str  # module in that folder, e.g. "sampler"

    @property
    def guidelines(self) -> str:
        return f"{self.phase}/guidelines.md, section {self.id}"


EXERCISES: dict[str, Exercise] = {
    e.id: e
    for e in [
        Exercise("1.1", "Sharding sampler", "phase1_data_parallel", "sampler"),
        Exercise("1.2", "All-reduce strategies from primitives", "phase1_data_parallel", "allreduce"),
        Exercise("1.3", "Communication overhead", "phase1_data_parallel", "comm_bench"),
        Exercise("1.4", "Synchronous data-parallel trainer", "phase1_data_parallel", "trainer"),
        Exercise("2.1", "Gradient accumulation", "phase2_advanced", "accumulation"),
        Exercise("2.2", "Mixed precision and loss scaling", "phase2_advanced", "mixed_precision"),
        Exercise("2.3", "Activation checkpointing", "phase2_advanced", "checkpointing"),
        Exercise("2.4", "ZeRO-style sharding", "phase2_advanced", "zero"),
        Exercise("2.5", "Naive model split", "phase2_advanced", "model_split"),
        Exercise("2.6", "Pipeline schedules", "phase2_advanced", "pipeline"),
        Exercise("2.7", "Tensor parallelism", "phase2_advanced", "tensor_parallel"),
        Exercise("2.8", "Process groups: DP over TP on a 2-D mesh", "phase2_advanced", "mesh"),
        Exercise("2.9", "Sequence and context parallelism", "phase2_advanced", "context_parallel"),
        Exercise("2.10", "Expert parallelism: a mixture of experts over all-to-all", "phase2_advanced", "moe"),
        Exercise("2.11", "3-D parallelism: a transformer on a (pp, dp, tp) mesh", "phase2_advanced", "parallel_3d"),
        Exercise("2.12", "A layout planner held against measurements", "phase2_advanced", "planner"),
        Exercise("3.1", "Ring all-reduce from point-to-point messages", "phase3_multi_node", "ring"),
        Exercise("3.2", "Bucketed DDP with overlap", "phase3_multi_node", "bucketed_ddp"),
        Exercise("3.3", "Hierarchical (topology-aware) all-reduce", "phase3_multi_node", "hierarchical"),
        Exercise("3.4", "Parameter servers: sync, async, load-balanced", "phase3_multi_node", "parameter_server"),
        Exercise("3.5", "Horovod-style DistributedOptimizer", "phase3_multi_node", "distributed_optimizer"),
        Exercise("4.1", "A complete, atomic checkpoint", "phase4_production", "checkpoint"),
        Exercise("4.2", "Automatic recovery under torchrun", "phase4_production", "recovery"),
        Exercise("4.3", "Elastic training", "phase4_production", "elastic"),
        Exercise("4.4", "Gradient compression as DDP communication hooks", "phase4_production", "compression"),
        Exercise("4.5", "Monitoring and profiling", "phase4_production", "monitoring"),
        Exercise("4.6", "Hung collectives: timeouts and a flight recorder", "phase4_production", "hangs"),
    ]
}

_TEST_NAME = re.compile(r"^test_(\d+)_(\d+)_")


def exercise_of_test(test_name: str) -> str | None:
    """'test_1_2_matches_all_reduce[3]' -> '1.2'; None for tests that grade nothing."""
    m = _TEST_NAME.match(test_name)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def module_file(base: Path, module: str) -> Path:
    """The file of `module` in the folder `base`: <module>.py, or <module>/__init__.py where the
    module is a package (2.4's zero/, one file per stage)."""
    package = base / module / "__init__.py"
    return package if package.is_file() else base / f"{module}.py"


def module_files(path: Path) -> list[Path]:
    """Every file of the module whose file is `path`: itself, or for a package's __init__.py
    each .py of its folder, in name order."""
    path = Path(path)
    return sorted(path.parent.glob("*.py")) if path.name == "__init__.py" else [path]


class WrongCodeLoaded(RuntimeError):
    """The module that Python found is not the one we were asked to grade."""


@dataclass(frozen=True)
class ModuleRef:
    """Picklable pointer to the implementation of one exercise."""

    exercise: str
    kind: str  # "solution" | "learner" | "file"
    location: str  # repo root, learner root, or the .py file

    def describe(self) -> str:
        return f"{self.kind} code at {self.path()}"

    def path(self) -> Path:
        ex = EXERCISES[self.exercise]
        if self.kind == "file":  # a file, or a package's folder
            location = Path(self.location)
            return location / "__init__.py" if location.is_dir() else location
        base = Path(self.location) / ("solutions" if self.kind == "solution" else "") / ex.phase
        return module_file(base, ex.module)

    def load(self) -> ModuleType:
        ex = EXERCISES[self.exercise]
        if self.kind == "solution":
            module = importlib.import_module(f"solutions.{ex.phase}.{ex.module}")
        elif self.kind == "learner":
            package = _learner_package(Path(self.location), ex.phase)
            module = _load_learner_module(package, ex.module)
            _use_reference_for_other_exercises(module)
        elif self.kind == "file":
            module = _load_file(Path(self.location))
        else:
            raise ValueError(f"unknown implementation kind {self.kind!r}")
        loaded = Path(module.__file__).resolve()
        if loaded != self.path().resolve():
            raise WrongCodeLoaded(
                f"asked to grade {self.path()} but Python loaded {loaded}; "
                "check PYTHONPATH and that you run from the repository root"
            )
        if os.environ.get("COURSE_CONTRACTS"):  # contract coverage is being recorded (tests/contracts.py)
            import contracts
            contracts.instrument(module, self.exercise)
        return module


def reference(exercise: str) -> ModuleType:
    """The reference solution of an exercise (for ground truths and dependencies)."""
    return ModuleRef(exercise, "solution", str(REPO_ROOT)).load()


def _learner_package(root: Path, phase: str) -> str:
    """Import <root>/<phase> under a private name, so it can never be confused with
    an installed or same-named package (e.g. another checkout's)."""
    name = f"_learner_{phase}"
    if name not in sys.modules:
        folder = root / phase
        init = folder / "__init__.py"
        if not init.exists():
            raise FileNotFoundError(f"no {phase}/__init__.py under {root}: is it a checkout of this course?")
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(folder)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
        spec.loader.exec_module(package)
    return name


_PHASE_MODULE = re.compile(r"^(?:_learner_)?(?P<phase>phase\d+_\w+)(?:\.(?P<module>\w+)(?P<sub>(?:\.\w+)*))?$")
# `sub`: a module inside an exercise's package (phase2_advanced.zero.stage3)


def _inside(name: str, module: str) -> bool:
    """`name` is the module `module` or one of its package's (`_learner_phase2_advanced.zero.stage1`)."""
    return name == module or name.startswith(module + ".")


def _use_reference_for_other_exercises(module: ModuleType) -> None:
    """Rebind what `module` imported from any learner phase package to the reference.

    A learner's phase-2 file may import their own phase-1 code (`from
    phase1_data_parallel.trainer import sync_gradients`) or a sibling exercise (`from
    .zero import ...`, loaded as `_learner_phase2_advanced.zero`): both become
    `solutions.<phase>.<module>`, so grading one exercise never runs another's code. What
    comes from `module`'s own package (an exercise made of files: 2.4's zero/) stays."""
    own = module.__name__
    for attr, value in list(vars(module).items()):
        if isinstance(value, ModuleType):
            origin = value.__name__
        elif isinstance(getattr(value, "__name__", None), str):  # functions and classes, not instances
            origin = getattr(value, "__module__", None)
        else:
            continue
        match = _PHASE_MODULE.match(origin) if isinstance(origin, str) and not _inside(origin, own) else None
        if match is None:
            continue
        reference_name = f"solutions.{match['phase']}" + (f".{match['module']}{match['sub']}" if match["module"]
                                                           else "")
        try:
            ref_module = importlib.import_module(reference_name)
        except ModuleNotFoundError as exc:
            if exc.name != reference_name:
                raise
            continue  # a module of the learner's own, with no reference counterpart
        if isinstance(value, ModuleType):
            setattr(module, attr, ref_module)
        else:  # a helper the reference lacks stays the learner's
            setattr(module, attr, getattr(ref_module, value.__name__, value))


_REDIRECTED: dict[str, ModuleType] = {}  # learner modules loaded by _load_learner_module


def _load_learner_module(package: str, name: str) -> ModuleType:
    """Import `<package>.<name>`, a learner's module, with an `__import__` of its own (its
    `__builtins__`): an import that one of its functions runs when it is CALLED (`from
    .checkpoint import load_verified`, `from phase4_production.checkpoint import ...` inside a
    function) gets the reference of another exercise's module, as the imports of its module
    body do (_use_reference_for_other_exercises), and never the learner's own, perhaps
    unfinished, other exercise. The module itself is the learner's file, loaded once."""
    full = f"{package}.{name}"
    module = sys.modules.get(full)
    if module is not None and _REDIRECTED.get(full) is module:
        return module
    spec = importlib.util.find_spec(full)
    if spec is None:
        raise ModuleNotFoundError(f"No module named {full!r}", name=full)
    module = importlib.util.module_from_spec(spec)
    # A function takes its builtins from its module's globals when it is defined, so they
    # must be in place before the body runs.
    module.__builtins__ = {**vars(builtins), "__import__": _reference_import(full)}
    sys.modules[full] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(full, None)
        raise
    setattr(sys.modules[package], name, module)
    _REDIRECTED[full] = module
    return module


def _reference_import(own: str):
    """builtins.__import__, except that a module of a learner phase package other than `own`
    (named absolutely, `phase4_production.checkpoint`, or relatively from `own`'s package,
    `.checkpoint`, `from . import checkpoint`) is the reference's, `solutions.<phase>.<module>`,
    where the reference has that module; `own` itself, named absolutely, is the module
    being graded (not a second copy of its file)."""
    mine = _PHASE_MODULE.match(own)
    own_key = (mine["phase"], mine["module"]) if mine else None
    real_import = builtins.__import__

    def reference_for(target: str, fromlist) -> ModuleType | None:
        match = _PHASE_MODULE.match(target)
        if match is None:
            return None
        phase, module, sub = match["phase"], match["module"], match["sub"]
        if module is None:  # from <phase package> import a, b: each must be a module of the reference
            if not fromlist or (own_key and own_key[0] == phase and own_key[1] in fromlist):
                return None
            package = _reference_module(f"solutions.{phase}")
            if package is None or not all(hasattr(package, item) or _reference_module(f"solutions.{phase}.{item}")
                                          for item in fromlist):
                return None  # a module of the learner's own: theirs
            return package
        if (phase, module) == own_key:  # the graded module itself, not a second copy of its file; a file
            return sys.modules.get(own) if fromlist and not sub else None  # of its own package: the learner's
        reference = _reference_module(f"solutions.{phase}.{module}{sub}")
        if reference is None:
            return None
        # `from x.y import z` gets x.y; `import x.y` binds x, whose attribute y is then used
        return reference if fromlist else _reference_module(f"solutions.{phase}")

    def __import__(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A001 - builtins' own name
        target = name
        if level:
            package = (globals or {}).get("__package__")
            if not package:
                return real_import(name, globals, locals, fromlist, level)
            try:
                target = importlib.util.resolve_name("." * level + name, package)
            except ImportError:
                return real_import(name, globals, locals, fromlist, level)
        reference = reference_for(target, fromlist)
        return reference if reference is not None else real_import(name, globals, locals, fromlist, level)

    return __import__


def _reference_module(name: str) -> ModuleType | None:
    """The reference module `name`, or None where the reference has no such module."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        return None


def _load_file(path: Path) -> ModuleType:
    """A negative control: its reference with the definitions it names replaced, spliced at load
    time (tests/controls.py); any other file (a mutant, a variant) as a module of its own."""
    import controls
    return controls.load(path)


# ------------------------------------------------------------ reading results


def todo_of(exc: BaseException | None) -> str | None:
    """The 'TODO x.y: ...' message if `exc` (or a rank behind it) hit an unfinished exercise."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, NotImplementedError) and str(exc).startswith("TODO"):
            return str(exc)
        for failure in getattr(exc, "failures", {}).values():  # common.launch.WorldError
            if failure.exc_type == "NotImplementedError" and failure.message.startswith("TODO"):
                return failure.message
        exc = exc.__cause__ or exc.__context__
    return None


class TodoReached(BaseException):
    """A TODO met in a Hypothesis test, raised past Hypothesis (which catches Exception, then
    shrinks): the test reports its TODO at once instead of shrinking an example that every
    input fails the same way (phase 2's templates took 69 s, 33 s of it shrinking). Its cause
    is the TODO, which todo_of finds."""


def stop_hypothesis_at_todo(test):
    """Make a @given test (anything else is returned as it is) stop at the first TODO it meets,
    through Hypothesis's documented hook for plugins (`test.hypothesis.inner_test`); return it.
    The plugin does this for every collected test; a property test defined inside a test
    (it needs the graded module) is run as `grading.stop_hypothesis_at_todo(check)()`."""
    hypothesis = getattr(test, "hypothesis", None)
    inner = getattr(hypothesis, "inner_test", None)
    if inner is None or getattr(inner, "_course_stops_at_todo", False):
        return test

    @functools.wraps(inner)
    def stop_at_todo(*args, **kwargs):
        try:
            return inner(*args, **kwargs)
        except Exception as exc:
            todo = todo_of(exc)
            if todo:
                raise TodoReached(todo) from exc
            raise

    stop_at_todo._course_stops_at_todo = True
    hypothesis.inner_test = stop_at_todo
    return test


def harness_error_of(exc: BaseException | None) -> str | None:
    """The message if `exc` (or a world behind it) failed for a reason that is no verdict
    on the graded code: a rank process died without reporting (killed by a signal, or
    exited in native code), or the deadline passed before every rank had even reached
    the code under test (a busy machine). A deadlock of the graded code is not one."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "not_started", ()):  # common.launch.WorldTimeout
            return str(exc).splitlines()[0]
        failures = getattr(exc, "failures", None)  # common.launch.WorldError
        if failures:
            cause = min(failures.values(), key=lambda f: f.when)
            if cause.exc_type == "ProcessDied":
                return cause.message
        exc = exc.__cause__ or exc.__context__
    return None


_GLOO_SIZE_MISMATCH = re.compile(r"(\d+) vs (\d+)\. Received data size doesn't match expected size")


def collective_mismatch_of(exc: BaseException | None, stderr: str) -> str | None:
    """A verdict hidden in a rank's death: gloo aborts a rank (SIGABRT, no Python traceback,
    so harness_error_of sees a death) when a message it receives is larger than the
    collective that rank posted, i.e. the ranks issued different collectives (another
    order, other sizes). Its line is on the rank's stderr, which pytest captures (`stderr`).
    The verdict is kept on `exc`, for later tests given the same world's failure."""
    known = getattr(exc, "collective_mismatch", None)
    if known:
        return known
    match = _GLOO_SIZE_MISMATCH.search(stderr or "")
    if exc is None or match is None:
        return None
    message = (f"the ranks' collectives disagree: a rank received {match[1]} bytes where the collective it had "
               f"posted expects {match[2]} (gloo then aborts it: \"Received data size doesn't match expected "
               "size\"); every rank must issue the same collectives, on tensors of the same sizes, in the same order")
    try:
        exc.collective_mismatch = message
    except AttributeError:
        pass
    return message


# Outcomes of one test: pass, todo (the exercise is not written yet), fail (an assertion,
# an exception of the graded code, a deadlock) or error (a harness death: see
# harness_error_of). An error counts against the exercise but is no verdict on its code.
STATUS_ORDER = ("fail", "todo", "pass")
_FIELD = {"pass": "passed", "fail": "failed", "error": "errors", "todo": "todo"}


def _status(row: dict) -> str:
    return "fail" if row["failed"] or row["errors"] else "todo" if row["todo"] else "pass"


def summarize(outcomes: dict[str, str], collected: dict[str, dict] | None = None,
              uncollected: dict[str, list[str]] | None = None) -> list[dict]:
    """Per-exercise rows from {test nodeid: 'pass'|'fail'|'error'|'todo'}.

    `collected` (conftest.py): {nodeid: {"part": part or None, "selected": bool}} for every
    graded test of the session, in collection order, those a filter (-k, -m, --deselect)
    left out included; `uncollected`: {exercise: [test functions]} that the session never
    collected (node ids named on the command line). With them a row says how many of the
    exercise's tests ran ("collected", "not_run", "complete"), and an exercise with parts
    (tests marked @pytest.mark.part) gets one sub-row per part, in "parts"."""
    collected = dict(collected or {})
    for nodeid in outcomes:
        collected.setdefault(nodeid, {"part": None, "selected": True})
    rows: dict[str, dict] = {}
    for nodeid, info in collected.items():
        ex_id = exercise_of_test(nodeid.rsplit("::", 1)[-1])
        if ex_id is None:
            continue
        ex = EXERCISES.get(ex_id)
        row = rows.setdefault(ex_id, {
            "exercise": ex_id, "title": ex.title if ex else "?", "guidelines": ex.guidelines if ex else "",
            "passed": 0, "failed": 0, "errors": 0, "todo": 0, "collected": 0, "selected": 0, "parts": {}})
        row["collected"] += 1
        row["selected"] += bool(info.get("selected", True))
        part = row["parts"].setdefault(info.get("part"), {"part": info.get("part"), "passed": 0, "failed": 0,
                                                          "errors": 0, "todo": 0, "collected": 0})
        part["collected"] += 1
        if nodeid in outcomes:
            row[_FIELD[outcomes[nodeid]]] += 1
            part[_FIELD[outcomes[nodeid]]] += 1
    for ex_id, row in list(rows.items()):
        row["tests"] = row["passed"] + row["failed"] + row["errors"] + row["todo"]
        if not row["tests"]:  # none of its tests ran: no row (verdict's left_out names it)
            del rows[ex_id]
            continue
        row["status"] = _status(row)
        row["not_run"] = row["collected"] - row["tests"]
        row["uncollected"] = list((uncollected or {}).get(ex_id, []))
        row["complete"] = not row["not_run"] and not row["uncollected"]
        parts = row.pop("parts")
        if any(name is not None for name in parts):  # tests without a part: the sub-row "shared"
            row["parts"] = []
            for name, part in parts.items():
                part["part"] = name if name is not None else "shared"
                part["tests"] = part["passed"] + part["failed"] + part["errors"] + part["todo"]
                part["status"] = _status(part) if part["tests"] else "not run"
                row["parts"].append(part)
    return [rows[k] for k in sorted(rows, key=lambda s: tuple(int(p) for p in s.split(".")))]


def left_out(collected: dict[str, dict], outcomes: dict[str, str]) -> list[str]:
    """Exercises that the session collected but none of whose tests ran (a filter left them out)."""
    ran = {exercise_of_test(n.rsplit("::", 1)[-1]) for n in outcomes}
    found = dict.fromkeys(exercise_of_test(n.rsplit("::", 1)[-1]) for n in collected)
    return [ex for ex in found if ex is not None and ex not in ran]


def _coverage_note(row: dict) -> str | None:
    """What a run left out of an exercise: '15 of 125 of its tests selected: the others did not run, so
    this is not its verdict'; None when all its tests ran."""
    if row.get("complete", True):
        return None
    if row["not_run"] and row["tests"] == row["selected"]:
        return (f"{row['tests']} of {row['collected']} of its tests selected (-k, -m, --deselect): the others "
                "did not run, so this is not its verdict")
    if row["not_run"]:
        return (f"{row['tests']} of {row['collected']} of its tests ran (the run stopped before the others): "
                "this is not its verdict")
    return (f"{row['tests']} of its tests ran, and {len(row['uncollected'])} more test functions of it were not "
            "collected (node ids named): this is not its verdict")


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "no graded exercise was run"
    lines = [f"{'exercise':<9}{'status':<8}{'tests':>6}  title", "-" * 60]
    for r in rows:
        status = r["status"].upper()
        lines.append(f"{r['exercise']:<9}{status:<8}{r['passed']:>3}/{r['tests']:<3} {r['title']}")
        width = max([17] + [len(part["part"]) + 1 for part in r.get("parts", [])])  # a long name keeps a space
        for part in r.get("parts", []):
            count = (f"0 of {part['collected']} run" if not part["tests"] else f"{part['passed']}/{part['tests']}"
                     + (f" ({part['tests']} of {part['collected']} run)" if part["tests"] < part["collected"] else ""))
            lines.append(f"{'':11}{part['part']:<{width}}{part['status'].upper():<9}{count}")
        note = _coverage_note(r)
        if note:
            lines.append(f"{'':17}  {note}")
        if r["status"] == "todo":
            lines.append(f"{'':17}  read {r['guidelines']}")
        if r.get("errors"):
            lines.append(f"{'':17}  {r['errors']} harness error(s), no verdict on the code (a rank died without "
                         "reporting, or the world could not start in time): run again")
    return "\n".join(lines)


def counts(rows: list[dict]) -> dict[str, int]:
    """Exercises by status: a TODO (not started) is counted apart from a FAIL."""
    return {status: sum(r["status"] == status for r in rows) for status in ("pass", "fail", "todo")}


def test_file_of(exercise: str) -> str:
    return f"tests/test_phase{exercise.split('.')[0]}.py"


def _rerun(exercise: str) -> str:
    """The command that runs one exercise's tests. `-k 2_1` matches any name containing 2_1, 2.10's
    tests too: where another id contains this one, the -k names the test prefix, `-k test_2_1_`."""
    key = exercise.replace(".", "_")
    if any(other != exercise and key in other.replace(".", "_") for other in EXERCISES):
        key = f"test_{key}_"
    return f"python {test_file_of(exercise)} -k {key}"


def verdict(rows: list[dict], audience: str = "learner", json_path: str | None = None,
            left_out: list[str] = ()) -> str:
    """The run's last line: how many exercises pass, fail, are TODO, and what to do next.

    audience: "learner" (python tests/test_phaseN.py), "instructor" (tests/grade.py) or
    "reference" (pytest on the solutions). `left_out`: exercises of the graded phases none
    of whose tests ran (a filter left them all out): no "all done" while there are some."""
    if not rows:
        return "no graded exercise was run"
    n = counts(rows)
    text = f"{n['pass']}/{len(rows)} exercises pass ({n['fail']} FAIL, {n['todo']} TODO)"
    first_fail = next((r for r in rows if r["status"] == "fail"), None)
    first_todo = next((r for r in rows if r["status"] == "todo"), None)
    partial = [r for r in rows if not r.get("complete", True)]
    if partial:
        text += (f", of the tests run ({', '.join(r['exercise'] for r in partial)}: "
                 f"not all {'its' if len(partial) == 1 else 'their'} tests ran)")
    if audience == "instructor":
        return f"{text}; the table and every test's outcome are in {json_path or 'the JSON report (--grade-json)'}"
    if audience == "reference":
        if first_fail or first_todo:
            return f"{text}; a reference solution fails: that is a bug of the course, not of your code"
        return f"{text}: the reference solutions pass (your own code: python tests/test_phaseN.py)"
    if first_fail:
        ex = first_fail["exercise"]
        return f"{text}; next: fix {ex} (its report is above), then rerun it alone: {_rerun(ex)}"
    if first_todo:
        return f"{text}; next: exercise {first_todo['exercise']}, read {first_todo['guidelines']}"
    if partial:
        ex = partial[0]["exercise"]
        return f"{text}; for {ex}'s verdict run all its tests: {_rerun(ex)}"
    if left_out:
        return (f"{text}; the other exercises ({', '.join(left_out)}) did not run: "
                f"python {test_file_of(left_out[0])}")
    return f"{text}; all done: compare your code with solutions/, then go on to the next phase"


# ------------------------------------------------------------ per-exercise failure reports


@dataclass(frozen=True)
class GradedFunction:
    """A function (or method) of a solution that holds an exercise region."""

    name: str  # "ring_all_reduce", "ShardSampler.__iter__"
    aliases: tuple[str, ...]  # words that name it in a failure message or a test name
    calls: frozenset[str]  # the other graded functions of the exercise that it calls
    hints: tuple[str, ...] = ()  # its regions' hints: "TODO x.y: <hint>" is what its template raises
    owner: str | None = None  # the class of a method ("CollectiveRecorder"), None for a function


@functools.lru_cache(maxsize=None)
def graded_functions(exercise: str) -> tuple[GradedFunction, ...]:
    """The functions of exercise `exercise`'s reference that hold one of its EXERCISE regions,
    in file order; with the names a test may use for them (e.g. the keys of a module-level
    dict of strategies), which of them each calls, and the hints of its regions. A package's
    files (2.4's zero/) are read in name order, as one module."""
    ex = EXERCISES[exercise]
    path = module_file(REPO_ROOT / "solutions" / ex.phase, ex.module)
    if not path.exists():
        return ()
    trees: list[ast.Module] = []
    chosen: dict[str, ast.AST] = {}
    order: dict[str, tuple[int, int]] = {}  # name -> (file, line): file order
    hints: dict[str, list[str]] = {}

    def visit(node: ast.AST, prefix: str, defs: list) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not isinstance(child, ast.ClassDef):
                    defs.append((prefix + child.name, child))
                visit(child, f"{prefix}{child.name}.", defs)
            else:
                visit(child, prefix, defs)

    for index, file in enumerate(module_files(path)):
        source = file.read_text()
        tree = ast.parse(source)
        trees.append(tree)
        markers = {}
        for i, line in enumerate(source.splitlines(), start=1):
            m = re.match(rf"\s*# EXERCISE {re.escape(exercise)}: (?P<hint>.+?)\s*$", line)
            if m:
                markers[i] = m["hint"]
        defs: list[tuple[str, ast.AST]] = []
        visit(tree, "", defs)
        for line, hint in markers.items():
            around = [(n, d) for n, d in defs if d.lineno <= line <= d.end_lineno]
            if around:
                name, node = min(around, key=lambda item: item[1].end_lineno - item[1].lineno)
                chosen.setdefault(name, node)
                order.setdefault(name, (index, node.lineno))
                hints.setdefault(name, []).append(hint)
    short = {name: name.rsplit(".", 1)[-1] for name in chosen}
    shared = {n for n in short.values() if list(short.values()).count(n) > 1}
    # a method is named by its own name too where that is unambiguous and no dunder ("dump" is
    # matched only as a call, "dump(" or "rec.dump(": see _named_in)
    aliases = {name: [name] + ([short[name]] if short[name] != name and not short[name].startswith("__")
                               and short[name] not in shared else [])
               for name in chosen}
    for node in (n for tree in trees for n in tree.body):  # STRATEGIES = {"ring": allreduce_ring, ...}: "ring"
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values):
                if isinstance(key, ast.Constant) and isinstance(key.value, str) and isinstance(value, ast.Name) \
                        and value.id in chosen:
                    aliases[value.id].append(key.value)
    result = []
    for name, node in sorted(chosen.items(), key=lambda item: order[item[0]]):
        owner = name.rsplit(".", 1)[0] if "." in name else None
        called = set()
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            if isinstance(call.func, ast.Name):  # helper(...): a top-level function
                called.add(call.func.id)
            elif isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name) \
                    and call.func.value.id == "self" and owner:  # self.helper(...): a method of its class
                called.add(f"{owner}.{call.func.attr}")
        calls = frozenset(other for other in chosen if other != name and other in called)
        result.append(GradedFunction(name, tuple(dict.fromkeys(aliases[name])), calls, tuple(hints[name]), owner))
    return tuple(result)


def _levels(functions: tuple[GradedFunction, ...]) -> dict[str, int]:
    """0 for a function that calls no other graded function, else one more than its deepest callee:
    a failure of a callee explains its callers' failures, so it is the more specific one."""
    by_name, levels = {f.name: f for f in functions}, {}

    def level(name: str, seen: frozenset) -> int:
        if name not in levels:
            callees = [c for c in by_name[name].calls if c not in seen]
            levels[name] = 1 + max((level(c, seen | {name}) for c in callees), default=-1)
        return levels[name]

    for f in functions:
        level(f.name, frozenset())
    return levels


def _reachable(names, functions: tuple[GradedFunction, ...]) -> tuple[str, ...]:
    """`names` and every graded function they call, directly or not, in file order."""
    by_name = {f.name: f for f in functions}
    found, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in found and name in by_name:
            found.add(name)
            todo += by_name[name].calls
    return tuple(f.name for f in functions if f.name in found)


def _named_in(text: str, functions: tuple[GradedFunction, ...]) -> str | None:
    """The graded function that `text` names first. A function's name, anywhere ("ring_all_reduce");
    a plain word ("evaluate", a method's own name "dump") only as a call ("evaluate(", "rec.dump(");
    a method's own name not where the text names another class that holds graded methods."""
    best = None
    classes = {f.owner for f in functions if f.owner and re.search(rf"(?<![\w.]){re.escape(f.owner)}(?!\w)", text)}
    for f in functions:
        for alias in f.aliases:
            method_word = f.owner is not None and alias != f.name
            if method_word and classes and f.owner not in classes:
                continue
            # "ring_all_reduce" anywhere; a plain word ("evaluate") only as a call, "evaluate(..."
            tail = r"(?!\w)" if "_" in alias.strip("_") or "." in alias else r"\("
            head = r"(?<!\w)" if method_word else r"(?<![\w.])"
            m = re.search(rf"{head}{re.escape(alias)}{tail}", text)
            if m and (best is None or m.start() < best[0]):
                best = (m.start(), f.name)
    return best[1] if best else None


def _class_named_in(text: str, functions: tuple[GradedFunction, ...]) -> str | None:
    """The class holding graded methods that `text` names first ("ZeroStage3, rank 0: ...")."""
    best = None
    for owner in dict.fromkeys(f.owner for f in functions if f.owner):
        m = re.search(rf"(?<![\w.]){re.escape(owner)}(?!\w)", text)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), owner)
    return best[1] if best else None


def _named_by_test(test: str, functions: tuple[GradedFunction, ...]) -> str | None:
    """The graded function that a test's name is about: test_1_4_sync_gradients_... -> sync_gradients."""
    topic = re.sub(r"^test_\d+_\d+_", "", test.split("[")[0])
    for f in functions:
        for alias in f.aliases:
            if re.search(rf"(?:^|_){re.escape(alias.rsplit('.', 1)[-1])}(?:_|$)", topic):
                return f.name
    return None


def _todo_function(todo: str | None, test: str, functions: tuple[GradedFunction, ...]) -> str | None:
    """The graded function whose template raised `todo` ("TODO 4.6: <its region's hint>")."""
    hint = (todo or "").split(": ", 1)[-1]
    return next((f.name for f in functions if hint in f.hints), None) or _named_by_test(test, functions)


def _named_first(text: str, functions: tuple[GradedFunction, ...]) -> str | None:
    """The graded function a line opens with ("recursive_doubling(float32, ...) on rank 2: ...",
    "_first_divergence(group [0, 1], ...) returns ..."): the test says whose behaviour failed."""
    named = _named_in(text, functions)
    if named is None:
        return None
    head = text.lstrip()
    aliases = next(f.aliases for f in functions if f.name == named)
    return named if any(re.match(rf"(?:[\w.]*\.)?{re.escape(alias)}(?!\w)", head) for alias in aliases) else None


def _suspects(names, functions: tuple[GradedFunction, ...], cleared: frozenset = frozenset()) -> tuple[str, ...]:
    """Where a failure seen through `names` may be: them, the graded functions they call (directly or
    not), and for a method the other graded methods of its class (their state is its state); less the
    functions `cleared` (a test of their own passed), never `names` themselves."""
    owners = {f.owner for f in functions if f.name in names and f.owner}
    found = set(_reachable(list(names) + [f.name for f in functions if f.owner in owners], functions))
    return tuple(f.name for f in functions if f.name in found and (f.name in names or f.name not in cleared))


def blame(line: str, record: dict, functions: tuple[GradedFunction, ...],
          cleared: frozenset = frozenset()) -> tuple[str | None, tuple[str, ...]]:
    """(the graded function a failure line is about, or None; the graded functions the bug may be in).

    The evidence, strongest first:
      * the line opens with a function's name ("recursive_doubling(...) on rank 2: ..."): the
        test says whose behaviour failed, that function alone;
      * the line names a function elsewhere ("rank 0: ... dump() must return a copy"), or an
        exception was raised inside one (`record["where"]`): that one, or a function it calls,
        or (a method) another method of its class, whose state it reads;
      * the line names a class ("ZeroStage3, rank 0: ..."): any of its graded methods;
      * a deadlock whose ranks wait inside different functions of the graded code
        (`record["waiting"]`): any of them (or what they call), none named;
      * the failure's header, or the test's name, names a function: it, or what it calls, or
        its class's other methods; then the header naming a class.
    A deadlock's "rank N: file:line in f" lines say where a rank waits, not whose bug it is: they
    name nothing (a rank waits in a correct function for one that never sends). Functions
    `cleared` (a test named for them passed) are no suspects unless named. Nothing names any:
    (None, ()), the report cannot tell."""
    header = record.get("header") or ""
    if record.get("waiting") is not None and _WAIT_LINE.match(line):
        line = ""  # where a rank waits: the evidence is record["where"] / record["waiting"] below
    first = _named_first(line, functions)
    if first:
        return first, (first,)

    def by_class(text: str):
        owner = _class_named_in(text, functions)
        if owner is None:
            return None
        methods = [f.name for f in functions if f.owner == owner]
        return (methods[0] if len(methods) == 1 else None), _suspects(methods, functions, cleared)

    for fn in (_named_in(line, functions), record.get("where")):
        if fn:
            return fn, _suspects([fn], functions, cleared)
    if len(record.get("waiting") or ()) > 1:  # ranks stuck in different functions: no telling which
        return None, _suspects(record["waiting"], functions, cleared)
    found = by_class(line)
    if found:
        return found
    for fn in (_named_in(header, functions), _named_by_test(record["test"], functions)):
        if fn:
            return fn, _suspects([fn], functions, cleared)
    return by_class(header) or (None, ())


def _function_status(f: GradedFunction, ranked: list[dict], todo: set[str], complete: bool,
                     certain: set[str]) -> str:
    """One function's line of the report (exercise_report)."""
    mine = [g for g in ranked if g["function"] == f.name]
    sure = [g for g in mine if g["suspects"] == (f.name,)]
    if sure:
        status = f"WRONG: {sure[0]['line']}"
        callees = sorted(c for c in f.calls if c in certain)
        if callees:
            status += f" (it calls {', '.join(callees)}, which fails too: fix that first)"
        return status
    if mine:
        others = [s for s in mine[0]["suspects"] if s != f.name]
        if any(s in certain for s in others):
            why = f"{'it fails' if len(others) == 1 else 'one of them fails'} too: fix that first"
        else:
            why = "what it calls, or its class's methods whose state it reads: no test tells them apart"
        return f"WRONG, here or in {', '.join(others)} ({why}): {mine[0]['line']}"
    if f.name in todo:
        return "TODO"
    failing_callees = sorted(c for c in f.calls if c in certain)
    if failing_callees:
        return f"no failure of its own; it calls {', '.join(failing_callees)}, which fails: fix that first"
    through = next((g for g in ranked if f.name in g["suspects"]), None)
    if through is not None:
        if through["function"]:
            return f"cannot tell: the failure of {through['function']} (above) may come from here"
        if through.get("waiting"):
            waiting = through["waiting"]
            if f.name in waiting:
                others = ", ".join(w for w in waiting if w != f.name)
                return f"cannot tell: a deadlock (below) has ranks waiting here and in {others}"
            return f"cannot tell: a deadlock (below) has ranks waiting in {', '.join(waiting)}, which may wait on this"
        owner = through.get("owner") or "its exercise"
        return f"cannot tell: a failure of {owner} (below) may be here; no test names which function"
    if any(not g["suspects"] for g in ranked):
        return "cannot tell: the failures below name no function (the bug may be here)"
    return "ok" if complete else "no failure in the tests run (not all its tests ran)"


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line \d+,? in (?P<func>[\w<>]+)')
_WAIT_LINE = re.compile(r"\s*rank \d+: ")  # a deadlock's "rank N: file:line in f (waiting inside ...)"


def _in_graded_file(file: str, graded: Path | None, module: str | None) -> bool:
    """A frame of the graded code: its file is the graded file (`graded`, when the caller knows it; a
    package's __init__.py: any file of its folder), else (not known) a file of the graded module's
    name, which the reference's has too (`module`: "sampler.py", or "zero/" for a package)."""
    if graded is not None:
        try:
            path = Path(file).resolve()
            return path == graded or (graded.name == "__init__.py" and path.parent == graded.parent)
        except (OSError, RuntimeError, ValueError):
            return False
    if module is not None and module.endswith("/"):
        return Path(file).parent.name == module[:-1]
    return Path(file).name == module


def _waiting_in(dump: str, names: dict[str, str], graded: Path | None, module: str | None) -> str | None:
    """The graded function a deadlocked rank waits in: the innermost frame of the graded code in its
    main thread's faulthandler dump (most recent call first); None for a rank that finished, or waits
    outside the graded code (in the reference, in the test): no evidence on the graded code."""
    threads = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump or "")
    main = next((t for t in threads if "in _rank_main" in t), dump or "")
    for m in _FRAME.finditer(main):
        if m["func"] in names and _in_graded_file(m["file"], graded, module):
            return names[m["func"]]
    return None


def failure_record(test: str, outcome: str, exc: BaseException | None, exercise: str,
                   graded: str | Path | None = None) -> dict:
    """What the per-exercise report needs of one test's failure: its problem lines (all of
    them, not the first 12 an assertion shows), the header over them (compare.assert_no_problems),
    and the graded function a traceback was in, if any (`where`).

    A deadlock (an exception with per-rank `stacks`): `waiting` lists, in rank order, the graded
    functions its ranks wait in (each rank's innermost frame of the graded code); a rank that
    finished, or moved on into the reference or the test's own code, is no evidence. `where` is
    that function when they agree; when they disagree it is None and the report cannot tell.
    `graded`: the file under test (tests/conftest.py passes it), so that the reference's frames,
    whose file has the same name, are not taken for the graded code's."""
    lines: list[str] = []
    texts = [str(exc)] if exc is not None else []
    header = getattr(exc, "header", None) if exc is not None else None
    if exc is not None and getattr(exc, "problems", None):  # compare.assert_no_problems
        lines = list(exc.problems)
    elif exc is not None and getattr(exc, "failures", None):  # a rank raised
        cause = min(exc.failures.values(), key=lambda f: f.when)
        lines = [f"rank {cause.rank} raised {cause.exc_type}: {cause.message.splitlines()[0] if cause.message else ''}"]
        texts.append(cause.traceback)
    elif exc is not None:
        text = str(exc).strip()
        kept = []
        for line in text.splitlines():
            if line.startswith("assert ") or line.startswith("+"):
                break  # pytest's rewriting of the assert statement: not the message
            kept.append(line.strip())
        kept = [line for line in kept if line and not re.match(r"^\.\.\. and \d+ more$", line)]
        if getattr(exc, "stacks", None) and kept:  # a deadlock (WorldTimeout): where each rank waits, not its stack
            waits = []
            for line in kept[1:]:
                if line.startswith("--- stack"):
                    break
                if re.match(r"rank \d+: ", line):
                    waits.append(line)
            kept = kept[:1] + waits
        if len(kept) > 1 and kept[0].endswith(":"):
            header, kept = kept[0], kept[1:]  # a header over a list of problems
        prefix = "" if isinstance(exc, AssertionError) else f"{type(exc).__name__}: "
        lines = [prefix + (kept[0] if kept else type(exc).__name__)] + kept[1:] if prefix else kept or [text]
    module = None
    if exercise in EXERCISES:
        ex = EXERCISES[exercise]
        package = module_file(REPO_ROOT / "solutions" / ex.phase, ex.module).name == "__init__.py"
        module = f"{ex.module}/" if package else f"{ex.module}.py"
    names = {f.name.rsplit(".", 1)[-1]: f.name for f in graded_functions(exercise)} if exercise in EXERCISES else {}
    graded_path = Path(graded).resolve() if graded else None
    stacks = getattr(exc, "stacks", None) if exc is not None else None
    where, waiting = None, None
    if stacks is not None:  # a deadlock: where its ranks wait (its message holds the same dumps: not read)
        waiting = []
        for rank in sorted(stacks):
            fn = _waiting_in(str(stacks[rank] or ""), names, graded_path, module)
            if fn and fn not in waiting:
                waiting.append(fn)
        where = waiting[0] if len(waiting) == 1 else None
    else:
        for text in texts:  # tracebacks, outermost frame first
            for m in _FRAME.finditer(text or ""):
                if m["func"] in names and _in_graded_file(m["file"], graded_path, module):
                    where = names[m["func"]]  # the innermost frame in the graded module wins
    record = {"test": test, "outcome": outcome, "lines": lines, "where": where, "header": header}
    if waiting is not None:
        record["waiting"] = tuple(waiting)
    return record


def _shape(line: str) -> str:
    """A message with its numbers and parenthesised details blanked: the same mistake seen
    on another rank, world size, dtype or shape has the same shape."""
    previous = None
    while previous != line:
        previous, line = line, re.sub(r"\([^()]*\)|\[[^\[\]]*\]", "<>", line)
    return re.sub(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", "#", line)


def _tests_text(tests: list[str]) -> str:
    """['t[2]', 't[3]', 'u'] -> 't[2, 3], u'."""
    grouped: dict[str, list[str]] = {}
    for test in tests:
        base, _, param = test.partition("[")
        grouped.setdefault(base, []).append(param.rstrip("]"))
    return ", ".join(base + (f"[{', '.join(p for p in params if p)}]" if any(params) else "")
                     for base, params in grouped.items())


def exercise_report(row: dict, records: list[dict], limit: int = 8) -> list[str]:
    """A failing exercise's report: one line per graded function, then each kind of failure
    message once (the same message on other world sizes, ranks, dtypes or shapes collapsed into
    it), the most specific first: a function's failure before those of the functions that call
    it, so the cause comes before its echoes.

    A function's line says what the failures say of it (`blame`): WRONG (a failure is its,
    or is its or a function's it calls, which no test checks apart), TODO (its template
    raised), "cannot tell" (a failure that may be its: it is called by a failing function, or
    the failure names only its class, or no function at all), ok (no failure can be its)."""
    exercise = row["exercise"]
    functions = graded_functions(exercise) if exercise in EXERCISES else ()
    levels = _levels(functions)
    groups: dict[tuple, dict] = {}
    todo: set[str] = set()
    order = 0
    # a function a passing test is named for, and no failing one: checked on its own, no suspect
    named = {(record["outcome"] == "pass", _named_by_test(record["test"], functions)) for record in records}
    cleared = frozenset(fn for ok, fn in named if ok and fn and (False, fn) not in named)
    by_test = {record["test"]: record for record in records}
    for record in records:
        skipped = re.match(r"not run: (\S+) deadlocked", (record["lines"] or [""])[0])
        if skipped and skipped[1] in by_test:  # conftest.py's short cut: the deadlocked test's blame is its
            record = {**record, "where": by_test[skipped[1]]["where"], "header": by_test[skipped[1]].get("header"),
                      "waiting": by_test[skipped[1]].get("waiting")}
        if record["outcome"] == "todo":
            todo.add(_todo_function(record.get("todo"), record["test"], functions) or "")
            continue
        if record["outcome"] not in ("fail", "error"):
            continue
        for line in record["lines"] or [f"{record['test']} failed"]:
            fn, suspects = blame(line, record, functions, cleared)
            owner = next((f.owner for f in functions if f.name in suspects and f.owner), None) if not fn else None
            waiting = tuple(record.get("waiting") or ()) if not fn and len(record.get("waiting") or ()) > 1 else ()
            group = groups.setdefault((fn, suspects, _shape(line)), {
                "function": fn, "suspects": suspects, "owner": owner, "line": line, "count": 0, "tests": [],
                "order": order, "waiting": waiting})
            order += 1
            group["count"] += 1
            if record["test"] not in group["tests"]:
                group["tests"].append(record["test"])
    ranked = sorted(groups.values(), key=lambda g: (levels.get(g["function"], len(functions)) if g["function"]
                                                     else len(functions) + (1 if g["suspects"] else 2), g["order"]))
    certain = {g["function"] for g in ranked if g["function"] and g["suspects"] == (g["function"],)}
    complete = row.get("complete", True)
    lines = [f"{exercise} {row['title']}: {row['status'].upper()}, {row['passed']} of {row['tests']} tests pass"
             + ("" if complete else f" ({row['tests']} of {row.get('collected', row['tests'])} of its tests ran)")]
    width = max((len(f.name) for f in functions), default=0)
    for f in functions:
        lines.append(f"  {f.name:<{width}}  {_function_status(f, ranked, todo, complete, certain)}")
    if ranked:
        lines.append("  failures, most specific first (one line per kind of message; "
                     "other world sizes, ranks and cases collapsed into it):")
    for g in ranked[:limit]:
        times = f"{g['count']}x in " if g["count"] > 1 else "in "
        lines.append(f"  - {g['line']}  [{times}{_tests_text(g['tests'])}]")
    if len(ranked) > limit:
        lines.append(f"  ... and {len(ranked) - limit} more kinds of message (every failure is above, test by test)")
    return lines


def pristine_checks_required() -> bool:
    """Whether the checks that the repository itself is pristine (templates regenerated from
    the solutions, benchmarks showing the untouched templates' TODO) must run even where a
    template holds a learner's code: in CI (CI=true, as CI services set it) or with
    COURSE_REQUIRE_PRISTINE=1. Elsewhere they skip on a learner's checkout."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes")
               for name in ("CI", "COURSE_REQUIRE_PRISTINE"))


def write_json(path: Path, rows: list[dict], outcomes: dict[str, str], graded: str, *,
               durations: dict[str, float] | None = None, controls: dict[str, str] | None = None) -> None:
    """The report: what was graded, the exercise rows, exercises counted by status, every
    test's outcome {nodeid: pass|fail|todo|error} and seconds {nodeid: seconds}; with
    --controls also {nodeid: the negative control the test ran against}."""
    report = {"graded": graded, "exercises": rows, "counts": counts(rows), "tests": outcomes,
              "durations": durations or {}}
    if controls:
        report["controls"] = controls
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


# What grading imports besides the standard library (pyproject.toml: the dependencies and the dev extra).
REQUIRED = ("pytest", "hypothesis", "torch", "torchvision", "numpy", "tqdm")


def missing_dependencies(names=REQUIRED) -> list[str]:
    """The modules of `names` that this Python cannot import (found without importing them)."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a broken install, or hidden (None in sys.modules)
            found = False
        if not found:
            missing.append(name)
    return missing


def install_command() -> str:
    """The one command that installs what grading needs, into the Python that is running."""
    return f'{sys.executable} -m pip install -e "{REPO_ROOT}[dev]"'


def require_dependencies() -> None:
    """Before grading (tests/test_phaseN.py as a script, tests/grade.py): if a dependency is
    missing, one line on stderr with the command that installs it, and exit 2; no traceback."""
    missing = missing_dependencies()
    if not missing:
        return
    cpu = (" (on a machine without an NVIDIA GPU add --extra-index-url https://download.pytorch.org/whl/cpu: "
           "README.md, Quick start)") if {"torch", "torchvision"} & set(missing) else ""
    sys.stderr.write(f"cannot grade: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed in "
                     f"this Python; install the course's dependencies with: {install_command()}{cpu}\n")
    raise SystemExit(2)


def learner_main(test_file: str) -> int:
    """`python tests/test_phaseN.py [pytest args]`: grade the learner's templates. The run
    ends with the exercise table and a verdict line (printed by conftest.py after pytest's
    own summary; -rN drops pytest's list of failed tests, which the table replaces)."""
    require_dependencies()
    import pytest

    args = [test_file, "--impl", "learner", "--course-runner=learner", "--tb=short", "-q", "-rN",
            "-p", "no:cacheprovider", *sys.argv[1:]]
    return int(pytest.main(args))
