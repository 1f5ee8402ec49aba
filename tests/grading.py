"""Which code is graded, and how its results are reported.

Three kinds of implementation can stand behind an exercise:

  solution  solutions/<phase>/<module>.py           (the reference; `pytest` grades this)
  learner   <learner root>/<phase>/<module>.py      (templates you fill in)
  file      any .py file, e.g. a negative control   (a deliberately buggy variant)

A test asks for one exercise (`grade("1.2")`) and gets a picklable `ModuleRef` that
ranks in other processes can load too. Loading a learner's module rebinds whatever it
imported from *other* exercises' modules (of its own phase or of an earlier one) to the
reference, and gives it an `__import__` that does the same for the imports its functions
run when called, so one unfinished exercise never fails the tests of another.
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
        if self.kind == "file":
            return Path(self.location)
        base = Path(self.location) / ("solutions" if self.kind == "solution" else "") / ex.phase
        return base / f"{ex.module}.py"

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


_PHASE_MODULE = re.compile(r"^(?:_learner_)?(?P<phase>phase\d+_\w+)(?:\.(?P<module>\w+))?$")


def _use_reference_for_other_exercises(module: ModuleType) -> None:
    """Rebind what `module` imported from any learner phase package to the reference.

    A learner's phase-2 file may import their own phase-1 code (`from
    phase1_data_parallel.trainer import sync_gradients`) or a sibling exercise (`from
    .zero import ...`, loaded as `_learner_phase2_advanced.zero`): both become
    `solutions.<phase>.<module>`, so grading one exercise never runs another's code."""
    own = module.__name__
    for attr, value in list(vars(module).items()):
        if isinstance(value, ModuleType):
            origin = value.__name__
        elif isinstance(getattr(value, "__name__", None), str):  # functions and classes, not instances
            origin = getattr(value, "__module__", None)
        else:
            continue
        match = _PHASE_MODULE.match(origin) if isinstance(origin, str) and origin != own else None
        if match is None:
            continue
        reference_name = f"solutions.{match['phase']}" + (f".{match['module']}" if match["module"] else "")
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
        phase, module = match["phase"], match["module"]
        if module is None:  # from <phase package> import a, b: each must be a module of the reference
            if not fromlist or (own_key and own_key[0] == phase and own_key[1] in fromlist):
                return None
            package = _reference_module(f"solutions.{phase}")
            if package is None or not all(hasattr(package, item) or _reference_module(f"solutions.{phase}.{item}")
                                          for item in fromlist):
                return None  # a module of the learner's own: theirs
            return package
        if (phase, module) == own_key:  # the graded module itself, not a second copy of its file
            return sys.modules.get(own) if fromlist else None
        reference = _reference_module(f"solutions.{phase}.{module}")
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
    name = f"_control_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


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


def summarize(outcomes: dict[str, str]) -> list[dict]:
    """Per-exercise rows from {test nodeid: 'pass'|'fail'|'error'|'todo'}."""
    rows: dict[str, dict] = {}
    for nodeid, outcome in outcomes.items():
        ex_id = exercise_of_test(nodeid.rsplit("::", 1)[-1])
        if ex_id is None:
            continue
        ex = EXERCISES.get(ex_id)
        row = rows.setdefault(ex_id, {
            "exercise": ex_id, "title": ex.title if ex else "?", "guidelines": ex.guidelines if ex else "",
            "passed": 0, "failed": 0, "errors": 0, "todo": 0,
        })
        row[{"pass": "passed", "fail": "failed", "error": "errors", "todo": "todo"}[outcome]] += 1
    for row in rows.values():
        row["tests"] = row["passed"] + row["failed"] + row["errors"] + row["todo"]
        row["status"] = "fail" if row["failed"] or row["errors"] else "todo" if row["todo"] else "pass"
    return [rows[k] for k in sorted(rows, key=lambda s: tuple(int(p) for p in s.split(".")))]


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "no graded exercise was run"
    lines = [f"{'exercise':<9}{'status':<8}{'tests':>6}  title", "-" * 60]
    for r in rows:
        status = r["status"].upper()
        lines.append(f"{r['exercise']:<9}{status:<8}{r['passed']:>3}/{r['tests']:<3} {r['title']}")
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


def verdict(rows: list[dict], audience: str = "learner", json_path: str | None = None) -> str:
    """The run's last line: how many exercises pass, fail, are TODO, and what to do next.

    audience: "learner" (python tests/test_phaseN.py), "instructor" (tests/grade.py) or
    "reference" (pytest on the solutions)."""
    if not rows:
        return "no graded exercise was run"
    n = counts(rows)
    text = f"{n['pass']}/{len(rows)} exercises pass ({n['fail']} FAIL, {n['todo']} TODO)"
    first_fail = next((r for r in rows if r["status"] == "fail"), None)
    first_todo = next((r for r in rows if r["status"] == "todo"), None)
    if audience == "instructor":
        return f"{text}; the table and every test's outcome are in {json_path or 'the JSON report (--grade-json)'}"
    if audience == "reference":
        if first_fail or first_todo:
            return f"{text}; a reference solution fails: that is a bug of the course, not of your code"
        return f"{text}: the reference solutions pass (your own code: python tests/test_phaseN.py)"
    if first_fail:
        ex = first_fail["exercise"]
        return (f"{text}; next: fix {ex} (its report is above), then rerun it alone: "
                f"python {test_file_of(ex)} -k {ex.replace('.', '_')}")
    if first_todo:
        return f"{text}; next: exercise {first_todo['exercise']}, read {first_todo['guidelines']}"
    return f"{text}; all done: compare your code with solutions/, then go on to the next phase"


# ------------------------------------------------------------ per-exercise failure reports


@dataclass(frozen=True)
class GradedFunction:
    """A function (or method) of a solution that holds an exercise region."""

    name: str  # "ring_all_reduce", "ShardSampler.__iter__"
    aliases: tuple[str, ...]  # words that name it in a failure message or a test name
    calls: frozenset[str]  # the other graded functions of the exercise that it calls


@functools.lru_cache(maxsize=None)
def graded_functions(exercise: str) -> tuple[GradedFunction, ...]:
    """The functions of exercise `exercise`'s reference that hold one of its EXERCISE regions,
    in file order; with the names a test may use for them (e.g. the keys of a module-level
    dict of strategies) and which of them each calls."""
    ex = EXERCISES[exercise]
    path = REPO_ROOT / "solutions" / ex.phase / f"{ex.module}.py"
    if not path.exists():
        return ()
    source = path.read_text()
    tree = ast.parse(source)
    markers = [i for i, line in enumerate(source.splitlines(), start=1)
               if re.match(rf"\s*# EXERCISE {re.escape(exercise)}:", line)]
    defs: list[tuple[str, ast.AST]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not isinstance(child, ast.ClassDef):
                    defs.append((prefix + child.name, child))
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    chosen: dict[str, ast.AST] = {}
    for line in markers:
        around = [(n, d) for n, d in defs if d.lineno <= line <= d.end_lineno]
        if around:
            name, node = min(around, key=lambda item: item[1].end_lineno - item[1].lineno)
            chosen.setdefault(name, node)
    short = {name: name.rsplit(".", 1)[-1] for name in chosen}
    shared = {n for n in short.values() if list(short.values()).count(n) > 1}
    # a method is named by its own name too where that is unambiguous and no plain word ("step")
    aliases = {name: [name] + ([short[name]] if short[name] != name and not short[name].startswith("__")
                               and "_" in short[name].strip("_") and short[name] not in shared else [])
               + ([name.rsplit(".", 1)[0]] if short[name] == "__init__" and "." in name else [])
               for name in chosen}
    for node in tree.body:  # STRATEGIES = {"ring": allreduce_ring, ...}: "ring" names allreduce_ring
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values):
                if isinstance(key, ast.Constant) and isinstance(key.value, str) and isinstance(value, ast.Name) \
                        and value.id in chosen:
                    aliases[value.id].append(key.value)
    result = []
    for name, node in sorted(chosen.items(), key=lambda item: item[1].lineno):
        owner = name.rsplit(".", 1)[0] if "." in name else None
        called = set()
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            if isinstance(call.func, ast.Name):  # helper(...): a top-level function
                called.add(call.func.id)
            elif isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name) \
                    and call.func.value.id == "self" and owner:  # self.helper(...): a method of its class
                called.add(f"{owner}.{call.func.attr}")
        calls = frozenset(other for other in chosen if other != name and other in called)
        result.append(GradedFunction(name, tuple(dict.fromkeys(aliases[name])), calls))
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


def _named_in(text: str, functions: tuple[GradedFunction, ...]) -> str | None:
    """The graded function that `text` names first."""
    best = None
    for f in functions:
        for alias in f.aliases:
            # "ring_all_reduce" anywhere; a plain word ("evaluate") only as a call, "evaluate(..."
            tail = r"(?!\w)" if "_" in alias.strip("_") or "." in alias else r"\("
            m = re.search(rf"(?<![\w.]){re.escape(alias)}{tail}", text)
            if m and (best is None or m.start() < best[0]):
                best = (m.start(), f.name)
    return best[1] if best else None


def _named_by_test(test: str, functions: tuple[GradedFunction, ...]) -> str | None:
    """The graded function that a test's name is about: test_1_4_sync_gradients_... -> sync_gradients."""
    topic = re.sub(r"^test_\d+_\d+_", "", test.split("[")[0])
    for f in functions:
        for alias in f.aliases:
            if re.search(rf"(?:^|_){re.escape(alias.rsplit('.', 1)[-1])}(?:_|$)", topic):
                return f.name
    return None


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line \d+,? in (?P<func>[\w<>]+)')


def failure_record(test: str, outcome: str, exc: BaseException | None, exercise: str) -> dict:
    """What the per-exercise report needs of one test's failure: its problem lines (all of
    them, not the first 12 an assertion shows) and the graded function a traceback or a
    deadlocked rank's stack was in, if any."""
    lines: list[str] = []
    texts = [str(exc)] if exc is not None else []
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
        if len(kept) > 1 and kept[0].endswith(":"):
            kept = kept[1:]  # a header over a list of problems
        prefix = "" if isinstance(exc, AssertionError) else f"{type(exc).__name__}: "
        lines = [prefix + (kept[0] if kept else type(exc).__name__)] + kept[1:] if prefix else kept or [text]
        texts += [str(s) for s in getattr(exc, "stacks", {}).values()]
    module = f"{EXERCISES[exercise].module}.py" if exercise in EXERCISES else None
    names = {f.name.rsplit(".", 1)[-1]: f.name for f in graded_functions(exercise)} if exercise in EXERCISES else {}
    where = None
    for text in texts:
        for m in _FRAME.finditer(text or ""):
            if Path(m["file"]).name == module and m["func"] in names:
                where = names[m["func"]]  # the innermost frame in the graded module wins
    return {"test": test, "outcome": outcome, "lines": lines, "where": where}


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
    """A failing exercise's report: one line per graded function (ok, TODO, or what is wrong),
    then each kind of failure message once (the same message on other world sizes, ranks,
    dtypes or shapes collapsed into it), the most specific first: a function's failure
    before those of the functions that call it, so the cause comes before its echoes."""
    exercise = row["exercise"]
    functions = graded_functions(exercise) if exercise in EXERCISES else ()
    levels = _levels(functions)
    groups: dict[tuple, dict] = {}
    todo: set[str] = set()
    order = 0
    for record in records:
        if record["outcome"] == "todo":
            todo.add(_named_by_test(record["test"], functions) or "")
            continue
        if record["outcome"] not in ("fail", "error"):
            continue
        for line in record["lines"] or [f"{record['test']} failed"]:
            fn = _named_in(line, functions) or record["where"] or _named_by_test(record["test"], functions)
            group = groups.setdefault((fn, _shape(line)), {"function": fn, "line": line, "count": 0, "tests": [],
                                                          "order": order})
            order += 1
            group["count"] += 1
            if record["test"] not in group["tests"]:
                group["tests"].append(record["test"])
    ranked = sorted(groups.values(), key=lambda g: (levels.get(g["function"], len(functions)) if g["function"]
                                                     else len(functions) + 1, g["order"]))
    failing = {g["function"] for g in ranked if g["function"]}
    unnamed = any(g["function"] is None for g in ranked)
    lines = [f"{exercise} {row['title']}: {row['status'].upper()}, {row['passed']} of {row['tests']} tests pass"]
    width = max((len(f.name) for f in functions), default=0)
    for f in functions:
        mine = [g for g in ranked if g["function"] == f.name]
        if mine:
            status = f"WRONG: {mine[0]['line']}"
            callees = sorted(c for c in f.calls if c in failing)
            if callees:
                status += f" (it calls {', '.join(callees)}, which fails too: fix that first)"
        elif f.name in todo:
            status = "TODO"
        elif unnamed:
            status = "no failure names it (see the failures below that name no function)"
        else:
            status = "ok"
        lines.append(f"  {f.name:<{width}}  {status}")
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


def learner_main(test_file: str) -> int:
    """`python tests/test_phaseN.py [pytest args]`: grade the learner's templates. The run
    ends with the exercise table and a verdict line (printed by conftest.py after pytest's
    own summary; -rN drops pytest's list of failed tests, which the table replaces)."""
    import pytest

    args = [test_file, "--impl", "learner", "--course-runner=learner", "--tb=short", "-q", "-rN",
            "-p", "no:cacheprovider", *sys.argv[1:]]
    return int(pytest.main(args))
