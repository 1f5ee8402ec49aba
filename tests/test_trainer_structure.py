"""The phase-4 trainer's shape, read from its sources with ast (no process, no import of the
trainer; well under a second): imports go one way, and the parallel layout's name is read only
where the strategy is chosen (issue 32). The learner's phase4_production/ is generated from
these sources (tools/make_templates.py), so it has the same shape.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "solutions.phase4_production"
FACTORY = "solutions.phase4_production.trainer.parallel"  # STRATEGIES, make_strategy: the one place
LAYOUTS = {"ddp", "fsdp"}
# The classes that hold a model as one layout holds it: an isinstance() on one asks for the layout.
LAYOUT_CLASSES = {"DDP", "DistributedDataParallel", "FSDP", "FullyShardedDataParallel", "FSDPModule",
                  "DDPStrategy", "FSDPStrategy"}


def _file(module: str) -> Path | None:
    """The source of a first-party module (a .py file or a package's __init__.py), else None."""
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST):
    """Every import statement that can run: at module level, in a function (a late import), in
    a try or an if; not those under `if TYPE_CHECKING:` (they never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _runtime_imports(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _runtime_imports(node)


def _with_parents(module: str) -> set[str]:
    """Importing a.b.c runs a/__init__.py and a/b/__init__.py first: they are imported too."""
    parts = module.split(".")
    return {m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if _file(m)}


def _imports_of(module: str) -> set[str]:
    """The first-party modules `module` imports, wherever the import statement is."""
    path = _file(module)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # from .x import y, from .. import z
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]  # a name may be a submodule
        for name in names:
            if _file(name):
                found |= _with_parents(name)
    return found - {module}


def import_graph() -> dict[str, set[str]]:
    """{module: the first-party modules it imports} for every module of solutions/phase4_production
    (trainer/ included) and every first-party module they reach, through any chain: a circle
    that leaves the package (through common/, another phase) and comes back is a circle too."""
    start = {PACKAGE + "." + ".".join(p.relative_to(ROOT / "solutions" / "phase4_production").with_suffix("").parts)
             for p in (ROOT / "solutions" / "phase4_production").rglob("*.py")}
    start = {m.removesuffix(".__init__") for m in start}
    graph: dict[str, set[str]] = {}
    todo = sorted(start)
    while todo:
        module = todo.pop()
        if module not in graph:
            graph[module] = _imports_of(module)
            todo.extend(graph[module] - graph.keys())
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), as a path
    a -> b -> ... -> a."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    circles = []
    for component in components:  # a shortest way back to the first module, inside the component
        first = min(component)
        paths = {first: [first]}
        frontier = [first]
        while frontier and first not in {w for v in frontier for w in graph[v]}:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if first in graph[v])
        circles.append(paths[last] + [first])
    return circles


def test_no_phase4_module_imports_one_that_imports_it_back():
    """Imports go one way (train -> cli -> loop -> modes -> build -> components -> the exercises
    4.1-4.6 -> common): no module of solutions/phase4_production, trainer/ included, imports a
    module that imports it back, directly or through a chain, at module level or inside a
    function (a late import only hides a circle)."""
    graph = import_graph()
    assert graph[f"{PACKAGE}.train"] >= {f"{PACKAGE}.trainer.cli"}, "train.py runs trainer/cli.py"
    assert len([m for m in graph if m.startswith(PACKAGE + ".trainer.")]) > 15, sorted(graph)
    circles = [c for c in _cycles(graph) if any(m.startswith(PACKAGE) for m in c)]
    assert not circles, "import circle(s): " + "; ".join(" -> ".join(c) for c in circles)


def test_the_import_graph_sees_late_relative_and_chained_imports():
    """The check above can fail: a circle through a late import, a relative import and a
    package's __init__ are all edges of the graph it reads."""
    late = ast.parse("def f():\n    from solutions.phase4_production.trainer.loop import train\n")
    assert [n.module for n in _runtime_imports(late)] == ["solutions.phase4_production.trainer.loop"]
    hidden = ast.parse("if TYPE_CHECKING:\n    import a\nelse:\n    import b\n")
    assert [n.names[0].name for n in _runtime_imports(hidden)] == ["b"]
    assert _with_parents(f"{PACKAGE}.trainer.build") >= {PACKAGE, f"{PACKAGE}.trainer", f"{PACKAGE}.trainer.build"}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _layout_tests(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every place that asks which layout it is: a comparison or a match with
    "ddp"/"fsdp" or with a `.layout`/`.kind` attribute, a lookup keyed by a layout's name, or an
    isinstance() against a class that only one layout uses."""
    def named(e: ast.AST) -> bool:
        return (isinstance(e, ast.Constant) and e.value in LAYOUTS) or \
            (isinstance(e, ast.Attribute) and e.attr in ("layout", "kind")) or \
            (isinstance(e, (ast.Tuple, ast.List, ast.Set)) and any(named(x) for x in e.elts))

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(named(e) for e in (node.left, *node.comparators)):
            found.append((node.lineno, "compares with the layout's name"))
        elif isinstance(node, ast.Match) and (named(node.subject) or any(
                isinstance(p, ast.MatchValue) and named(p.value) for c in node.cases for p in ast.walk(c.pattern))):
            found.append((node.lineno, "matches the layout's name"))
        elif isinstance(node, ast.Subscript) and named(node.slice):
            found.append((node.lineno, "looks up by the layout's name"))
        elif isinstance(node, ast.Dict) and any(k is not None and named(k) for k in node.keys):
            found.append((node.lineno, "keys a table by the layout's name"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                and len(node.args) == 2:
            classes = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node.args[1])
                       if isinstance(n, (ast.Name, ast.Attribute))}
            if classes & LAYOUT_CLASSES:
                found.append((node.lineno, f"isinstance(..., {sorted(classes & LAYOUT_CLASSES)})"))
    return found


def test_the_layouts_name_is_tested_only_where_the_strategy_is_chosen():
    """DDP and FSDP are strategies behind one protocol (trainer/parallel.py), chosen once by
    --parallel's name: no other module of solutions/phase4_production compares with the name,
    branches on it, looks something up by it, or asks isinstance() of a layout's class."""
    root = ROOT / "solutions" / "phase4_production"
    found = []
    for path in sorted(root.rglob("*.py")):
        module = PACKAGE + "." + ".".join(path.relative_to(root).with_suffix("").parts)
        if module != FACTORY:
            found += [f"{path.relative_to(ROOT)}:{line} {what}" for line, what in _layout_tests(ast.parse(path.read_text()))]
    assert not found, "the layout is tested outside trainer/parallel.py (give the strategy a method instead): " + \
        "; ".join(found)


def test_the_layout_check_sees_each_way_of_asking():
    for source in ('if cfg.parallel.layout == "fsdp": pass', 'x = layout in ("ddp", "fsdp")',
                   'if self.kind != "ddp": pass', 'store = {"ddp": A, "fsdp": B}[name]', 'y = STORES["fsdp"]',
                   'ok = isinstance(net, DDP)', 'ok = isinstance(m, (nn.Linear, fsdp.FSDPModule))',
                   'match cfg.parallel.layout:\n    case "fsdp": pass'):
        assert _layout_tests(ast.parse(source)), source
    for source in ('make_strategy(cfg.parallel.layout, device)', 'msg = f"--parallel {layout}"',
                   'ok = isinstance(x, torch.Tensor)', '"""fsdp: sharded"""'):
        assert not _layout_tests(ast.parse(source)), source


def test_the_factory_is_where_the_layouts_are_named():
    """The module the check exempts exists and holds the layouts' table (else the check above
    would pass for want of anything to read)."""
    assert _layout_tests(ast.parse(_file(FACTORY).read_text())), f"{FACTORY} names no layout"
