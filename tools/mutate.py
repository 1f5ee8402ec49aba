"""Mutation testing: how many small bugs in an exercise do its graded tests catch?

    python tools/mutate.py 1.1                    # every mutant of exercise 1.1 (one pytest session)
    python tools/mutate.py 1.3 2.1 --max 20       # a deterministic sample of 20 per exercise (--seed)
    python tools/mutate.py 1.1 --list [--diff]    # the mutants only, nothing run
    python tools/mutate.py 2.6 --ids ID [ID...]   # just these mutants (e.g. the survivors of a run)
    python tools/mutate.py 2.6 --renumber --list  # after an edit moved lines: fix the list's ids
    python tools/mutate.py --ci                   # CI: a fixed sample of phases 1-4 (see ci_sample_size)
    python tools/mutate.py 1.1 --json out.json    # also every mutant's verdict as JSON
    python tools/mutate.py --variants DIR         # whole-file variants written by hand (below)

A mutant is the reference solution file of an exercise with ONE small change inside one of
its `# EXERCISE x.y` regions (never outside them), made on Python's `ast`:

    cmp        <  <=  >  >=  ==  !=  is  in   -> its neighbour (<= for <, != for ==, ...)
    arith      + - * / // % ** and their `x op= y` forms -> another (- for +, / for *, ...)
    boolop     and <-> or
    const      an integer constant +1 and -1
    index      a[i] -> a[i + 1], a[i - 1]; a[lo:hi] -> lo/hi +1 and -1, a missing lo -> 1, hi -> -1
    drop       a statement replaced by `pass`
    drop_call  x.clone() / x.detach() / x.contiguous() -> x
    sum_mean   .sum( <-> .mean(, "sum" <-> "mean", ReduceOp.SUM <-> AVG, ReduceOp.MAX <-> MIN
    swap_args  f(a, b) -> f(b, a)
    negate     the condition of an if / while / conditional expression -> not (...)
    dim        dim=d -> dim=d+1, dim=d-1

The change is spliced into the file's text (comments, markers and line numbers stay); a
mutant whose text does not parse back to exactly the intended tree, does not compile, or
is the same program as the original or as another mutant is dropped. Relative imports
(`from .allreduce import ...`) become absolute, since the mutant is loaded from a temporary
folder; a file of an exercise that is a package (2.4's zero/, one file per stage) is loaded
in a copy of its whole package, which keeps the imports of the package's own files. Each
mutant has a stable id, `FILE:LINE:OPERATOR:HASH` (HASH: of the mutated
line(s), so an edit elsewhere in the file keeps it, save for the line number).

Every mutant runs the exercise's graded tests (every test_x_y_* of tests/test_phaseN.py)
through the negative-control machinery of tests/conftest.py (`pytest --controls`): all the
mutants of one phase in one pytest session, with the course's world deadline
(COURSE_WORLD_TIMEOUT, 60 s here as in tools/check_grading.py; --world-timeout). The
session also runs the unmutated file (copied the same way) first; it must pass every
test (one that failed only by harness errors runs again once), or the run stops; its test
times set the mutants' limits (below). With --originals-last (--ci's default: pytest has
already run every graded test on the solutions) it runs after the mutants instead, only
the tests that killed one: a kill stands if its test passes on the unmutated copy, a
timeout if its limit was at least 10 x the original's time (else: no verdict). A mutant
stops running tests at its first failure. Verdicts:

    killed      a graded test failed (an assertion, an exception, a deadlock ended by the
                world deadline, or a rank that died in the mutant's own code, e.g. torch
                aborting on a call the mutant made, or gloo aborting a rank on collectives
                the ranks issued differently, "Received data size doesn't match")
    timed out   a test ran past this tool's own limit outside any world (an endless loop in
                the test process: max(--test-timeout, 10 x the test's time on the original)),
                or ran out of memory (--memory-gb: an endless loop that allocates); it counts
                as detected, as in other mutation tools
    survived    every graded test passed
    harness     no verdict (a rank died elsewhere without reporting, a world could not start
                in time, or gloo could not connect a group's ranks, "connectFullMesh failed"):
                run again once, then listed apart and left out of the score.
                A session that dies between tests runs again from the mutant it was on.

    score = (killed + timed out) / (mutants - equivalent - harness)

tools/mutants_equivalent.txt lists mutants by id, each with a kind and a one-line reason:
`equivalent` (same behaviour as the reference: left out of the score) or `survives` (a
real bug the tests do not catch yet, recorded so that CI can run while the tests are
strengthened; it still counts as survived). An entry whose id no longer names a mutant is
stale, as is a `survives` entry whose mutant is now killed: the run says so, and --ci fails.

Variants: `--variants PATH...` runs whole files written by people instead of generated
mutants, e.g. wrong solutions written from the guidelines by someone who has not read the
tests, and correct alternatives. A file's exercise comes from a folder named after it
(`DIR/3.2/wrong_x.py`) or from an `EXERCISE = "3.2"` line; a file whose name starts with
`correct` is expected to pass every graded test, any other to be caught. Each runs exactly
as a mutant does; the report counts wrong files caught and correct files accepted, per
exercise. The list of equivalents plays no part.

Why our own mutator and not mutmut or cosmic-ray (both maintained, both on PyPI: mutmut
3.8, cosmic-ray 8.7): cosmic-ray writes each mutant over the module on disk and runs the
whole test command once per mutant (one `import torch`, one fork server and a collection
per mutant, seconds each, and the solutions of a shared checkout rewritten while other
runs read them); mutmut 3 copies the project into mutants/ with trampolines that pick the
mutant at run time, which the grader rejects (it checks that the module under test is the
file it was asked to grade) and which ranks started by the fork server do not see. Neither
knows the `# EXERCISE` regions (mutating signatures, docstrings and helpers the learner
never writes) nor the course's verdicts (a deadlock caught by a world deadline is a kill,
a rank that died unreported is no verdict). ast and the --controls machinery already here
give region-exact mutants, one session for many mutants, and the course's deadlines, in
one file of the standard library.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import hashlib
import importlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
import make_templates  # noqa: E402

EQUIVALENT_LIST = TOOLS / "mutants_equivalent.txt"
CI_PHASES = (1, 2, 3, 4)
CI_PER_EXERCISE = 2  # mutants per exercise of phases 1-2 that CI runs (a fixed sample: --seed 0)
# Phases 3-4 run worlds of up to 5 ranks and torchrun launches: CI samples only the exercises whose graded tests
# take seconds (each exercise's unmutated file runs them all first), so that the sample fits CI's budget; the
# others are mutation-tested by full runs (README, "Mutation testing").
CI_SAMPLE_34 = {"3.1": 2, "3.2": 1, "4.4": 1, "4.5": 1}
CI_SEED = 0
CI_WORLD_TIMEOUT = 15.0  # the worlds sampled need a few seconds (4.4's shared world the most); a deadlocked mutant waits this out
ORIGINAL_WORLD_TIMEOUT = 60.0  # at least this for the unmutated files: a world of theirs cut short would fail the run


# ------------------------------------------------------------------ exercises and regions


def exercise_files(exercise: str) -> list[Path]:
    """The reference solution files holding a region of `exercise` (a package's files too: 2.4's zero/)."""
    found = []
    for path, _ in make_templates.template_pairs():
        if exercise in make_templates.exercise_ids(path.read_text()):
            found.append(path)
    if not found:
        raise SystemExit(f"no `# EXERCISE {exercise}:` region in solutions/")
    return found


def regions(source: str) -> list[tuple[str, int, int]]:
    """(exercise, line of `# EXERCISE`, line of `# END EXERCISE`) for each region, 1-based."""
    found, open_at = [], None
    for lineno, line in enumerate(source.splitlines(), start=1):
        begin = make_templates.BEGIN.match(line)
        if begin:
            open_at = (begin["id"], lineno)
        elif make_templates.END.match(line) and open_at:
            found.append((open_at[0], open_at[1], lineno))
            open_at = None
    return found


# ------------------------------------------------------------------ making mutants


@dataclasses.dataclass
class Mutant:
    exercise: str
    file: str  # repo-relative path of the solution file
    line: int  # line of the change in that file
    operator: str
    change: str  # "old -> new", for people
    digest: str
    source: str = dataclasses.field(repr=False, default="")  # the whole mutated file, ready to load
    package: str = ""  # a file of this exercise package (repo-relative folder): loaded in a copy of it

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}:{self.operator}:{self.digest}"


_CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
        ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_ARITH = {ast.Add: [ast.Sub], ast.Sub: [ast.Add], ast.Mult: [ast.Div], ast.Div: [ast.Mult, ast.FloorDiv],
          ast.FloorDiv: [ast.Div], ast.Mod: [ast.FloorDiv], ast.Pow: [ast.Mult], ast.LShift: [ast.RShift],
          ast.RShift: [ast.LShift], ast.BitAnd: [ast.BitOr], ast.BitOr: [ast.BitAnd]}
_DROPPED_CALLS = ("clone", "detach", "contiguous")
_SWAPPED_NAMES = {"sum": "mean", "mean": "sum", "SUM": "AVG", "AVG": "SUM", "MAX": "MIN", "MIN": "MAX"}
_NOT_INTO = ("annotation", "returns", "decorator_list", "type_comment")  # fields whose code is not run as written


def _int_value(node: ast.AST) -> int | None:
    """The value of an integer literal, `3` or `-3` (not a bool)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and _int_value(node.operand) is not None \
            and isinstance(node.operand, ast.Constant):
        return -node.operand.value
    return None


def _int_node(value: int) -> ast.expr:
    return ast.Constant(value) if value >= 0 else ast.UnaryOp(ast.USub(), ast.Constant(-value))


def _walk(node: ast.AST, path: tuple = (), parent: ast.AST | None = None):
    """(path, node, parent) for every node; path = ((field, index or None), ...) from the root.
    f-strings (messages), annotations and decorators are not entered."""
    yield path, node, parent
    if isinstance(node, ast.JoinedStr):
        return
    for field, value in ast.iter_fields(node):
        if field in _NOT_INTO:
            continue
        if isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, ast.AST):
                    yield from _walk(item, path + ((field, i),), node)
        elif isinstance(value, ast.AST):
            yield from _walk(value, path + ((field, None),), node)


def _get(root: ast.AST, path: tuple) -> ast.AST:
    for field, index in path:
        root = getattr(root, field) if index is None else getattr(root, field)[index]
    return root


def _set(root: ast.AST, path: tuple, new: ast.AST) -> None:
    parent, (field, index) = _get(root, path[:-1]), path[-1]
    if index is None:
        setattr(parent, field, new)
    else:
        getattr(parent, field)[index] = new


def _replacements(node: ast.AST, parent: ast.AST | None) -> list[tuple[str, ast.AST]]:
    """(operator, the node that replaces `node`) for every mutation of this one node."""
    out: list[tuple[str, ast.AST]] = []

    def copy(**changes):
        new = type(node)(**{f: getattr(node, f) for f in node._fields})
        for key, value in changes.items():
            setattr(new, key, value)
        return new

    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in _CMP:
                ops = list(node.ops)
                ops[i] = _CMP[type(op)]()
                out.append(("cmp", copy(ops=ops)))
    elif isinstance(node, (ast.BinOp, ast.AugAssign)):
        for new_op in _ARITH.get(type(node.op), []):
            out.append(("arith", copy(op=new_op())))
    elif isinstance(node, ast.BoolOp):
        out.append(("boolop", copy(op=ast.Or() if isinstance(node.op, ast.And) else ast.And())))

    value = _int_value(node)
    in_dim = isinstance(parent, ast.keyword) and parent.arg == "dim"
    inner_of_negative = isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.USub)
    if value is not None and not inner_of_negative:
        operator = "dim" if in_dim else "const"
        out += [(operator, _int_node(value + 1)), (operator, _int_node(value - 1))]

    if isinstance(node, ast.Subscript):
        index = node.slice
        if isinstance(index, ast.Slice):
            for bound, missing in (("lower", 1), ("upper", -1)):
                current = getattr(index, bound)
                if current is None:
                    out.append(("index", copy(slice=ast.Slice(**{**_fields(index), bound: _int_node(missing)}))))
                elif _int_value(current) is None:  # a literal bound is `const`'s
                    for op in (ast.Add(), ast.Sub()):
                        bumped = ast.BinOp(current, op, ast.Constant(1))
                        out.append(("index", copy(slice=ast.Slice(**{**_fields(index), bound: bumped}))))
        elif _int_value(index) is None and not isinstance(index, (ast.Tuple, ast.Constant)):
            for op in (ast.Add(), ast.Sub()):
                out.append(("index", copy(slice=ast.BinOp(index, op, ast.Constant(1)))))

    sole = isinstance(parent, (ast.If, ast.For, ast.While, ast.With)) and parent.body == [node] \
        and not getattr(parent, "orelse", None)  # dropping it is dropping the block: one mutant, not two
    if isinstance(node, ast.stmt) and not isinstance(node, ast.Pass) and not _is_docstring(node) and not sole:
        out.append(("drop", ast.Pass()))

    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in _DROPPED_CALLS and not node.args and not node.keywords:
            out.append(("drop_call", func.value))
        if isinstance(func, ast.Attribute) and func.attr in ("sum", "mean"):
            out.append(("sum_mean", copy(func=ast.Attribute(func.value, _SWAPPED_NAMES[func.attr], func.ctx))))
        args = node.args
        if len(args) == 2 and not any(isinstance(a, ast.Starred) for a in args) \
                and ast.dump(args[0]) != ast.dump(args[1]):
            out.append(("swap_args", copy(args=[args[1], args[0]])))
    if isinstance(node, ast.Constant) and node.value in ("sum", "mean"):
        out.append(("sum_mean", ast.Constant(_SWAPPED_NAMES[node.value])))
    if isinstance(node, ast.Attribute) and node.attr in ("SUM", "AVG", "MAX", "MIN") \
            and "ReduceOp" in ast.unparse(node.value) and not (isinstance(parent, ast.Call) and parent.func is node):
        out.append(("sum_mean", ast.Attribute(node.value, _SWAPPED_NAMES[node.attr], node.ctx)))

    if isinstance(node, (ast.If, ast.While, ast.IfExp)):
        test = node.test
        negated = test.operand if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) \
            else ast.UnaryOp(ast.Not(), test)
        out.append(("negate", ("test", negated)))  # replaces the test, not the statement
    return out


def _fields(node: ast.AST) -> dict:
    return {f: getattr(node, f) for f in node._fields}


def _is_docstring(node: ast.AST) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _line_starts(data: bytes) -> list[int]:
    starts, pos = [0], 0
    while (pos := data.find(b"\n", pos) + 1) > 0:
        starts.append(pos)
    return starts


def _span(node: ast.AST, starts: list[int]) -> tuple[int, int]:
    """Byte offsets of a node's text (ast's columns count UTF-8 bytes)."""
    return starts[node.lineno - 1] + node.col_offset, starts[node.end_lineno - 1] + node.end_col_offset


def _absolute_imports(source: str, package: str, keep: int = 0) -> list[tuple[int, int, str]]:
    """Edits that make `from .x import y` absolute (`package` is e.g. solutions.phase1_data_parallel);
    those of at most `keep` levels stay (inside an exercise package, loaded as a copy of it)."""
    starts, edits = _line_starts(source.encode()), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level > keep:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
            new = ast.ImportFrom(module=module, names=node.names, level=0)
            start, end = _span(node, starts)
            edits.append((start, end, ast.unparse(new)))
    return edits


def _splice(data: bytes, edits: list[tuple[int, int, str]]) -> bytes:
    for start, end, text in sorted(edits, reverse=True):
        data = data[:start] + text.encode() + data[end:]
    return data


def mutants_of_source(source: str, exercise: str, file: str, package: str | None = None, keep: int = 0
                      ) -> list[Mutant]:
    """Every mutant of `exercise`'s regions in one file's text, in file order; `file` names it in
    the ids; `package` (e.g. solutions.phase1_data_parallel) makes its relative imports absolute,
    but for those of at most `keep` levels (a file of an exercise package: see _package_of)."""
    tree = ast.parse(source)
    original = ast.dump(tree)
    data = source.encode()
    starts = _line_starts(data)
    spans = [(begin, end) for ex, begin, end in regions(source) if ex == exercise]
    imports = _absolute_imports(source, package, keep) if package else []
    seen = {original}
    mutants: list[Mutant] = []
    for path, node, parent in list(_walk(tree)):
        if getattr(node, "end_lineno", None) is None:
            continue
        if not any(begin < node.lineno and node.end_lineno < end for begin, end in spans):
            continue
        for operator, new in _replacements(node, parent):
            target_path, target = path, node
            if isinstance(new, tuple):  # ("test", node): replace a child
                target_path, target, new = path + ((new[0], None),), getattr(node, new[0]), new[1]
            _set(tree, target_path, new)
            expected = ast.dump(tree)
            _set(tree, target_path, target)
            if expected in seen:
                continue
            start, end = _span(target, starts)
            text = ast.unparse(new)
            candidates = [text] if isinstance(target, (ast.stmt, ast.Slice)) else [text, f"({text})"]
            for candidate in candidates:
                mutated = _splice(data, [(start, end, candidate)])
                try:
                    ok = ast.dump(ast.parse(mutated)) == expected
                except SyntaxError:
                    ok = False
                if ok:
                    break
            else:
                continue  # no text for it parses back to the intended tree
            seen.add(expected)
            line_start = data.rfind(b"\n", 0, start) + 1
            new_end = start + len(candidate.encode())
            line_end = mutated.find(b"\n", new_end)
            changed = mutated[line_start: line_end if line_end >= 0 else len(mutated)].decode()
            before = data[line_start: (data.find(b"\n", end) + 1 or len(data) + 1) - 1].decode()
            digest = hashlib.sha1(f"{operator}\0{' '.join(before.split())}\0{' '.join(changed.split())}".encode()
                                  ).hexdigest()[:8]
            whole = _splice(mutated, imports).decode()
            try:
                compile(whole, file, "exec")
            except SyntaxError:
                continue
            old = " ".join(data[start:end].decode().split())
            mutants.append(Mutant(exercise, file, target.lineno, operator, f"{_short(old)} -> {_short(candidate)}",
                                  digest, whole, _package_of(file)))
    return mutants


def _short(text: str, limit: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _package_of(rel: str | Path) -> str:
    """The exercise package (repo-relative folder, solutions/phaseN_x/<package>) that solution file `rel`
    belongs to; "" for a module of a phase folder."""
    parts = Path(rel).parts
    return str(Path(*parts[:3])) if len(parts) > 3 and parts[0] == "solutions" else ""


def _levels_kept(rel: str | Path) -> int:
    """How many levels of relative imports stay relative in a copy of solution file `rel`: those that
    stay inside its exercise package (0 for a module of a phase folder)."""
    return len(Path(rel).parts) - 3 if _package_of(rel) else 0


def _copy_text(rel: str | Path) -> str:
    """Solution file `rel` as a copy of it loads: its relative imports absolute (see _levels_kept)."""
    text = (REPO_ROOT / rel).read_text()
    package = ".".join(Path(rel).parent.parts)
    return _splice(text.encode(), _absolute_imports(text, package, _levels_kept(rel))).decode()


def _write_loadable(folder: Path, name: str, rel: str, source: str | None = None) -> Path:
    """A loadable copy, named `name` in `folder`, of solution file `rel` with the text `source` (a
    mutant's; None: the file's own): the file, or for a file of an exercise package a copy of the
    whole package with it. Returns what a control loads: the file, or the package's folder."""
    package = _package_of(rel)
    if not package:
        path = folder / f"{name}.py"
        path.write_text(_copy_text(rel) if source is None else source)
        return path
    for src in sorted((REPO_ROOT / package).rglob("*.py")):
        rel_src = src.relative_to(REPO_ROOT)
        dst = folder / name / src.relative_to(REPO_ROOT / package)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(source if source is not None and rel_src == Path(rel) else _copy_text(rel_src))
    return folder / name


def mutants_of(exercise: str) -> list[Mutant]:
    """Every mutant of an exercise's regions, over the solution files that hold them."""
    found = []
    for path in exercise_files(exercise):
        rel = path.relative_to(REPO_ROOT)
        package = ".".join(rel.parent.parts)
        found += mutants_of_source(path.read_text(), exercise, str(rel), package, _levels_kept(rel))
    return found


def sample(mutants: list[Mutant], most: int | None, seed: int) -> list[Mutant]:
    """A deterministic sample of at most `most` mutants, in file order."""
    if most is None or len(mutants) <= most:
        return list(mutants)
    chosen = set(random.Random(seed).sample(range(len(mutants)), most))
    return [m for i, m in enumerate(mutants) if i in chosen]


def variants_of(paths: list[str]) -> list[Mutant]:
    """Whole-file variants (see the module docstring): one Mutant each, named after its
    exercise's solution file (whose unmodified copy runs first), `operator` "correct" or "wrong",
    `change` the variant's path."""
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    import grading
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise SystemExit(f"--variants: {given} does not exist")
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    found = []
    for path in files:
        text = path.read_text()
        exercise = path.parent.name if path.parent.name in grading.EXERCISES else None
        for node in ast.parse(text).body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["EXERCISE"]:
                exercise = ast.literal_eval(node.value)
        if exercise not in grading.EXERCISES:
            raise SystemExit(f"--variants: {path}: no exercise (put it in a folder named x.y, or set EXERCISE)")
        ex = grading.EXERCISES[exercise]
        solution = grading.module_file(Path("solutions") / ex.phase, ex.module)  # a package's: its __init__.py
        source = _splice(text.encode(), _absolute_imports(text, f"solutions.{ex.phase}")).decode()
        kind = "correct" if path.name.startswith("correct") else "wrong"
        found.append(Mutant(exercise, str(solution), 0, kind, str(path),
                            hashlib.sha1(f"{path.resolve()}\0{text}".encode()).hexdigest()[:8], source))
    return found


def report_variants(rows: list[dict], exercises: list[str]) -> dict:
    """Per exercise: wrong variants caught, correct ones accepted (harness errors apart)."""
    summary = {}
    for ex in exercises:
        mine = [r for r in rows if r["exercise"] == ex]
        wrong = [r for r in mine if r["operator"] == "wrong" and r["verdict"] != "harness"]
        correct = [r for r in mine if r["operator"] == "correct" and r["verdict"] != "harness"]
        caught = sum(r["verdict"] in ("killed", "timed out") for r in wrong)
        accepted = sum(r["verdict"] == "survived" for r in correct)
        summary[ex] = {"wrong": len(wrong), "caught": caught, "correct": len(correct), "accepted": accepted,
                       "harness": sum(r["verdict"] == "harness" for r in mine)}
    return summary


# ------------------------------------------------------------------ the list of equivalents


@dataclasses.dataclass
class Entry:
    id: str
    kind: str  # "equivalent" | "survives"
    reason: str
    lineno: int  # in the list file


def read_list(path: Path = EQUIVALENT_LIST) -> dict[str, Entry]:
    """The checked-in list: `ID KIND REASON` per line (KIND: equivalent or survives); # comments."""
    entries: dict[str, Entry] = {}
    if not path.exists():
        return entries
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split(None, 2)
        if len(parts) < 3 or parts[1] not in ("equivalent", "survives") or parts[0].count(":") != 3:
            raise SystemExit(f"{path.name}:{lineno}: expected `FILE:LINE:OPERATOR:HASH equivalent|survives "
                             f"reason`, got {line!r}")
        if parts[0] in entries:
            raise SystemExit(f"{path.name}:{lineno}: {parts[0]} listed twice")
        entries[parts[0]] = Entry(parts[0], parts[1], parts[2].strip(), lineno)
    return entries


def stale_entries(entries: dict[str, Entry], mutants: list[Mutant]) -> list[str]:
    """Entries of the files `mutants` cover that name no mutant of them (with a hint when the
    same change now sits at another line)."""
    ids = {m.id for m in mutants}
    files = {m.file for m in mutants}
    moved = {(m.file, m.operator, m.digest): m.line for m in mutants}
    problems = []
    for entry in entries.values():
        file, _, operator, digest = entry.id.split(":")
        if file in files and entry.id not in ids:
            hint = f" (the same change is now at line {moved[file, operator, digest]})" \
                if (file, operator, digest) in moved else ""
            problems.append(f"{EQUIVALENT_LIST.name}:{entry.lineno}: {entry.id} names no mutant any more{hint}")
    return problems


def renumbered(entries: dict[str, Entry], mutants: list[Mutant]) -> dict[str, str]:
    """{old id: new id} for stale entries whose change (file, operator, hash) still exists at
    other lines: an edit above it moved it. Entries that share a change are matched to its
    mutants in line order; a change whose number of entries and mutants differ is left alone."""
    now: dict[tuple, list[int]] = {}
    for m in mutants:
        now.setdefault((m.file, m.operator, m.digest), []).append(m.line)
    ids = {m.id for m in mutants}
    listed: dict[tuple, list[tuple[int, str]]] = {}
    for entry in entries.values():
        file, line, operator, digest = entry.id.split(":")
        listed.setdefault((file, operator, digest), []).append((int(line), entry.id))
    moves = {}
    for key, olds in listed.items():
        news = sorted(now.get(key, []))
        if not news or len(news) != len(olds) or all(old in ids for _, old in olds):
            continue
        for (_, old), line in zip(sorted(olds), news):
            if old not in ids:
                moves[old] = f"{key[0]}:{line}:{key[1]}:{key[2]}"
    return moves


def update_list(moves: dict[str, str], path: Path = EQUIVALENT_LIST) -> None:
    """Rewrite the ids `moves` names in the list file, leaving everything else as it is."""
    lines = path.read_text().splitlines(keepends=True)
    for i, line in enumerate(lines):
        first = line.split(None, 1)[0] if line.strip() and not line.lstrip().startswith("#") else None
        if first in moves:
            lines[i] = moves[first] + line[len(first):]
    path.write_text("".join(lines))


# ------------------------------------------------------------------ running the tests


def graded_tests(exercise: str) -> list[str]:
    """Every graded test function of an exercise, as test_phaseN.py collects them."""
    sys.path[:0] = [str(REPO_ROOT / "tests"), str(REPO_ROOT)]
    module = importlib.import_module(f"test_phase{exercise.split('.')[0]}")
    prefix = f"test_{exercise.replace('.', '_')}_"
    return sorted(name for name, value in vars(module).items() if name.startswith(prefix) and callable(value))


def _limit_memory(gigabytes: float):
    def apply():
        import resource
        limit = int(gigabytes * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return apply if gigabytes > 0 else None


def run_session(test_file: Path, controls: list[dict], args) -> dict[str, list[dict]]:
    """One pytest session running every control (name, exercise, path, caught_by) with this
    file as plugin; returns control name -> its test results, as the plugin recorded them.
    A session that makes no progress for --stall seconds is killed: the mutant it was on
    times out, the others not finished run again in a new session."""
    results: dict[str, list[dict]] = {}
    remaining = list(controls)
    while remaining:
        with tempfile.TemporaryDirectory(prefix="mutate-session-") as tmp:
            listing, progress, log = Path(tmp) / "controls.json", Path(tmp) / "progress.jsonl", Path(tmp) / "log"
            listing.write_text(json.dumps(remaining))
            env = {**os.environ, "MUTATE_PROGRESS": str(progress), "MUTATE_TEST_TIMEOUT": str(args.test_timeout),
                   "MUTATE_ORIGINALS_LAST": "1" if args.originals_last else "0",
                   "COURSE_WORLD_TIMEOUT": str(args.world_timeout),
                   "PYTHONPATH": os.pathsep.join([str(TOOLS), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
            cmd = [sys.executable, "-m", "pytest", str(test_file), "-q", "--tb=no", "-p", "no:cacheprovider",
                   "-p", "mutate", f"--controls={listing}"]
            with open(log, "w") as out:
                proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True, preexec_fn=_limit_memory(args.memory_gb))
                last, seen, stalled = time.time(), 0, False
                while proc.poll() is None:
                    time.sleep(0.5)
                    size = progress.stat().st_size if progress.exists() else 0
                    if size != seen:
                        last, seen = time.time(), size
                    elif time.time() - last > args.stall:
                        stalled = True
                        os.killpg(proc.pid, signal.SIGKILL)  # our own session's group
                        proc.wait()
            events = [json.loads(line) for line in progress.read_text().splitlines() if line.strip()] \
                if progress.exists() else []
            for event in events:
                if event["event"] == "result":
                    results.setdefault(event["control"], []).append(event)
            in_flight = _in_flight(events)
            if in_flight and (stalled or proc.returncode not in (0, 1)):
                # the session was killed (no progress) or died on this test: it decides this control
                why = f"no progress for {args.stall:.0f} s: the session was killed" if stalled \
                    else f"the pytest session died on it (exit {proc.returncode})"
                current = _control_name(in_flight["nodeid"], remaining)
                results.setdefault(current, []).append(
                    {**in_flight, "event": "result", "test": in_flight["nodeid"].split("::")[-1].split("[")[0],
                     "control": current, "outcome": "timeout" if stalled else "error", "message": why})
            died = stalled or proc.returncode not in (0, 1)
            if not any(e["event"] == "result" for e in events) and not in_flight:
                if not died or not remaining:
                    raise SystemExit(f"pytest ran no mutant test (exit {proc.returncode}):\n{log.read_text()[-4000:]}")
                # died before any result (e.g. out of memory while collecting): the first one takes the blame
                results[remaining[0]["name"]] = [{"event": "result", "control": remaining[0]["name"], "test": "?",
                                                  "nodeid": "?", "outcome": "error",
                                                  "message": f"the pytest session died (exit {proc.returncode}) "
                                                             "before any result"}]
            left: list[dict] = []
            names = [c["name"] for c in remaining]
            if died and in_flight:
                # the controls run one after the other: those after the one it died on never started
                current = _control_name(in_flight["nodeid"], remaining)
                left = remaining[names.index(current) + 1:] if current in names else []
            elif died:
                # died between two tests (e.g. in pytest's own reporting, out of memory): the control of the last
                # test that started may be unfinished, so it runs again with all those after it
                started = [e for e in events if e["event"] == "start"]
                current = _control_name(started[-1]["nodeid"], remaining) if started else "?"
                at = names.index(current) if current in names else 0
                if at > 0:  # progress was made: run it again from its first test, with all those after it
                    results.pop(current, None)
                    left = remaining[at:]
                else:  # the first control of this session: a failure it had stands, else no verdict
                    results.setdefault(remaining[0]["name"], []).append(
                        {"event": "result", "control": remaining[0]["name"], "test": "?", "nodeid": "?",
                         "outcome": "error", "message": f"the pytest session died (exit {proc.returncode}) after it"})
                    left = remaining[1:]
            for c in remaining:
                if c not in left and c["name"] not in results:  # it should have run, but did not
                    results[c["name"]] = [{"event": "result", "control": c["name"], "test": "?", "nodeid": "?",
                                           "outcome": "error", "message": "no test of it ran"}]
            remaining = left
            if args.verbose:
                print(log.read_text()[-3000:])
    return results


def _control_name(nodeid: str, controls: list[dict]) -> str:
    """The control a test ran against, from its id (test_x[mutant3] or test_x[mutant3-2])."""
    params = nodeid.rsplit("[", 1)[-1].rstrip("]").split("-") if "[" in nodeid else []
    names = [c["name"] for c in controls if c["name"] in params]
    return names[0] if names else "?"


def _in_flight(events: list[dict]) -> dict | None:
    ended = {e["nodeid"] for e in events if e["event"] == "result"}
    started = [e for e in events if e["event"] == "start" and e["nodeid"] not in ended]
    return started[-1] if started else None


def verdict(results: list[dict]) -> tuple[str, str]:
    """(killed | timed out | survived | harness, the deciding test and message)."""
    for outcome, name in (("fail", "killed"), ("deadlock", "killed"), ("crash", "killed"), ("timeout", "timed out")):
        for r in results:
            if r["outcome"] == outcome:
                why = {"deadlock": "deadlock, ended by the world deadline: ",
                       "crash": "a rank died in the mutant's code: "}.get(outcome, "")
                return name, f"{r['test']}: {why}{r.get('message', '')}"
    errors = [r for r in results if r["outcome"] == "error"]
    if errors:
        return "harness", f"{errors[0]['test']}: {errors[0].get('message', '')}"
    if not results:
        return "harness", "no test ran"
    return "survived", ""


def run_mutants(mutants: list[Mutant], args) -> dict[str, tuple[str, str]]:
    """mutant id -> (verdict, why); one session per phase (--jobs at once), after the
    unmodified file, which must pass."""
    by_phase: dict[str, list[Mutant]] = {}
    for m in mutants:
        by_phase.setdefault(m.exercise.split(".")[0], []).append(m)
    tests = {ex: graded_tests(ex) for ex in sorted({m.exercise for m in mutants})}  # imports: not in threads
    verdicts: dict[str, tuple[str, str]] = {}
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for result in pool.map(lambda item: _run_phase(*item, tests, args), sorted(by_phase.items())):
            verdicts.update(result)
    return verdicts


def _run_phase(phase: str, group: list[Mutant], tests: dict[str, list[str]], args) -> dict[str, tuple[str, str]]:
    verdicts: dict[str, tuple[str, str]] = {}
    test_file = REPO_ROOT / "tests" / f"test_phase{phase}.py"
    with tempfile.TemporaryDirectory(prefix="mutants-") as folder:
        controls, names = [], {}
        # the unmutated files (a package: once, whole): the tests must pass on a copy loaded this way; first,
        # or with --originals-last after the mutants, on the tests that killed one
        originals = {}
        for m in group:
            originals.setdefault((m.exercise, _package_of(m.file) or m.file), m.file)
        for (ex, copied), rel in sorted(originals.items()):
            name = f"original_{ex.replace('.', '_')}_{Path(copied).stem}"
            path = _write_loadable(Path(folder), name, rel)
            controls.append({"name": name, "exercise": ex, "path": str(path), "caught_by": tests[ex],
                             "world_timeout": max(args.world_timeout, ORIGINAL_WORLD_TIMEOUT)})
        mutant_controls = []
        for i, m in enumerate(group, start=1):
            name = f"mutant{i}"
            names[name] = m
            if m.package:  # a file of an exercise package: in a copy of the package
                path = _write_loadable(Path(folder), name, m.file, m.source)
            else:
                path = Path(folder) / f"{name}.py"
                path.write_text(m.source)
            mutant_controls.append({"name": name, "exercise": m.exercise, "path": str(path),
                                    "caught_by": tests[m.exercise], "world_timeout": args.world_timeout})
        controls = mutant_controls + controls if args.originals_last else controls + mutant_controls
        started = time.time()
        print(f"phase {phase}: {len(group)} mutants, one pytest session ({test_file.name})", flush=True)
        results = run_session(test_file, controls, args)
        retry = [c for c in controls if c["name"] in names and verdict(results.get(c["name"], []))[0] == "harness"]
        # an unmutated file whose only failures are harness errors (a world that did not form) runs again too
        unsure = [c for c in controls if c["name"] not in names
                  and verdict(results.get(c["name"], []))[0] == "harness" and results.get(c["name"])]
        if retry or unsure:
            print(f"phase {phase}: {len(retry)} mutants, {len(unsure)} unmutated files without a verdict (harness "
                  "error): once more", flush=True)
            again_controls = [c for c in controls if c["name"] not in names]
            again_controls = retry + again_controls if args.originals_last else again_controls + retry
            again = run_session(test_file, again_controls, args)
            results.update({c["name"]: again.get(c["name"], []) for c in retry + unsure})
            if args.originals_last:  # the originals ran again, on the tests that decided the retried mutants
                for c in controls:
                    if c["name"] not in names and c not in unsure:
                        results[c["name"]] = results.get(c["name"], []) + again.get(c["name"], [])
        for c in controls:
            if c["name"] in names:
                continue
            ran = [r for r in results.get(c["name"], []) if r["outcome"] != "skip"]
            bad = [r for r in ran if r["outcome"] != "pass"]
            if bad or not (ran or args.originals_last):
                detail = "; ".join(f"{r['test']}: {r['outcome']} {r.get('message', '')}" for r in bad[:3])
                raise SystemExit(f"the UNMUTATED {c['name']} does not pass its tests when loaded as a copy "
                                 f"({detail or 'no test ran'}): mutation results would mean nothing")
        original_seconds = {(c["exercise"], r["test"]): r.get("seconds") or 0.0
                            for c in controls if c["name"] not in names
                            for r in results.get(c["name"], []) if r["outcome"] == "pass"}
        for name, m in names.items():
            verdicts[m.id] = verdict(results.get(name, []))
            if args.originals_last:
                verdicts[m.id] = _checked_against_original(verdicts[m.id], results.get(name, []), m.exercise,
                                                           original_seconds)
        print(f"phase {phase}: {time.time() - started:.0f} s", flush=True)
    return verdicts


def _checked_against_original(decided: tuple[str, str], results: list[dict], exercise: str,
                              original_seconds: dict[tuple[str, str], float]) -> tuple[str, str]:
    """With --originals-last: a kill stands only if its test passed on the unmutated file (run after);
    a timeout only if the limit it ran under was at least 10 x that test's time on the original."""
    status, why = decided
    if status not in ("killed", "timed out"):
        return decided
    deciding = next(r for r in results if r["outcome"] in ("fail", "deadlock", "crash", "timeout"))
    seconds = original_seconds.get((exercise, deciding["test"]))
    if seconds is None:
        return "harness", f"{deciding['test']} did not pass on the unmutated file, run after the mutants"
    if status == "timed out" and (deciding.get("limit") or 0.0) < 10 * seconds:
        return "harness", (f"{deciding['test']} timed out after {deciding.get('limit') or 0:.0f} s, but takes "
                           f"{seconds:.1f} s on the unmutated file: run this mutant without --ci")
    return decided


def judge(m: Mutant, status: str, why: str, entry: Entry | None) -> tuple[str, str | None]:
    """(the verdict to report, the problem to fail CI on, if any) for a mutant, given its
    verdict and its entry in the list, if any."""
    if entry and entry.kind == "equivalent":
        if status == "survived":
            return "equivalent", None
        return status, f"{m.id} is listed as equivalent but is {status} ({why}): remove the entry"
    if entry and entry.kind == "survives" and status != "survived":
        return status, f"{m.id} is listed as surviving but is {status} now ({why}): remove the entry"
    if status == "survived" and not entry:
        return status, f"{m.id} survived: {m.change}"
    return status, None


def score(rows: list[dict]) -> dict:
    """Counts by verdict and the score, (killed + timed out) / (mutants - equivalent - harness)."""
    count = {k: sum(r["verdict"] == k for r in rows) for k in ("killed", "timed out", "survived", "harness",
                                                                "equivalent")}
    count["deadlocks"] = sum(r["verdict"] == "killed" and "deadlock, ended by the world deadline" in r["why"]
                             for r in rows)
    scored = len(rows) - count["equivalent"] - count["harness"]
    detected = count["killed"] + count["timed out"]
    count["score"] = f"{detected}/{scored} = {100 * detected / scored:.1f}%" if scored else "n/a"
    return {**count, "mutants": len(rows)}


# ------------------------------------------------------------------ the pytest plugin (-p mutate)
# Loaded into the pytest session that run_session starts (MUTATE_PROGRESS is set there):
# runs the controls one after the other, the unmutated files first; stops a mutant at its
# first failure; ends an endless test outside any world; writes each result as it comes.


class MutantTimeout(BaseException):
    """A test of a mutant ran past the tool's limit outside any world (BaseException: no
    `except Exception` in the code under test may swallow it)."""


_killed: set[str] = set()
_baseline: dict[tuple, float] = {}
_deciding: set[tuple[str, str]] = set()  # (exercise, test) that killed a mutant of this session
_limits: dict[str, float] = {}  # nodeid -> the limit a mutant's test ran under


def _originals_last() -> bool:
    """--ci: the unmutated files run after the mutants, only the tests that decided a verdict."""
    return os.environ.get("MUTATE_ORIGINALS_LAST") == "1"


def _item_control(item) -> dict | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("grade") if callspec else None


def _key(item) -> tuple:
    params = getattr(item, "callspec", None).params if getattr(item, "callspec", None) else {}
    return item.originalname, tuple(sorted((k, repr(v)) for k, v in params.items() if k != "grade"))


def _emit(event: dict) -> None:
    with open(os.environ["MUTATE_PROGRESS"], "a") as f:
        f.write(json.dumps(event) + "\n")


def _active() -> bool:
    return bool(os.environ.get("MUTATE_PROGRESS"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if not _active():
        return
    order = {c["name"]: i for i, c in enumerate(json.loads(Path(config.getoption("--controls")).read_text()))}
    items.sort(key=lambda item: order.get((_item_control(item) or {}).get("name"), len(order)))



def pytest_runtest_logstart(nodeid, location):
    if _active():
        _emit({"event": "start", "nodeid": nodeid})


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    control = _item_control(item)
    if _active() and control and control["name"] in _killed:
        pytest.skip("this mutant is already killed")
    if _active() and control and _originals_last() and control["name"].startswith("original_") \
            and (control["exercise"], item.originalname) not in _deciding:
        pytest.skip("no mutant of this session was killed by this test")


def _inside_a_world(frame) -> bool:
    while frame is not None:
        if frame.f_globals.get("__name__") in ("common.launch", "common.torchrun"):
            return True
        frame = frame.f_back
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    control = _item_control(item)
    if not _active() or not control or not hasattr(signal, "setitimer"):
        yield
        return
    base = _baseline.get(_key(item)) if not control["name"].startswith("original_") else None
    limit = max(float(os.environ.get("MUTATE_TEST_TIMEOUT", "20")), 10 * base if base else 0.0)
    if control["name"].startswith("original_"):
        limit = 10 * limit
    _limits[item.nodeid] = limit

    def on_alarm(signum, frame):
        if _inside_a_world(frame):  # a world has its own deadline
            signal.setitimer(signal.ITIMER_REAL, 2.0)
            return
        raise MutantTimeout(f"still running after {limit:.0f} s outside any world (an endless loop?)")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        outcome = yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if isinstance(outcome.exception, MemoryError):
        # an endless loop that allocates (a grid that grows forever): detected, like one that only
        # spins; replaced at once, so that its frames (and the memory they hold) are freed before
        # pytest formats anything
        outcome.force_exception(MutantTimeout("ran out of memory (--memory-gb): an endless loop that allocates?"))


_NO_WORLD = "connectFullMesh failed"  # gloo could not connect the ranks of a group: the world never formed


def _outcome(exc: BaseException | None, mutant_path: str, stderr: str = "") -> str:
    """The outcome of a failed test of a mutant: timeout, crash (a rank died in the mutant's own code, or gloo
    aborted it on a collective the ranks issued differently), deadlock, fail, or error (no verdict: a rank died
    elsewhere, a world did not start, or gloo could not connect a group's ranks). `stderr`: the test's captured
    stderr, where gloo's abort line lands (as tests/conftest.py reads it)."""
    import grading
    seen = set()
    e = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MutantTimeout):
            return "timeout"
        e = e.__cause__ or e.__context__
    e, seen = exc, set()
    while e is not None and id(e) not in seen:  # the world (or a group) never formed: a busy machine, no verdict
        seen.add(id(e))
        if _NO_WORLD in str(e):
            return "error"
        e = e.__cause__ or e.__context__
    death = grading.harness_error_of(exc)
    if death:  # a rank that died in the mutant's own code (e.g. torch aborting on its call) was killed by it
        if grading.collective_mismatch_of(exc, stderr):  # gloo aborted it: the ranks' collectives disagree
            return "crash"
        if os.path.isdir(mutant_path):  # a package's copy: any of its files
            mutant_path = os.path.join(mutant_path, "")
        return "crash" if mutant_path in death else "error"
    e = exc
    while e is not None:
        if type(e).__name__ == "WorldTimeout" and not getattr(e, "not_started", ()):
            return "deadlock"
        e = e.__cause__ or e.__context__
    return "fail"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    control = _item_control(item)
    if not _active() or not control:
        return
    if report.skipped:
        _emit({"event": "result", "nodeid": item.nodeid, "control": control["name"], "test": item.originalname,
               "outcome": "skip", "message": "", "when": report.when})
        return
    if not (report.when == "call" or report.failed):
        return
    exc = call.excinfo.value if call.excinfo else None
    result = "pass" if report.passed else _outcome(exc, control["path"], report.capstderr)
    if control["name"].startswith("original_") and report.when == "call":
        _baseline[_key(item)] = report.duration
    message = ""
    if exc is not None:
        first = (str(exc).strip().splitlines() or [""])[0]
        message = f"{type(exc).__name__}: {first}"[:300]
    if result in ("fail", "deadlock", "crash", "timeout"):
        _killed.add(control["name"])
        _deciding.add((control["exercise"], item.originalname))
    _emit({"event": "result", "nodeid": item.nodeid, "control": control["name"], "test": item.originalname,
           "outcome": result, "message": message, "when": report.when, "seconds": report.duration,
           "limit": _limits.get(item.nodeid)})


# ------------------------------------------------------------------ command line


def ci_sample_size(exercise: str) -> int:
    """How many mutants of `exercise` CI's sample (--ci) runs: CI_PER_EXERCISE in phases 1-2, CI_SAMPLE_34's
    number (0 if none) in phases 3-4."""
    return CI_PER_EXERCISE if int(exercise.split(".")[0]) in (1, 2) else CI_SAMPLE_34.get(exercise, 0)


def _exercises_of_phases(phases) -> list[str]:
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    import grading
    return [ex for ex, e in grading.EXERCISES.items() if int(ex.split(".")[0]) in phases
            and (REPO_ROOT / "solutions" / e.phase).is_dir()]


def _check_whole_list(entries: dict[str, Entry], known: dict[str, list[Mutant]] | None = None) -> list[str]:
    """Stale entries anywhere in the list (every exercise of every file it names); `known`: mutants already
    made, by exercise (ids do not depend on the import rewriting), not made twice."""
    problems, mutants = [], []
    files = {e.id.split(":")[0] for e in entries.values()}
    for file in sorted(files):
        path = REPO_ROOT / file
        if not path.is_file():
            problems.append(f"{EQUIVALENT_LIST.name}: {file} does not exist")
            continue
        text = path.read_text()
        for ex in sorted({r[0] for r in regions(text)}):
            made = [m for m in (known or {}).get(ex, []) if m.file == file]
            mutants += made or mutants_of_source(text, ex, file)
    return problems + stale_entries(entries, mutants)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exercises", nargs="*", metavar="X.Y", help="exercises to mutate, e.g. 1.1")
    parser.add_argument("--max", type=int, help="at most this many mutants per exercise (a deterministic sample)")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    parser.add_argument("--ci", action="store_true",
                        help=f"CI: {CI_PER_EXERCISE} mutants of each exercise of phases 1-2, and of phases 3-4 "
                             f"{CI_SAMPLE_34}, that the list does not call equivalent; fails on a survivor the list "
                             "does not name, and on stale entries")
    parser.add_argument("--variants", nargs="+", metavar="PATH",
                        help="run these whole-file variants (files, or folders of x.y/ subfolders) instead of "
                             "mutants: wrong ones must be caught, correct*.py ones must pass")
    parser.add_argument("--ids", nargs="+", metavar="ID",
                        help="only the mutants with these ids (FILE:LINE:OPERATOR:HASH, as a run prints them)")
    parser.add_argument("--list", action="store_true", help="print the mutants, run nothing")
    parser.add_argument("--renumber", action="store_true",
                        help="rewrite the ids in tools/mutants_equivalent.txt whose line moved (an edit above "
                             "them), for the files of the exercises named; run nothing")
    parser.add_argument("--diff", action="store_true", help="with --list: each mutant's diff")
    parser.add_argument("--json", metavar="PATH", help="also write every mutant and its verdict as JSON")
    parser.add_argument("--world-timeout", type=float,
                        help="each world's deadline in seconds (default COURSE_WORLD_TIMEOUT, else 60; "
                             f"{CI_WORLD_TIMEOUT:.0f} with --ci: a deadlocked mutant waits it out)")
    parser.add_argument("--jobs", type=int, help="pytest sessions (one per phase) at once (default 1; 2 with --ci)")
    parser.add_argument("--originals-last", action=argparse.BooleanOptionalAction,
                        help="run the unmutated files after the mutants, only the tests that killed one (default: "
                             "with --ci; otherwise first, every graded test, which also sets the mutants' limits)")
    parser.add_argument("--test-timeout", type=float, default=20.0,
                        help="a test of a mutant is ended after max(this, 10 x its time on the original) "
                             "seconds outside any world (default 20)")
    parser.add_argument("--stall", type=float, default=600.0,
                        help="kill a session that reports nothing for this many seconds (default 600)")
    parser.add_argument("--memory-gb", type=float, default=8.0,
                        help="address-space limit of the test processes, so that a mutant cannot eat the "
                             "machine's memory (default 8; 0: none)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the tail of each pytest session")
    args = parser.parse_args(argv)
    if args.world_timeout is None:
        args.world_timeout = CI_WORLD_TIMEOUT if args.ci else float(os.environ.get("COURSE_WORLD_TIMEOUT", "60"))
    if args.jobs is None:
        args.jobs = 2 if args.ci else 1
    if args.originals_last is None:
        args.originals_last = args.ci

    if args.variants:
        return main_variants(args)
    entries = read_list()
    if args.ci:
        exercises, most, seed = [ex for ex in _exercises_of_phases(CI_PHASES) if ci_sample_size(ex)], None, CI_SEED
    else:
        exercises, most, seed = args.exercises, args.max, args.seed
        if not exercises:
            parser.error("name at least one exercise (e.g. 1.1), or --ci")
    problems: list[str] = []
    chosen: list[Mutant] = []
    generated: dict[str, list[Mutant]] = {}
    for ex in exercises:
        generated[ex] = mutants_of(ex)
        candidates = generated[ex]
        if args.ci:  # CI's sample: mutants that must be killed (or are known to survive)
            candidates = [m for m in candidates if entries.get(m.id, Entry("", "", "", 0)).kind != "equivalent"]
        if args.ids:
            candidates = [m for m in candidates if m.id in args.ids]
        chosen += sample(candidates, ci_sample_size(ex) if args.ci else most, seed)
    every = [m for ms in generated.values() for m in ms]
    unknown = sorted(set(args.ids or ()) - {m.id for m in every})
    if unknown:
        parser.error(f"--ids: no mutant of {', '.join(exercises)} has the id(s) {', '.join(unknown)}")
    if args.renumber:
        moves = renumbered({k: e for k, e in entries.items() if e.id.split(":")[0] in {m.file for m in every}}, every)
        update_list(moves)
        for old, new in moves.items():
            print(f"renumbered {old} -> {new}")
        entries = read_list()
    stale = _check_whole_list(entries, generated) if args.ci else stale_entries(entries, every)

    if args.list:
        for m in chosen:
            entry = entries.get(m.id)
            note = f"  [{entry.kind}: {entry.reason}]" if entry else ""
            print(f"{m.id}  {m.change}{note}")
            if args.diff:
                base = _copy_text(m.file)
                print("".join(difflib.unified_diff(base.splitlines(True), m.source.splitlines(True),
                                                   m.file, m.id, n=1)))
        for ex in exercises:
            print(f"{ex}: {len(generated[ex])} mutants, {len([m for m in chosen if m.exercise == ex])} chosen")
        for line in stale:
            print(f"STALE    {line}")
        return 1 if stale else 0

    started = time.time()
    verdicts = run_mutants(chosen, args)
    rows = []
    for m in chosen:
        status, why = verdicts[m.id]
        entry = entries.get(m.id)
        label, problem = judge(m, status, why, entry)
        if problem:
            problems.append(problem)
        rows.append({"id": m.id, "exercise": m.exercise, "operator": m.operator, "change": m.change,
                     "verdict": label, "why": why, "listed": entry.kind if entry else None,
                     "reason": entry.reason if entry else None})
        note = f"  [{entry.kind}: {entry.reason}]" if entry else ""
        print(f"{label.upper():10} {m.id}  {m.change}" + (f"  <- {_short(why, 120)}" if why else "") + note)

    print()
    summary = {}
    for ex in exercises:
        summary[ex] = {**score([r for r in rows if r["exercise"] == ex]), "generated": len(generated[ex])}
        c = summary[ex]
        print(f"{ex}: {c['mutants']} mutants run (of {c['generated']}): {c['killed']} killed "
              f"({c['deadlocks']} by a deadlock), {c['timed out']} timed out, {c['survived']} survived, "
              f"{c['equivalent']} equivalent, {c['harness']} harness errors; score {c['score']}")
    for line in stale:
        print(f"STALE    {line}")
    print(f"{time.time() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"exercises": summary, "mutants": rows, "stale": stale}, indent=2) + "\n")
    if args.ci:
        failures = problems + stale + [f"{r['id']}: no verdict ({r['why']})" for r in rows if r["verdict"] == "harness"]
        if failures:
            print("\nmutation sample FAILED:\n  " + "\n  ".join(failures))
            return 1
        print("\nmutation sample: every mutant killed or listed")
    return 0


def main_variants(args) -> int:
    """--variants: run each file as a mutant is run; report wrong ones caught, correct ones accepted."""
    chosen = variants_of(args.variants)
    exercises = sorted({m.exercise for m in chosen}, key=lambda ex: tuple(map(int, ex.split("."))))
    started = time.time()
    verdicts = run_mutants(chosen, args)
    rows = []
    for m in chosen:
        status, why = verdicts[m.id]
        rows.append({"exercise": m.exercise, "operator": m.operator, "file": m.change, "verdict": status, "why": why})
        expected = status == "survived" if m.operator == "correct" else status in ("killed", "timed out")
        label = "HARNESS" if status == "harness" else ("ok" if expected else "MISSED" if m.operator == "wrong"
                                                        else "REJECTED")
        print(f"{label:9} {m.operator:8} {status:10} {m.change}" + (f"  <- {_short(why, 140)}" if why else ""))
    print()
    summary = report_variants(rows, exercises)
    for ex, c in summary.items():
        print(f"{ex}: wrong caught {c['caught']} of {c['wrong']}, correct accepted {c['accepted']} of {c['correct']}"
              + (f", {c['harness']} without a verdict" if c["harness"] else ""))
    total = {k: sum(c[k] for c in summary.values()) for k in ("wrong", "caught", "correct", "accepted")}
    print(f"all: wrong caught {total['caught']} of {total['wrong']}, correct accepted {total['accepted']} of "
          f"{total['correct']}; {time.time() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"exercises": summary, "variants": rows}, indent=2) + "\n")
    return 0 if total["caught"] == total["wrong"] and total["accepted"] == total["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
