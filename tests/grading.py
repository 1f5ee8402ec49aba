"""Which code is graded, and how its results are reported.

Three kinds of implementation can stand behind an exercise:

  solution  solutions/<phase>/<module>.py           (the reference; `pytest` grades this)
  learner   <learner root>/<phase>/<module>.py      (templates you fill in)
  file      any .py file, e.g. a negative control   (a deliberately buggy variant)

A test asks for one exercise (`grade("1.2")`) and gets a picklable `ModuleRef` that
ranks in other processes can load too. Loading a learner's module rebinds whatever it
imported from *other* exercises' modules (of its own phase or of an earlier one) to the
reference, so one unfinished exercise never fails the tests of another.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
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
            module = importlib.import_module(f"{package}.{ex.module}")
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
    done = sum(r["status"] == "pass" for r in rows)
    lines.append(f"{done}/{len(rows)} exercises pass")
    return "\n".join(lines)


def write_json(path: Path, rows: list[dict], outcomes: dict[str, str], graded: str, *,
               durations: dict[str, float] | None = None, controls: dict[str, str] | None = None) -> None:
    """The report: exercise rows, {nodeid: outcome}, {nodeid: seconds}, and with --controls
    {nodeid: the negative control the test ran against}."""
    report = {"graded": graded, "exercises": rows, "tests": outcomes,
              "durations": durations or {}, "controls": controls or {}}
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def learner_main(test_file: str) -> int:
    """`python tests/test_phaseN.py [pytest args]`: grade the learner's templates."""
    import pytest

    args = [test_file, "--impl", "learner", "--tb=short", "-q", "-p", "no:cacheprovider", *sys.argv[1:]]
    return int(pytest.main(args))
