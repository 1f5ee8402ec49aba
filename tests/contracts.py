"""Contract coverage: which documented inputs, modes and call sequences the graded tests exercise.

An exercise's documented input space lives next to its tests, as data, in
tests/phaseN/contract_<x>_<y>.py (derived from the docstrings and the guidelines, not from
the tests):

    CONTRACT = {
        "ShardSampler.__init__": [flag("shuffle"), default("seed"), explicit("seed", 0),
                                  when("num_replicas = 1", lambda c: c.a["num_replicas"] == 1),
                                  raises("rank = num_replicas", ValueError, lambda c: c.a["rank"] == c.a["num_replicas"])],
        "ShardSampler.__iter__": [when("before any set_epoch", lambda c: "set_epoch" not in c.history)],
        "make_loader": [...],
    }
    IRRELEVANT = {"ShardSampler.__len__: ...": "why no test needs it"}

Every public function and method of the exercise's module is a key of CONTRACT (a method by
the class that defines it; tests/test_contracts.py checks that none is missing and none is
stale). Each entry is a name and a predicate over one call (`Call` below: the bound
arguments, which were spelled out, the mode, the instance's earlier calls, the result or the
exception); an entry id is "<callable>: <name>".

Recording (one run, no second pass of the graded tests): with COURSE_CONTRACTS=<folder> in
the environment, `grading.ModuleRef.load()` wraps the public callables of the module it loads
(`instrument`), in whatever process loads it: the pytest process, and every rank that
common.launch.run_world starts (ranks get the caller's environment and load their ModuleRef
themselves). A call counts when it comes from outside the exercise's module (not a call the
module makes of itself) while a test of THAT exercise runs (conftest.py puts the running
test's node id in COURSE_CONTRACT_TEST; a world started by a test inherits it); each process
appends, once per entry, a JSON line to <folder>/<pid>.jsonl as soon as the entry is first
matched (ranks leave with os._exit: nothing waits for an exit handler).
`tools/check_contracts.py` reads the folder and fails on an entry no graded test exercised that
IRRELEVANT does not list with a reason.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import os
import sys
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ENV = "COURSE_CONTRACTS"  # folder the records go to; recording is on where it is set
TEST_ENV = "COURSE_CONTRACT_TEST"  # node id of the graded test running now (conftest.py)
TESTS = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- the data


@dataclass(frozen=True)
class Entry:
    name: str
    predicate: Callable[["Call"], bool]
    expect: str = "ok"  # "ok": the call returned; "raises": it raised `error`; "any": either
    error: type | tuple = ()
    key: Callable[["Call"], Any] | None = None  # differs(): a value that must differ between the ranks of a world


def when(name: str, predicate: Callable[["Call"], bool]) -> Entry:
    """A call that returned normally and satisfies `predicate`."""
    return Entry(name, predicate)


def always(name: str = "called") -> Entry:
    """Any call that returned normally."""
    return Entry(name, lambda c: True)


def raises(name: str, error: type | tuple, predicate: Callable[["Call"], bool] = lambda c: True) -> Entry:
    """A call satisfying `predicate` that raised `error` (the documented refusal)."""
    return Entry(name, predicate, "raises", error)


def differs(name: str, key: Callable[["Call"], Any], predicate: Callable[["Call"], bool] = lambda c: True) -> Entry:
    """Ranks of one world that make their n-th call of this callable with different `key(call)`s (a per-rank
    value: uneven batch sizes, a rank whose input differs in shape). Each rank records its value; the tool
    compares the ranks of a world (tools/check_contracts.py)."""
    return Entry(name, predicate, key=key)


def flag(arg: str) -> list[Entry]:
    """Both values of a boolean argument."""
    return [when(f"{arg}=True", lambda c: c.a.get(arg) is True), when(f"{arg}=False", lambda c: c.a.get(arg) is False)]


def value(arg: str, *values: Any) -> list[Entry]:
    """One entry per documented value (an enumeration): `arg` equal to it."""
    return [when(f"{arg}={v!r}", lambda c, v=v: _equal(c.a.get(arg, _MISSING), v)) for v in values]


def default(arg: str) -> Entry:
    """`arg` left out: its default stands."""
    return when(f"{arg} left to its default", lambda c: arg not in c.given)


def explicit(arg: str, v: Any = None, name: str | None = None) -> Entry:
    """`arg` spelled out as the value its default stands for (the two spellings must agree)."""
    return when(name or f"{arg}={v!r} spelled out", lambda c: arg in c.given and _equal(c.a[arg], v))


def none(arg: str) -> list[Entry]:
    """`arg` None, and not None."""
    return [when(f"{arg}=None", lambda c: c.a.get(arg, _MISSING) is None),
            when(f"{arg} not None", lambda c: c.a.get(arg, None) is not None)]


def world_group(arg: str = "group") -> Entry:
    """The object a group=None default stands for, spelled out: dist.group.WORLD."""
    def predicate(c):
        import torch.distributed as dist
        return c.a.get(arg) is not None and c.a.get(arg) is dist.group.WORLD
    return when(f"{arg}=dist.group.WORLD spelled out (what None stands for)", predicate)


_MISSING = object()

# Why a "left to its default" entry needs no test of its own: the value sits in the signature, which the template
# keeps (same names, same signatures), so no body can tell the argument left out from the same value spelled out.
SIGNATURE_DEFAULT = ("a plain default in the signature, which the template keeps: no body can tell it left out from "
                     "the same value spelled out; the value itself is exercised")


def _equal(a: Any, b: Any) -> bool:
    try:
        if type(a) is bool or type(b) is bool:
            return a is b
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a tensor compared with a number
        return False


# helpers for predicates
def world(c: "Call") -> int:
    return c.world


def is_tensor(x: Any) -> bool:
    import torch
    return isinstance(x, torch.Tensor)


def dtype_of(x: Any):
    return getattr(x, "dtype", None)


# ----------------------------------------------------------------------------- one call


@dataclass
class Call:
    """What a predicate sees of one call of a public callable."""

    fn: str  # "ShardSampler.__init__"
    a: dict  # every parameter, bound (defaults applied; **kwargs flattened in; self left out)
    given: frozenset  # the parameters the caller spelled out
    self: Any = None
    cls: str | None = None  # type(self).__name__ (a subclass calling an inherited method)
    result: Any = None
    raised: BaseException | None = None
    grad: bool = True  # torch.is_grad_enabled() during the call
    history: tuple = ()  # the names of the instance's earlier public calls (method names), oldest first
    past: tuple = ()  # the same calls as (name, {argument: value}), only arguments that are plain scalars
    count: int = 1  # calls of this method on this instance (a function: in this process), this call included
    live: int = 1  # instances of the class alive now (this one included)
    world: int = 1  # torch.distributed world size (1 where no group is initialised)
    rank: int = 0
    init: "Call | None" = None  # the instance's __init__ call (its arguments), where it was seen
    tensors_written: bool = False  # a tensor the constructor received was written in place since
    before: dict = field(default_factory=dict)  # what the contract's BEFORE[callable](call) saw before the call ran

    @property
    def training(self) -> bool | None:
        return getattr(self.self, "training", None)

    def previous(self, name: str) -> list[dict]:
        """The scalar arguments of this instance's earlier calls of method `name`, oldest first."""
        return [args for method, args in self.past if method == name]

    def since(self, name: str) -> tuple:
        """The method names called on this instance since its last call of `name` (all, if never)."""
        names = self.history
        last = len(names) - 1 - names[::-1].index(name) if name in names else -1
        return names[last + 1:]


# ----------------------------------------------------------------------------- contracts


@dataclass
class Contract:
    exercise: str
    path: Path
    api: dict[str, list[Entry]]
    irrelevant: dict[str, str] = field(default_factory=dict)
    before: dict[str, Callable[[Call], dict]] = field(default_factory=dict)  # state read before a call

    def entries(self) -> dict[str, Entry]:
        out = {}
        for fn, entries in self.api.items():
            for entry in entries:
                key = f"{fn}: {entry.name}"
                if key in out:
                    raise ValueError(f"{self.path}: entry {key!r} is listed twice")
                out[key] = entry
        return out


def contract_path(exercise: str) -> Path:
    x, y = exercise.split(".")
    return TESTS / f"phase{x}" / f"contract_{x}_{y}.py"


_contracts: dict[str, Contract | None] = {}


def _flatten(items) -> list[Entry]:
    out = []
    for item in items:
        out.extend(_flatten(item) if isinstance(item, (list, tuple)) else [item])
    return out


def load_contract(exercise: str) -> Contract | None:
    """The contract of an exercise, or None where it has no contract file."""
    if exercise not in _contracts:
        path = contract_path(exercise)
        if not path.exists():
            _contracts[exercise] = None
        else:
            spec = importlib.util.spec_from_file_location(f"_contract_{exercise.replace('.', '_')}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            api = {fn: _flatten(entries) for fn, entries in module.CONTRACT.items()}
            _contracts[exercise] = Contract(exercise, path, api, dict(getattr(module, "IRRELEVANT", {})),
                                            dict(getattr(module, "BEFORE", {})))
    return _contracts[exercise]


# ----------------------------------------------------------------------------- the recorder


def recording() -> bool:
    return bool(os.environ.get(ENV))


_local = threading.local()  # depth of public calls in progress: only the outermost counts
_lock = threading.Lock()
_seen: set[tuple[str, str]] = set()  # (exercise, entry id) already written by this process
_seen_values: dict[tuple[str, str], int] = {}  # (entry id, world) -> differs() values written by this process
_calls: dict[str, int] = {}  # qualname -> calls seen in this process (a rank's n-th call)
DIFFERS_CALLS = 40  # the first calls of a callable whose differs() values a rank records
_histories: dict[int, list[tuple[str, dict]]] = {}  # id(instance) -> its public calls (name, scalar arguments)
_inits: dict[int, tuple[Call, list]] = {}  # id(instance) -> (its __init__ call, [(tensor, version)])
_live: dict[str, "weakref.WeakSet"] = {}
_live_counts: dict[str, int] = {}  # classes whose instances cannot be weakly referenced: created so far


def _write(exercise: str, key: str, test: str, **extra: Any) -> None:
    folder = os.environ.get(ENV)
    if not folder:
        return
    line = json.dumps({"exercise": exercise, "entry": key, "test": test, **extra}) + "\n"
    path = Path(folder) / f"{os.getpid()}.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


_test_cache: list = [None, ("", "")]  # [the TEST_ENV value last seen, (its exercise, it)]


def _current_test_exercise() -> tuple[str, str]:
    test = os.environ.get(TEST_ENV, "")
    if test != _test_cache[0]:
        import grading  # noqa: PLC0415 - tests/ is on sys.path wherever a ModuleRef loads
        _test_cache[:] = [test, (grading.exercise_of_test(test.rsplit("::", 1)[-1]) or "", test)]
    return _test_cache[1]


def _tensors_in(value: Any, depth: int = 0) -> list:
    import torch
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 2:
        return []
    if isinstance(value, torch.nn.Module):
        return list(value.parameters())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v, depth + 1)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v, depth + 1)]
    return []


def _versions(tensors: list) -> list:
    """[(weak reference to a tensor, its version counter now)]: the recorder keeps no tensor alive."""
    out = []
    for t in tensors:
        try:
            out.append((weakref.ref(t), t._version))
        except Exception:  # noqa: BLE001 - inference tensors and the like
            pass
    return out


def _register(obj: Any, cls_name: str) -> None:
    try:
        _live.setdefault(cls_name, weakref.WeakSet()).add(obj)
    except TypeError:
        _live_counts[cls_name] = _live_counts.get(cls_name, 0) + 1


def _live_count(cls_name: str) -> int:
    return len(_live.get(cls_name, ())) + _live_counts.get(cls_name, 0)


def _forget(key: int) -> None:
    _histories.pop(key, None)
    _inits.pop(key, None)


class _Wrapped:
    """The state of one wrapped callable."""

    def __init__(self, exercise: str, qualname: str, fn: Callable, entries: dict[str, Entry], module_globals: frozenset,
                 method: bool, skip_first: bool = False, before: Callable | None = None, group: set | None = None):
        self.exercise, self.qualname, self.fn = exercise, qualname, fn
        self.entries = entries  # entry id -> Entry, those of this callable
        self.module_globals = module_globals  # ids of the namespaces of the module's own code (_own_globals)
        self.method = method  # the first parameter is the instance
        self.skip_first = skip_first  # the first parameter is the class (a classmethod)
        self.before = before
        # the entries still unseen in this process of every callable of the same class (or of this function): when
        # none is left, no call of them needs looking at, nor their history kept (the fast path)
        self.group = group if group is not None else set(entries)
        self.name = qualname.rsplit(".", 1)[-1]
        try:
            self.signature = inspect.signature(fn)
        except (TypeError, ValueError):
            self.signature = None

    def bind(self, args: tuple, kwargs: dict) -> tuple[Any, dict, frozenset]:
        if self.signature is None:
            return None, {}, frozenset(kwargs)
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:
            return None, {}, frozenset()
        given = set(bound.arguments)
        bound.apply_defaults()
        a = {}
        for name, param in self.signature.parameters.items():
            v = bound.arguments.get(name)
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                a.update(v or {})
                given.discard(name)
                given.update(v or {})
            else:
                a[name] = v
        owner = None
        if self.method or self.skip_first:
            first = next(iter(self.signature.parameters), None)
            if first is not None:
                owner = a.pop(first, None)
                given.discard(first)
        return (owner if self.method else None), a, frozenset(given)

    def pre(self, args, kwargs) -> dict | None:
        """The contract's BEFORE hook, run before the call where entries are still unseen."""
        if self.before is None or _current_test_exercise()[0] != self.exercise or \
                all((self.exercise, k) in _seen for k in self.entries):
            return None
        owner, a, given = self.bind(args, kwargs)
        return self.before(Call(self.qualname, a, given, owner, type(owner).__name__ if owner is not None else None))

    def observe(self, args, kwargs, result, raised, before=None) -> None:
        exercise, test = _current_test_exercise()
        if exercise != self.exercise:
            return
        pending = [(k, e) for k, e in self.entries.items() if (self.exercise, k) not in _seen]
        is_init = self.name == "__init__"
        owner, a, given = self.bind(args, kwargs)
        key = id(owner) if owner is not None else None
        cls_name = type(owner).__name__ if owner is not None else None
        if is_init and owner is not None and raised is None:
            _forget(key)
            _register(owner, cls_name)
            try:
                weakref.finalize(owner, _forget, key)
            except TypeError:
                pass
        past = tuple(_histories.get(key, ())) if key is not None else ()
        history = tuple(name for name, _ in past)
        if not pending:
            self._remember(key, is_init, owner, a, given, raised)
            return
        import torch
        try:
            import torch.distributed as dist
            initialised = dist.is_available() and dist.is_initialized()
            world_size, rank = (dist.get_world_size(), dist.get_rank()) if initialised else (1, 0)
        except Exception:  # noqa: BLE001
            world_size, rank = 1, 0
        nth = _calls[self.qualname] = _calls.get(self.qualname, 0) + 1
        init = _inits.get(key) if key is not None and not is_init else None
        written = bool(init) and any(t() is not None and _safe_version(t()) != v for t, v in init[1])
        call = Call(self.qualname, a, given, owner, cls_name, result, raised, torch.is_grad_enabled(), history,
                    past, history.count(self.name) + 1 if key is not None else nth, _live_count(cls_name) if cls_name else 1, world_size, rank,
                    init[0] if init else None, written, before or {})
        for k, entry in pending:
            if entry.expect == "ok" and raised is not None:
                continue
            if entry.expect == "raises" and (raised is None or not isinstance(raised, entry.error)):
                continue
            try:
                matched = bool(entry.predicate(call))
            except Exception:  # noqa: BLE001 - a predicate that does not apply to this call
                matched = False
            if matched and entry.key is not None:
                self._record_value(k, entry, call, nth, test)
                continue
            if matched:
                with _lock:
                    if (self.exercise, k) in _seen:
                        continue
                    _seen.add((self.exercise, k))
                    self.group.discard(k)
                _write(self.exercise, k, test)
        self._remember(key, is_init, owner, a, given, raised, call)

    def _record_value(self, k: str, entry: Entry, call: Call, nth: int, test: str) -> None:
        world_id = os.environ.get("MASTER_PORT", "")
        if not world_id or nth > DIFFERS_CALLS:
            return
        try:
            value = repr(entry.key(call))
        except Exception:  # noqa: BLE001
            return
        _write(self.exercise, k, test, world=f"{world_id}:{os.environ.get(TEST_ENV, '')}", nth=nth, value=value)

    def _remember(self, key, is_init, owner, a, given, raised, call=None) -> None:
        if key is None:
            return
        if is_init:
            if raised is None:
                _histories[key] = []
                if call is None:
                    call = Call(self.qualname, a, given, owner, type(owner).__name__)
                _inits[key] = (call, _versions([t for v in a.values() for t in _tensors_in(v)]))
            return
        scalars = {k: v for k, v in a.items() if v is None or isinstance(v, (bool, int, float, str))}
        import torch
        scalars["__grad__"] = torch.is_grad_enabled()  # the mode the call ran in (Call.previous reads it)
        _histories.setdefault(key, []).append((self.name, scalars))
        if len(_histories[key]) > 64:
            del _histories[key][:-64]


def _safe_version(t) -> int:
    try:
        return t._version
    except Exception:  # noqa: BLE001
        return -1


def _wrapper(state: _Wrapped) -> Callable:
    fn = state.fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not state.group or getattr(_local, "depth", 0) or id(sys._getframe(1).f_globals) in state.module_globals \
                or _current_test_exercise()[0] != state.exercise:
            return fn(*args, **kwargs)  # nothing left to see; the module calling itself; another exercise's test
        before = _safely(state.pre, args, kwargs) if state.before is not None else None
        _local.depth = 1
        try:
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                _local.depth = 0
                _safely(state.observe, args, kwargs, None, exc, before)
                raise
            _local.depth = 0
            _safely(state.observe, args, kwargs, result, None, before)
            return result
        finally:
            _local.depth = 0

    wrapper.__course_contract_wrapped__ = True
    return wrapper


def _safely(observe, *args):
    """Run the recorder's own work unseen: no torch function or dispatch mode of a test (one that counts host
    reads, collectives or allocations) sees it, and no error of its own reaches the graded code."""
    try:
        import torch
        if not torch._C._len_torch_function_stack() and not torch._C._len_torch_dispatch_stack():
            with torch._C.DisableTorchFunctionSubclass():
                return observe(*args)
        from torch.utils._python_dispatch import _disable_current_modes
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            return observe(*args)
    except Exception as exc:  # noqa: BLE001 - recording must never change what the graded code does
        sys.stderr.write(f"contract recorder: {type(exc).__name__}: {exc}\n")


def public_callables(module) -> dict[str, Any]:
    """{qualname: the function as the module or its class holds it} for the module's public API:
    functions and classes defined in it (not imported; a package's: defined in its files, 2.4's
    zero/), a class's methods that it defines itself (public ones and __init__, __call__, __iter__,
    __len__, __enter__, __exit__), its static and class methods; not properties, nor exception classes."""
    out = {}
    for name, value in vars(module).items():
        if name.startswith("_") or not _defined_in(getattr(value, "__module__", None), module):
            continue
        if inspect.isclass(value):
            if issubclass(value, BaseException):
                continue
            for attr, member in vars(value).items():
                if attr.startswith("_") and attr not in _DUNDERS:
                    continue
                if isinstance(member, (staticmethod, classmethod)) or inspect.isfunction(member):
                    if attr == "__init__" and _generated_init(value):
                        continue
                    out[f"{name}.{attr}"] = member
        elif inspect.isfunction(value):
            out[name] = value
    return out


_DUNDERS = ("__init__", "__call__", "__iter__", "__len__", "__enter__", "__exit__")


def _defined_in(origin, module) -> bool:
    """`origin` (a __module__) is `module`, or a file of it where it is a package."""
    return origin == module.__name__ or (isinstance(origin, str) and hasattr(module, "__path__")
                                         and origin.startswith(module.__name__ + "."))


def _own_globals(module) -> frozenset[int]:
    """The ids of the global namespaces of `module`'s code: its own, and those of its package's files."""
    names = [module.__name__] + ([m for m in list(sys.modules) if m.startswith(module.__name__ + ".")]
                                 if hasattr(module, "__path__") else [])
    return frozenset(id(vars(sys.modules[m])) for m in names if m in sys.modules)


def _generated_init(cls) -> bool:
    """A dataclass's generated __init__ (a record type): its fields are data, not a contract of its own."""
    init = vars(cls).get("__init__")
    return getattr(getattr(init, "__code__", None), "co_filename", "") == "<string>"


def instrument(module, exercise: str) -> None:
    """Wrap the public callables of `module` that exercise's contract names (idempotent)."""
    if getattr(module, "__course_contract__", None) == exercise:
        return
    contract = load_contract(exercise)
    if contract is None:
        return
    module.__course_contract__ = exercise
    entries = contract.entries()
    found = public_callables(module)
    own = _own_globals(module)
    groups: dict[str, set] = {}  # owner class (or function) -> its entries still worth watching
    for key in entries:
        fn = key.split(": ", 1)[0]
        if key not in contract.irrelevant and fn not in contract.irrelevant:
            groups.setdefault(fn.rpartition(".")[0] or fn, set()).add(key)
    for qualname in contract.api:
        member = found.get(qualname)
        if member is None:
            continue
        mine = {k: e for k, e in entries.items() if k.startswith(qualname + ": ")}
        owner_name, _, attr = qualname.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        if isinstance(member, staticmethod):
            state = _Wrapped(exercise, qualname, member.__func__, mine, own, method=False,
                             before=contract.before.get(qualname), group=groups.setdefault(owner_name or qualname, set()))
            setattr(owner, attr, staticmethod(_wrapper(state)))
        elif isinstance(member, classmethod):
            state = _Wrapped(exercise, qualname, member.__func__, mine, own, method=False, skip_first=True,
                             before=contract.before.get(qualname), group=groups.setdefault(owner_name or qualname, set()))
            setattr(owner, attr, classmethod(_wrapper(state)))
        elif getattr(member, "__course_contract_wrapped__", False):
            continue
        else:
            state = _Wrapped(exercise, qualname, member, mine, own, method=bool(owner_name),
                             before=contract.before.get(qualname), group=groups.setdefault(owner_name or qualname, set()))
            wrapped = _wrapper(state)
            setattr(owner, attr, wrapped)
            if not owner_name:
                _rebind_in_containers(module, member, wrapped)


def _rebind_in_containers(module, original, wrapped) -> None:
    """A module-level dict that holds the function (allreduce.STRATEGIES) hands out the wrapped one too."""
    for value in list(vars(module).values()):
        if isinstance(value, dict):
            for k, v in list(value.items()):
                if v is original:
                    value[k] = wrapped


# ----------------------------------------------------------------------------- reading the records


def read_records(folder: Path) -> dict[str, dict[str, str]]:
    """{exercise: {entry id: a test that exercised it}} from every process's lines."""
    out: dict[str, dict[str, str]] = {}
    values: dict[tuple, set] = {}  # differs(): (exercise, entry, world, n-th call) -> the ranks' values
    for path in sorted(Path(folder).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by a killed process
            if "value" in record:
                seen = values.setdefault((record["exercise"], record["entry"], record["world"], record["nth"]), set())
                seen.add(record["value"])
                if len(seen) > 1:
                    out.setdefault(record["exercise"], {}).setdefault(record["entry"], record["test"])
                continue
            out.setdefault(record["exercise"], {}).setdefault(record["entry"], record["test"])
    return out


def coverage(contract: Contract, exercised: dict[str, str]) -> dict:
    """Per exercise: every entry, those exercised, those listed irrelevant, the gaps (neither)."""
    entries = contract.entries()

    def why(key: str) -> str | None:  # an entry listed, or its whole callable
        return contract.irrelevant.get(key) or contract.irrelevant.get(key.split(": ", 1)[0])

    return {
        "exercise": contract.exercise,
        "entries": len(entries),
        "exercised": sorted(k for k in entries if k in exercised),
        "irrelevant": {k: why(k) for k in entries if k not in exercised and why(k)},
        "irrelevant_callables": {k: v for k, v in contract.irrelevant.items() if k in contract.api},
        "irrelevant_but_exercised": sorted(k for k in contract.irrelevant if k in exercised),
        "unknown_irrelevant": sorted(k for k in contract.irrelevant if k not in entries and k not in contract.api),
        "gaps": sorted(k for k in entries if k not in exercised and not why(k)),
    }
