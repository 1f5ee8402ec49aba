"""Negative controls: the reference with named replacements, spliced in at load time.

A control (tests/negative_controls/phaseN/<name>.py) names what it breaks and nothing else:

    \"\"\"save() prunes before it writes: a save that fails in a full folder has lost a good checkpoint.\"\"\"
    EXERCISE = "4.1"                                   # the exercise, hence the reference module
    CAUGHT_BY = ["test_4_1_failed_save_keeps_previous_checkpoint"]   # tests that must reject it
    WORLD_TIMEOUT = 20                                 # optional: its worlds' deadline (a deadlock)
    EDITS = {                                          # optional: source lines replaced inside ONE
        "CheckpointManager.save": [                    # named definition ("f", "Class", "Class.method")
            ("        atomic_save(state, path)\\n", ""),  # (old, new): old occurs exactly once there,
        ],                                             # (old, new, n): exactly n times
    }

    import torch                                       # imports the replacements need

    def capture_rng():                                 # a function replaces the reference's function
        ...
    class ZeroStage3:                                  # a class the reference has: each method (or
        def _pre_backward(self, unit): ...             # class attribute) in it replaces that one; the
                                                       # rest of the class, bases included, is the reference's
    STRATEGIES = {...}                                 # an assignment replaces the reference's of that name
    def _helper(): ...                                 # a new name: allowed when a replacement uses it

Loading (`load`) builds ONE module: the reference's own statements, in its order, compiled from
its file, with each named definition swapped for the control's (or for the reference's text with
EDITS applied); the control's imports run first, its new names after the reference's body (a
replacement may call them, not use them while it is being defined). Module-level names resolve
in that module, so the reference's callers of a replaced function, and the functions a
replacement calls, meet the replacement; relative imports resolve in the reference's package.
Tracebacks point at the reference's file for its code and at the control's for the replacements
(an EDITS-ed definition: at the reference's lines, the edited text shown). Nothing is copied by
hand, so nothing can drift: the rest of the module IS the reference, whatever it becomes.

A reference that is a package (2.4's zero/, one file per stage) is spliced as one module too:
its files' statements in the order they run (what a file imports from its package runs before
it, __init__.py last), each compiled from its own file, without the imports of the package's own
files (their names are already in the module): a control names a definition of any of its files.

`problems(path)` is the check that keeps controls honest (tools/check_grading.py, and
tests/test_controls.py in every `pytest`): the control loads; every name it replaces or edits
exists in the reference, and the replacement differs from it (docstrings aside); every new name
is used; and the loaded module's functions and methods have the reference's code except the
names the control declares.

The older spelling, `from solutions.<phase>.<module> import *` and then overrides (a function
the tests call directly, `class X(_reference.X)` overriding methods), still loads as a module of
its own and is held to the same check (it may not patch the reference module, copy a definition
of it, or splice source text itself: those are what a spliced control is for).
"""

from __future__ import annotations

import __future__
import ast
import copy
import inspect
import linecache
import sys
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
HEADER = ("EXERCISE", "CAUGHT_BY", "WORLD_TIMEOUT", "EDITS")


class ControlError(Exception):
    """A control that cannot be spliced into its reference: one line saying what to fix."""


def is_control(path: Path) -> bool:
    """A negative control: a file that names the tests that must reject it (CAUGHT_BY). Mutants
    and whole-file variants (tools/mutate.py) do not: they load as modules of their own."""
    text = Path(path).read_text()
    if "CAUGHT_BY" not in text:
        return False
    return any(isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["CAUGHT_BY"]
               for n in ast.parse(text).body)


@dataclass
class Control:
    path: Path
    tree: ast.Module
    header: dict
    reference: str  # "solutions.phase4_production.checkpoint"
    reference_path: Path  # its file; a package's __init__.py (2.4's zero/)
    spliced: bool  # False: the older `import *` spelling, a module of its own
    imports: list = field(default_factory=list)
    body: list = field(default_factory=list)  # defs, classes, assignments, in the control's order

    @property
    def package(self) -> str:
        return self.reference.rpartition(".")[0]

    @property
    def is_package(self) -> bool:
        return self.reference_path.name == "__init__.py"


def read(path: Path) -> Control:
    import grading  # tests/ is on sys.path wherever controls are loaded

    path = Path(path)
    tree = ast.parse(path.read_text(), str(path))
    header = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and getattr(node.targets[0], "id", None) in HEADER:
            header[node.targets[0].id] = ast.literal_eval(node.value)
    exercise = grading.EXERCISES.get(header.get("EXERCISE"))
    if exercise is None:
        raise ControlError(f"{path.name}: EXERCISE = {header.get('EXERCISE')!r} is no exercise of tests/grading.py")
    reference = f"solutions.{exercise.phase}.{exercise.module}"
    star = any(isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names) for n in tree.body)
    runs_code = any(isinstance(n, ast.Call) and getattr(n.func, "id", None) in ("exec", "compile")
                    for n in ast.walk(tree))
    control = Control(path, tree, header, reference,
                      grading.module_file(REPO_ROOT / "solutions" / exercise.phase, exercise.module),
                      spliced=not star and not runs_code)
    if not control.spliced:
        return control
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and getattr(node.targets[0], "id", None) in HEADER:
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue  # the reference's own future flags are used for every part of the module
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            control.imports.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or _assigned(node):
            control.body.append(node)
        else:
            raise ControlError(f"{path.name}, line {node.lineno}: a control holds its header, imports and "
                               "definitions (def, class, NAME = ...) only; replace source lines with EDITS")
    return control


def _assigned(node: ast.stmt) -> str | None:
    """The one name a simple assignment binds (`X = ...`, `X: T = ...`), else None."""
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
        return node.target.id
    return None


def _name_of(node: ast.stmt) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    return _assigned(node)


def _first_line(node: ast.stmt) -> int:
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def _bound_names(node: ast.stmt) -> set[str]:
    """Every name a top-level statement binds in its module."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"}
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
            names.add(sub.id)
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(sub.name)
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in sub.names if a.name != "*"}
    return names


def definitions(tree: ast.Module) -> dict[str, ast.stmt]:
    """{"f": def, "C": class, "C.m": method, "C.x": class attribute, "X": assignment} of a module."""
    found: dict[str, ast.stmt] = {}
    for node in tree.body:
        name = _name_of(node)
        if name is None:
            continue
        found[name] = node
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                inner = _name_of(item)
                if inner is not None:
                    found[f"{name}.{inner}"] = item
    return found


def _twice(tree: ast.Module) -> set[str]:
    """Names defined twice at one level (a property and its setter): no name can tell them apart."""
    seen, twice = set(), set()
    for scope, prefix in [(tree.body, "")] + [(n.body, n.name + ".") for n in tree.body if isinstance(n, ast.ClassDef)]:
        for item in scope:
            name = _name_of(item)
            if name is not None:
                (twice if prefix + name in seen else seen).add(prefix + name)
    return twice


# ---------------------------------------------------------------- the splice


@dataclass
class Splice:
    """What a spliced control makes of its reference: three units compiled apart, run in order."""

    control: Control
    body: list  # the reference's statements, the named definitions swapped: ONE unit per file of the
    #             reference (so that it compiles to the reference's own bytecode: CPython 3.11 compiles
    #             `module.f()` by whether `module` is imported in the same unit)
    units: list  # (statements, file, targets, future flags) per file of the reference, in order;
    #              targets: (qualname, first line) of a swapped definition -> the file it comes from
    reference_tree: ast.Module  # every file's statements in the splice, in order
    replaced: dict  # qualname -> the control's node (or the edited reference node)
    edited: set
    added: dict  # new top-level name -> node
    flags: int
    files: dict = field(default_factory=dict)  # pseudo filename -> text, for linecache


def _future_flags(tree: ast.Module) -> int:
    flags = 0
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            for alias in node.names:
                flags |= getattr(__future__, alias.name).compiler_flag
    return flags


def _apply_edits(control: Control, parts: list[_Part], tree: ast.Module
                 ) -> tuple[dict[str, ast.stmt], dict[str, str], dict[str, str]]:
    """The reference's definitions named in EDITS, their text edited and parsed again (at their
    own lines); the pseudo files that hold the edited text, for tracebacks (one per file of the
    reference that is edited); and the pseudo file of each edited definition."""
    edits = control.header.get("EDITS") or {}
    if not isinstance(edits, dict):
        raise ControlError(f"{control.path.name}: EDITS must be a dict {{name: [(old, new), ...]}}")
    found, twice = definitions(tree), _twice(tree)
    part_of = {_name_of(n): part for part in parts for n in part.body if _name_of(n) is not None}
    edited_lines: dict[int, list[str]] = {}  # index of the part -> its lines, edited
    nodes, file_of = {}, {}
    spans = []
    for name, pairs in edits.items():
        node = found.get(name)
        if node is None or name in twice:
            where = control.reference_path.parent if control.is_package else control.reference_path
            raise ControlError(f"{control.path.name}: EDITS names {name!r}, which the reference "
                               f"{where.relative_to(REPO_ROOT)} "
                               f"{'defines twice' if name in twice else 'does not define'}: update the control")
        part = part_of[name.split(".")[0]]
        index = parts.index(part)
        lines = part.text.splitlines(keepends=True)
        start, end = _first_line(node), node.end_lineno
        if any(i == index and start <= e and s <= end for i, s, e in spans):
            raise ControlError(f"{control.path.name}: EDITS names {name!r} and a definition inside or around it")
        spans.append((index, start, end))
        segment = "".join(lines[start - 1:end])
        for pair in pairs:
            if not (isinstance(pair, (tuple, list)) and len(pair) in (2, 3)):
                raise ControlError(f"{control.path.name}: EDITS[{name!r}] holds (old, new) or (old, new, count), "
                                   f"not {pair!r}")
            old, new, count = pair[0], pair[1], (pair[2] if len(pair) == 3 else 1)
            if not old or segment.count(old) != count:
                raise ControlError(
                    f"{control.path.name}: EDITS[{name!r}]: {old!r} occurs {segment.count(old)} times in the "
                    f"reference's {name} (expected {count}): the reference changed; update the control")
            segment = segment.replace(old, new)
        indent = len(lines[start - 1]) - len(lines[start - 1].lstrip())
        try:
            parsed = ast.parse(textwrap.dedent(segment)).body
        except SyntaxError as exc:
            raise ControlError(f"{control.path.name}: EDITS[{name!r}] leaves {name} unparsable: {exc.msg} "
                               f"(line {start + (exc.lineno or 1) - 1})") from None
        if len(parsed) != 1 or _name_of(parsed[0]) != name.rpartition(".")[2]:
            raise ControlError(f"{control.path.name}: EDITS[{name!r}] must leave one definition of {name}")
        new_node = parsed[0]
        ast.increment_lineno(new_node, start - 1)
        for sub in ast.walk(new_node):
            if hasattr(sub, "col_offset"):
                sub.col_offset += indent
                if getattr(sub, "end_col_offset", None) is not None:
                    sub.end_col_offset += indent
        nodes[name] = new_node
        file_of[name] = f"{part.path} (as {control.path.name} edits it)"
        edited = edited_lines.setdefault(index, list(lines))
        edited[start - 1:end] = [segment] + [""] * (end - start)  # keeps the edit's first line in place
    # one pseudo file per edited file: the file with the edits; an edited definition starts at its own line
    files = {f"{parts[index].path} (as {control.path.name} edits it)": "".join(lines)
             for index, lines in edited_lines.items()}
    return nodes, files, file_of


_PARSED: dict[tuple, tuple[str, ast.Module]] = {}


def _reference_source(path: Path) -> tuple[str, ast.Module]:
    """The text and tree of a reference file (parsed once per version of it; never mutated)."""
    stat = path.stat()
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    if key not in _PARSED:
        text = path.read_text()
        _PARSED[key] = (text, ast.parse(text, str(path)))
    return _PARSED[key]


@dataclass
class _Part:
    """One file of a reference: its text and tree, and its statements in the splice (for a
    package, without the imports of the package's own files)."""
    path: Path
    text: str
    tree: ast.Module
    body: list


def _imported_sibling(node: ast.stmt, folder: Path) -> Path | None:
    """The file of `folder`'s package that `node` imports names from (`from .flat import FlatParams`),
    else None."""
    if not (isinstance(node, ast.ImportFrom) and node.level == 1):
        return None
    file = folder / f"{node.module}.py" if node.module else None
    if file is None or not file.is_file() or any(a.asname not in (None, a.name) for a in node.names):
        raise ControlError(f"{folder.relative_to(REPO_ROOT)}, line {node.lineno}: a package spliced as one module "
                           "imports its own files as `from .file import name, ...` (no `as`, no modules)")
    return file


def _reference_parts(path: Path) -> list[_Part]:
    """The files of the reference whose file is `path`, in the order they run: the file itself; for a
    package (`path` its __init__.py), each file the package's imports reach, what a file imports
    before it, __init__.py last."""
    if path.name != "__init__.py":
        text, tree = _reference_source(path)
        return [_Part(path, text, tree, list(tree.body))]
    parts: list[_Part] = []
    seen: set[Path] = set()

    def visit(file: Path) -> None:
        if file in seen:
            return
        seen.add(file)
        text, tree = _reference_source(file)
        body = []
        for node in tree.body:
            sibling = _imported_sibling(node, path.parent)
            if sibling is None:
                body.append(node)
            else:
                visit(sibling)
        parts.append(_Part(file, text, tree, body))

    visit(path)
    return parts


def _whole(parts: list[_Part]) -> ast.Module:
    """The statements of every file of a reference, in the order they run: one module's."""
    return ast.Module([node for part in parts for node in part.body], [])


def splice(control: Control) -> Splice:
    """The statements of the spliced module (see the module's docstring), not yet run."""
    parts = _reference_parts(control.reference_path)
    tree = _whole(parts)
    found, twice = definitions(tree), _twice(tree)
    edited, files, edited_file_of = _apply_edits(control, parts, tree)
    owner: dict[str, ast.stmt] = {}  # every top-level name -> the statement binding it
    for node in tree.body:
        for name in _bound_names(node):
            owner.setdefault(name, node)
    replaced: dict[str, tuple[ast.stmt, str]] = {}
    added: dict[str, ast.stmt] = {}
    name_of_file = str(control.path)
    for node in control.body:
        name = _name_of(node)
        where = f"{control.path.name}, line {node.lineno}"
        if name in edited or any(e.startswith(name + ".") for e in edited):
            raise ControlError(f"{where}: {name} is both replaced and edited (EDITS): do one")
        if isinstance(node, ast.ClassDef) and isinstance(found.get(name), ast.ClassDef):
            if node.bases or node.keywords or node.decorator_list:
                raise ControlError(f"{where}: write `class {name}:` (no bases, no decorators): its methods replace "
                                   "the reference's, and the rest of the class stays the reference's")
            for item in node.body:
                if isinstance(item, ast.Expr) and isinstance(item.value, ast.Constant):
                    continue  # a docstring of the control's own
                inner = _name_of(item)
                qual = f"{name}.{inner}"
                if inner is None:
                    raise ControlError(f"{control.path.name}, line {item.lineno}: class {name} of a control holds "
                                       "methods and `name = ...` only (each replaces the reference's)")
                if qual in edited:
                    raise ControlError(f"{control.path.name}, line {item.lineno}: {qual} is both replaced and "
                                       "edited (EDITS): do one")
                if qual not in found or qual in twice:
                    raise ControlError(f"{control.path.name}, line {item.lineno}: {qual} is "
                                       f"{'defined twice' if qual in twice else 'not defined'} in the reference's "
                                       f"class {name}: a control replaces what the reference has")
                replaced[qual] = (item, name_of_file)
            continue
        if name in owner:
            if owner[name] is not found.get(name) or name in twice:
                raise ControlError(f"{where}: the reference binds {name} in a statement that is no single "
                                   f"definition (line {owner[name].lineno}): it cannot be replaced by name")
            replaced[name] = (node, name_of_file)
        else:
            added[name] = node
    for name, node in edited.items():
        replaced[name] = (node, edited_file_of[name])
    body, units = [], []
    for part in parts:
        statements, targets = [], {}
        names = {_name_of(n) for n in part.body} - {None}
        for qual, (node, filename) in replaced.items():
            if qual.split(".")[0] in names and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                targets[(qual, _first_line(node))] = filename
        for node in part.body:
            name = _name_of(node)
            if name in replaced:
                statements.append(replaced[name][0])
            elif isinstance(node, ast.ClassDef) and any(q.startswith(name + ".") for q in replaced):
                cls = copy.copy(node)
                cls.body = [replaced.get(f"{name}.{_name_of(item)}", (item, None))[0] for item in node.body]
                statements.append(cls)
            else:
                statements.append(node)
        body += statements
        units.append((statements, str(part.path), targets, _future_flags(part.tree)))
    return Splice(control, body, units, tree, {q: n for q, (n, _) in replaced.items()}, set(edited), added,
                  _future_flags(parts[0].tree), files)


def _refile(code: types.CodeType, targets: dict[tuple[str, int], str], inside: str | None = None) -> types.CodeType:
    """`code` with the code objects of the swapped definitions (by qualified name and first line)
    filed under the file they come from (the control's, or the edited reference's), nested code too."""
    if inside is None:
        inside = targets.get((code.co_qualname, code.co_firstlineno))
    consts = tuple(_refile(c, targets, inside) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_consts=consts, **({"co_filename": inside} if inside else {}))


_SPLICES: dict[str, Splice] = {}  # module name -> how it was spliced (problems() reads it)


def load(path: Path, name: str | None = None) -> types.ModuleType:
    """The module a control (or any other .py file: a mutant, a variant) stands for; cached in
    sys.modules under `name` (default `_control_<stem>`) so that its objects pickle to ranks."""
    path = Path(path)
    package = path.is_dir() or path.name == "__init__.py"  # a package (a mutant of 2.4's zero/): its folder
    init = path / "__init__.py" if path.is_dir() else path
    name = name or f"_control_{init.parent.name if package else path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    control = read(path) if not package and is_control(path) else None
    if control is None or not control.spliced:
        import importlib.util
        where = {"submodule_search_locations": [str(init.parent)]} if package else {}
        spec = importlib.util.spec_from_file_location(name, init, **where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        return module
    plan = _SPLICES[name] = splice(control)
    for filename, text in plan.files.items():
        linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    module = types.ModuleType(name, None)
    module.__file__ = str(path)
    # relative imports resolve in the reference's package (a package's own: in itself)
    module.__package__ = control.reference if control.is_package else control.package
    sys.modules[name] = module
    units = [(control.imports, str(path), None, plan.flags), *plan.units,
             (list(plan.added.values()), str(path), None, plan.flags)]
    try:
        for statements, filename, targets, flags in units:
            code = compile(ast.Module(statements, []), filename, "exec", flags=flags, dont_inherit=True)
            exec(_refile(code, targets) if targets else code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        _SPLICES.pop(name, None)
        raise
    return module


# ---------------------------------------------------------------- the check


def _without_docstring(node: ast.AST) -> str:
    """ast.dump of `node` with the docstrings of it and its inner definitions left out."""
    saved = []
    for sub in ast.walk(node):
        body = getattr(sub, "body", None)
        if (isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            saved.append((sub, body))
            sub.body = body[1:] or [ast.Pass()]
    try:
        return ast.dump(node)
    finally:
        for sub, body in saved:
            sub.body = body


def same_code(a: types.CodeType, b: types.CodeType) -> bool:
    """The same program: bytecode, names, constants (nested code too); file, lines and docstrings aside."""
    fields = ("co_code", "co_names", "co_varnames", "co_freevars", "co_cellvars", "co_argcount",
              "co_posonlyargcount", "co_kwonlyargcount", "co_flags", "co_name")
    if any(getattr(a, f) != getattr(b, f) for f in fields) or len(a.co_consts) != len(b.co_consts):
        return False
    consts = list(zip(a.co_consts, b.co_consts))
    if consts and not a.co_name.startswith("<") and isinstance(consts[0][0], str) and isinstance(consts[0][1], str):
        consts = consts[1:]  # a function's docstring (CPython 3.11: its first constant)
    for x, y in consts:
        if isinstance(x, types.CodeType) != isinstance(y, types.CodeType):
            return False
        if isinstance(x, types.CodeType) and not same_code(x, y):
            return False
        if not isinstance(x, types.CodeType) and (type(x) is not type(y) or x != y):
            return False
    return True


def _functions(obj) -> dict[str, types.CodeType]:
    """The code of a function, or of each method of a class ({"" or "m" or "p.fget": code})."""
    if inspect.isfunction(obj):
        return {"": inspect.unwrap(obj).__code__}  # a decorated one (functools.wraps): its own code
    if not inspect.isclass(obj):
        return {}
    found = {}
    for key, value in vars(obj).items():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            for part in ("fget", "fset", "fdel"):
                if inspect.isfunction(getattr(value, part)):
                    found[f"{key}.{part}"] = inspect.unwrap(getattr(value, part)).__code__
        elif inspect.isfunction(value):
            found[key] = inspect.unwrap(value).__code__
    return found


def _module_differences(module: types.ModuleType, reference: types.ModuleType, own: str) -> set[str]:
    """Names of the reference's functions, classes and methods whose code the loaded module
    changes ("f", "C", "C.m"); for a module of its own (`import *`), a name it lacks is no change.
    A package's are those of its files, helpers its __init__.py does not import included."""
    changed = set()
    names = dict(vars(reference))
    for sub in sorted(m for m in list(sys.modules) if m.startswith(own + ".")):
        for name, value in vars(sys.modules[sub]).items():
            names.setdefault(name, value)
    for name, value in names.items():
        origin = getattr(value, "__module__", None)
        if not (inspect.isfunction(value) or inspect.isclass(value)) or not (
                origin == own or (isinstance(origin, str) and origin.startswith(own + "."))):
            continue
        mine = getattr(module, name, None)
        if mine is value or (mine is None and not name.startswith("__")):
            continue
        ours, theirs = _functions(mine), _functions(value)
        if inspect.isclass(value) and inspect.isclass(mine) and value in mine.__mro__:
            theirs = {k: v for k, v in theirs.items() if k.split(".")[0] in vars(mine)}  # what a subclass overrides
        if type(mine) is not type(value) and not (inspect.isclass(mine) and inspect.isclass(value)):
            changed.add(name)
            continue
        for key in set(ours) | set(theirs):
            if key not in ours or key not in theirs or not same_code(ours[key], theirs[key]):
                changed.add(name if key == "" else f"{name}.{key.split('.')[0]}")
    return changed


def _loads(tree: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} | \
           {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}


def _reference_module_names(control) -> set[str]:
    """The names an override control binds to its reference module (`from pkg import mod as _reference`)."""
    names = set()
    for node in control.tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == control.package:
            names |= {a.asname or a.name for a in node.names if f"{control.package}.{a.name}" == control.reference}
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.name == control.reference and a.asname}
    return names


def _patches_of_the_reference(control, label: str) -> list[str]:
    """An override control that assigns to (or setattr's) its reference module: found from its source, before
    it runs, since running it would patch the module every later test of the process imports."""
    if control.spliced:
        return []
    mod_names, found = _reference_module_names(control), []
    for sub in ast.walk(control.tree):
        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
            sub, (ast.AugAssign, ast.AnnAssign)) else []
        patched = [t for t in targets if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) in mod_names]
        if patched or (isinstance(sub, ast.Call) and getattr(sub.func, "id", None) == "setattr" and sub.args
                       and getattr(sub.args[0], "id", None) in mod_names):
            found.append(f"{label}, line {sub.lineno}: patches the reference module: write it as a spliced "
                         "control, where the reference's callers meet the replacement")
    return found


def problems(path: Path) -> list[str]:
    """What makes a control dishonest or broken (empty when it is neither): see the docstring."""
    import importlib

    path = Path(path)
    label = path.name
    try:
        control = read(path)
        patching = _patches_of_the_reference(control, label)
        if patching:  # loading it would patch the reference module of this process (later tests would see it)
            return patching
        module = load(path, f"_control_check_{path.stem}")
    except ControlError as exc:
        return [f"{label}: does not load: {str(exc).removeprefix(label).lstrip(':, ')}"]
    except BaseException as exc:  # noqa: BLE001 - whatever a broken control raises
        first = str(exc).splitlines()[0] if str(exc) else ""
        return [f"{label}: does not load: {type(exc).__name__}" + (f": {first}" if first else "")]
    finally:
        sys.modules.pop(f"_control_check_{path.stem}", None)
    reference = importlib.import_module(control.reference)
    ref_tree = _whole(_reference_parts(control.reference_path))
    ref_defs = definitions(ref_tree)
    found: list[str] = []
    if control.spliced:
        plan = _SPLICES.pop(module.__name__)
        declared = set(plan.replaced) | set(plan.added)
        for mine, theirs in zip(plan.body, ref_tree.body, strict=True):  # all else is the reference's own node
            name = _name_of(theirs)
            pairs = zip(mine.body, theirs.body, strict=True) if mine is not theirs and isinstance(
                theirs, ast.ClassDef) and name not in declared else [(mine, theirs)]
            for a, b in pairs:
                qual = _name_of(b) if a is mine else f"{name}.{_name_of(b)}"
                if a is not b and qual not in declared:
                    found.append(f"{label}: the splice changed the reference's line {b.lineno}, which the control "
                                 "does not name (a bug of tests/controls.py)")
        for qual, node in plan.replaced.items():
            if _without_docstring(node) == _without_docstring(ref_defs[qual]):
                found.append(f"{label}: replaces {qual} with the reference's own (docstrings aside): drop it")
        used = set().union(*[_loads(n) for n in plan.replaced.values()]) if plan.replaced else set()
        for name, node in plan.added.items():
            used |= _loads(node) - {name}
        for name in plan.added:
            if name not in used:
                found.append(f"{label}: adds {name}, which the reference lacks and no replacement uses "
                             "(a misspelt name of the reference?)")
        for node in control.imports:
            for name in _bound_names(node) & {n for s in ref_tree.body for n in _bound_names(s)}:
                found.append(f"{label}, line {node.lineno}: imports {name}, a name the reference binds itself")
    else:
        declared, mod_names = set(), _reference_module_names(control)
        star = [n for n in control.tree.body if isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names)]
        if [n.module for n in star] != [control.reference]:
            found.append(f"{label}: imports * from {', '.join(str(n.module) for n in star) or 'nothing'}, "
                         f"not from its reference {control.reference} alone")
        for sub in ast.walk(control.tree):
            if isinstance(sub, ast.Call) and getattr(sub.func, "id", None) in ("exec", "compile"):
                found.append(f"{label}, line {sub.lineno}: splices source text itself: write it as a spliced "
                             "control (EDITS, or the definitions it replaces)")
                break
        for node in control.tree.body:
            name = _name_of(node)
            if name is None or name in HEADER:
                continue
            subclass = isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Attribute) and b.attr == name and getattr(b.value, "id", None) in mod_names
                for b in node.bases)
            members = [(f"{name}.{_name_of(i)}", i) for i in node.body if _name_of(i)] if isinstance(
                node, ast.ClassDef) else []
            declared |= {name} | {q for q, _ in members}
            if isinstance(node, ast.ClassDef) and name in ref_defs:
                for qual, item in members:
                    if qual in ref_defs and _without_docstring(item) == _without_docstring(ref_defs[qual]):
                        found.append(f"{label}: {'overrides' if subclass else 'copies'} {qual} with the reference's "
                                     "own: a copy drifts; write the control as a splice of what it breaks")
            elif name in ref_defs and _without_docstring(node) == _without_docstring(ref_defs[name]):
                found.append(f"{label}: copies {name} from the reference: a copy drifts; write the control as a "
                             "splice of what it breaks")
    for qual in sorted(_module_differences(module, reference, control.reference) - declared):
        found.append(f"{label}: changes {qual}, which it does not declare (the module differs from the reference "
                     "outside what the control names)")
    return found
