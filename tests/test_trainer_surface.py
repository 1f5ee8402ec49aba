"""The trainer's surface (issue 38): every input it reads besides its flags, every file it writes,
each with what can be wrong and what the trainer does, as the inventory in
solutions/phase4_production/README.md ("The trainer's surface") lists them.

Same small runs as tests/test_trainer.py (the small CNN on the digits, its helpers); the runs that
refuse stop before training, the read-only ones use --evaluate, and the checks of the lease, the
launcher's clock, the device's environment and the data checks run in this process. The first
test reads the source alone: it fails when the trainer reads an environment variable or touches
a file at a place that solutions/phase4_production/surface.toml does not list.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from common.launch import run_world

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib
from test_trainer import ROOT, STEPS, _one_line_error, launch

SURFACE = ROOT / "solutions" / "phase4_production" / "surface.toml"
README = ROOT / "solutions" / "phase4_production" / "README.md"
INVENTORY = "### The trainer's surface"


# ---------------------------------------------------------------- the listing: source against surface.toml

ENTRY = "solutions.phase4_production.train"
# calls that read, write or remove a file: by their full name, or (methods of paths, torch's and
# torchvision's writers and readers) by their last name, whatever they are called on
FIRST_PARTY = ("solutions", "common")
EXACT = {"open", "os.open", "io.open", "os.fdopen", "torch.save", "torch.load", "os.replace", "os.rename", "os.link",
         "os.symlink", "os.utime", "os.unlink", "os.remove", "os.rmdir", "os.makedirs", "os.scandir", "os.listdir",
         "os.statvfs", "Image.open", "dcp.save", "dcp.load", "np.load", "np.loadtxt", "tempfile.mkdtemp",
         "tempfile.mkstemp", "tempfile.gettempdir", "tempfile.NamedTemporaryFile", "shutil.rmtree", "shutil.move",
         "shutil.copy", "shutil.copyfile", "os.path.samefile", "os.path.getsize"}
METHODS = {"read_text", "read_bytes", "write_text", "write_bytes", "unlink", "rename", "touch", "mkdir", "iterdir",
           "glob", "rglob", "tensorboard_trace_handler", "SummaryWriter", "ImageFolder", "FileSystemWriter",
           "FileSystemReader", "read_file"}
ENV_CALLS = {"os.getenv", "os.environ.get", "os.environ.setdefault", "os.environ.pop"}


def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def trainer_modules() -> dict[str, Path]:
    """Every first-party module the trainer's entry point can import, through any chain."""
    todo, seen = [ENTRY], {}
    while todo:
        name = todo.pop()
        path = _module_file(name)
        if name in seen or path is None:
            continue
        seen[name] = path
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.split(".")[0] in FIRST_PARTY]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                if base.split(".")[0] in FIRST_PARTY:
                    todo += [base] + [f"{base}.{a.name}" for a in node.names]
    return seen


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


class _Scan(ast.NodeVisitor):
    """(key, site) of every environment access and (call, site) of every file access;
    site = 'path:Class.function'; key = the variable's name, or '*' when it is not a constant."""

    def __init__(self, rel: str):
        self.rel, self.stack, self.env, self.files = rel, [], [], []
        self.handled: set[int] = set()  # the os.environ nodes of the accesses recognised above them

    def _environ(self, node, key: str) -> None:
        self.env.append((key, self.site()))
        self.handled.add(id(node))

    def site(self) -> str:
        return f"{self.rel}:{'.'.join(self.stack) or '<module>'}"

    def visit_FunctionDef(self, node):
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

    @staticmethod
    def _key(node) -> str:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else "*"

    def visit_Subscript(self, node):
        if _dotted(node.value) == "os.environ":
            self._environ(node.value, self._key(node.slice))
        self.generic_visit(node)

    def visit_Compare(self, node):
        if any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            for other in node.comparators:
                if _dotted(other) == "os.environ":
                    self._environ(other, self._key(node.left))
        self.generic_visit(node)

    def visit_Attribute(self, node):
        if _dotted(node) == "os.environ" and id(node) not in self.handled:  # aliased, copied, passed on: any key
            self._environ(node, "*")
        self.generic_visit(node)

    def visit_Call(self, node):
        name = _dotted(node.func)
        if name in ENV_CALLS:
            self._environ(node.func.value, self._key(node.args[0]) if node.args else "*")
        last = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name in EXACT or last in METHODS:
            self.files.append((name if name in EXACT else last, self.site()))
        self.generic_visit(node)


def surface() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """({variable or '*': its sites}, {site: the calls there that touch files})."""
    env: dict[str, set[str]] = {}
    files: dict[str, set[str]] = {}
    for path in trainer_modules().values():
        scan = _Scan(path.relative_to(ROOT).as_posix())
        scan.visit(ast.parse(path.read_text(), str(path)))
        for key, site in scan.env:
            env.setdefault(key, set()).add(site)
        for call, site in scan.files:
            files.setdefault(site, set()).add(call)
    return env, files




def test_every_variable_and_file_the_trainer_touches_is_in_the_inventory():
    """No process: the source of every module the trainer can import, against surface.toml and
    the README's inventory. A new os.environ read or file access fails here until it is listed."""
    listed = tomllib.loads(SURFACE.read_text())
    variables, places, files = listed["environment"], listed["environment"]["any"], listed["files"]
    env, touched = surface()
    named = {key: sites for key, sites in env.items() if key != "*"}
    unlisted = {key: sorted(sites) for key, sites in named.items() if key not in variables}
    assert not unlisted, f"the trainer reads variables that surface.toml does not list: {unlisted}"
    dynamic = sorted(env.get("*", ()))
    assert dynamic == sorted(places), ("places that read variables by a name not written there, against "
                                       f"[environment.any]: read {dynamic}, listed {sorted(places)}")
    stale = sorted(set(variables) - {"any"} - set(named) - {k for keys in places.values() for k in keys})
    assert not stale, f"surface.toml lists variables that nothing reads: {stale}"
    assert sorted(touched) == sorted(files), (
        f"file accesses not listed in surface.toml [files]: {sorted(set(touched) - set(files))}; "
        f"listed but gone: {sorted(set(files) - set(touched))}")
    inventory = README.read_text().split(INVENTORY, 1)[-1].split("\n### ", 1)[0]
    assert INVENTORY in README.read_text(), f"the README has no section {INVENTORY!r}"
    missing = [key for key in variables if key != "any" and f"`{key}`" not in inventory]
    assert not missing, f"the README's inventory has no row naming {missing}"


# ---------------------------------------------------------------- the launcher's environment


@pytest.mark.parametrize("env, needles", [
    ({"RANK": "0"}, ["RANK=0 is set but WORLD_SIZE", "unset RANK"]),
    # a PyTorchJob that runs the trainer without torchrun: no LOCAL_RANK (it used to take GPU RANK of its node)
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     ["LOCAL_RANK, LOCAL_WORLD_SIZE are not", "torchrun"]),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
      "MASTER_PORT": "29500"}, ["does not add up", "RANK=2"]),
])
def test_a_torchrun_world_that_is_not_whole_is_one_line(tmp_path, monkeypatch, env, needles):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    _one_line_error(launch(tmp_path, timeout=120), *needles)
    assert not (tmp_path / "checkpoints").exists()


def _lease(folder: Path, **record) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ".writer"
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "run_id": "another-job",
                                "since": time.time(), **record}))
    return path


def test_torchruns_variables_left_in_a_shell_make_no_restart_of_its_job(tmp_path, monkeypatch):
    """TORCHELASTIC_RUN_ID and _RESTART_COUNT inherited from a torchrun job that started this
    shell, RANK not set: the run is a new job. They used to make it a restart of that job: a live
    lease of that id was taken over (two writers), and an error was said once, then never again
    (the fatal marker of that "job")."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-of-the-shell")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    for _ in range(2):  # the same mistake twice: said twice
        _one_line_error(launch(tmp_path / "bad", "--dataset", "cifar10", "--data-root", str(tmp_path / "none"),
                               timeout=120), "--data-root", "is not a folder")
    _lease(tmp_path / "live", run_id="job-of-the-shell")  # held by this very process, alive
    proc = launch(tmp_path / "live", "--max-steps", "2", timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 2, proc.stderr[-3000:]
    assert lines[0].startswith("note: ignoring TORCHELASTIC_RUN_ID=job-of-the-shell, TORCHELASTIC_RESTART_COUNT=2"), \
        lines
    assert "is in use by another run" in lines[1] and "its process is running" in lines[1], lines[1]
    assert json.loads((tmp_path / "live" / ".writer").read_text())["pid"] == os.getpid(), "the live lease was taken"


@pytest.mark.parametrize("backend, needles", [("nccl", ["COURSE_BACKEND=nccl", "needs GPUs", "unset"]),
                                              ("mpi", ["COURSE_BACKEND='mpi' is no backend"])])
def test_a_backend_pinned_for_another_device_is_one_line(tmp_path, monkeypatch, backend, needles):
    if backend == "nccl" and torch.cuda.is_available():
        pytest.skip("a GPU is visible: NCCL can run here")
    monkeypatch.setenv("COURSE_BACKEND", backend)
    _one_line_error(launch(tmp_path, timeout=120), *needles)


def test_the_device_environment_is_checked_before_the_ranks_start(monkeypatch):
    """No process: environment.device_environment on a node described by monkeypatch (GPUs
    this CPU machine lacks), as tests/test_trainer.py checks --device."""
    from solutions.phase4_production.trainer import environment

    for key in ("COURSE_BACKEND", "CUDA_VISIBLE_DEVICES", "CUBLAS_WORKSPACE_CONFIG", "TORCHELASTIC_USE_AGENT_STORE",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "COURSE_FAULTS", "RANK"):
        monkeypatch.delenv(key, raising=False)
    assert environment.device_environment("auto", 0, 2, False) == [] or not environment.node_gpus()
    monkeypatch.setattr(environment, "node_gpus", lambda: 4)  # a GPU node ...
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # ... whose GPUs a leftover hides
    with pytest.raises(ValueError, match=r"this node has 4 NVIDIA GPU\(s\) and this process sees none "
                                         r"\(CUDA_VISIBLE_DEVICES='' hides them\).*--device cpu"):
        environment.device_environment("auto", 0, 2, False)
    assert environment.device_environment("cpu", 0, 2, False) == []  # on purpose: fine
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ValueError, match="--deterministic: CUBLAS_WORKSPACE_CONFIG=':0:0'"):
        environment.device_environment("cuda", 8, 8, True)
    assert environment.device_environment("cuda", 8, 8, False) == []  # not asked to be deterministic
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setenv("RANK", "0")  # under torchrun: this process is a rank
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    monkeypatch.setattr(environment, "usable_cores", lambda: 16)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    monkeypatch.setenv("COURSE_FAULTS", "rank=0,step=3,phase=forward")
    notes = environment.device_environment("cuda", 8, 8, True)
    assert len(notes) == 4, notes
    assert "8 rank(s) x 8 threads each" in notes[0] and "OMP_NUM_THREADS=2 fits" in notes[0], notes[0]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in notes[1] and "TORCH_NCCL_ASYNC_ERROR_HANDLING=0" in notes[2]
    assert notes[3].startswith("[fault injector] armed by COURSE_FAULTS=rank=0,step=3,phase=forward"), notes[3]


def test_a_bad_deadline_in_the_environment_is_a_warning_not_a_traceback(tmp_path, monkeypatch):
    """COURSE_WORLD_START_TIMEOUT is read when common.launch is imported: a bad value used to be
    a ValueError traceback before the trainer could say anything."""
    monkeypatch.setenv("COURSE_WORLD_START_TIMEOUT", "two minutes")
    proc = launch(tmp_path, "--evaluate", timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "COURSE_WORLD_START_TIMEOUT='two minutes' is not a positive number of seconds: using 120" in proc.stderr


def _returns_its_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def test_the_launchers_deadlines_ignore_a_wall_clock_stepped_forward(monkeypatch):
    """run_world's start-up and run deadlines (the trainer's --timeout without torchrun) are on
    the monotonic clock: the wall clock stepped a day forward (NTP, a resumed VM) just after the
    world starts used to end it at once as "did not start within 120s"."""
    real, calls = time.time, []

    def stepped() -> float:
        calls.append(1)
        return real() + (86400.0 if len(calls) > 1 else 0.0)

    monkeypatch.setattr(time, "time", stepped)
    assert run_world(_returns_its_rank, 2, timeout=120) == [0, 1]


# ---------------------------------------------------------------- the output folder's lease and its clocks


@pytest.fixture
def lease_module(monkeypatch):
    from solutions.phase4_production.trainer import run_folder

    monkeypatch.setattr(run_folder, "HEARTBEAT_S", 0.1)  # the watch of a lease from the future: 1.2 s
    return run_folder


def test_the_writer_lease_is_judged_by_its_process_or_the_file_systems_clock(tmp_path, lease_module, monkeypatch):
    """In this process (WriterLease alone; the trainer takes it as tests/test_trainer.py shows):
    a holder on this host is alive while its process is, whatever the clocks say; a holder on
    another host is judged on the file system's clock, and a heartbeat from the future (a clock
    that went back) is watched before the lease is taken."""
    WriterLease = lease_module.WriterLease
    hour = 3600.0
    # this host, live process, heartbeat an hour old (the clock stepped forward): it used to be taken over
    path = _lease(tmp_path / "stepped")
    os.utime(path, (time.time() - hour, time.time() - hour))
    with pytest.raises(ValueError, match="in use by another run .*its process is running"):
        WriterLease(tmp_path / "stepped").acquire()
    # this host, the pid alive but another process now (the holder died and its pid was reused)
    _lease(tmp_path / "reused", started="1")
    with WriterLease(tmp_path / "reused") as lease:
        assert "its process is gone (pid" in lease.acquire()
    # another host, heartbeat fresh, this node's clock a day ahead: it used to be taken over as silent
    path = _lease(tmp_path / "skewed", host="another-node")
    with monkeypatch.context() as patch:
        patch.setattr(time, "time", lambda real=time.time: real() + 24 * hour)
        with pytest.raises(ValueError, match="in use by another run .*another-node.*heartbeat 0 s ago"):
            WriterLease(tmp_path / "skewed").acquire()
    # another host, heartbeat an hour in the future (its clock went back) and never touched: taken after the watch
    path = _lease(tmp_path / "future", host="another-node")
    os.utime(path, (time.time() + hour, time.time() + hour))
    with WriterLease(tmp_path / "future") as lease:
        note = lease.acquire()
        assert "in the future (a clock that went back) and did not move" in note, note
    # the same lease, its holder alive (touching it, as its heartbeat does): refused
    path = _lease(tmp_path / "future-alive", host="another-node")
    os.utime(path, (time.time() + hour, time.time() + hour))
    stop = threading.Event()
    beat = threading.Thread(target=lambda: [os.utime(path) for _ in iter(lambda: stop.wait(0.05), True)])
    beat.start()
    try:
        with pytest.raises(ValueError, match="in use by another run .*another-node"):
            WriterLease(tmp_path / "future-alive").acquire()
    finally:
        stop.set()
        beat.join()
    assert json.loads(path.read_text())["run_id"] == "another-job"


def test_a_live_runs_lease_with_an_old_heartbeat_is_not_taken_by_the_trainer(tmp_path):
    """The trainer itself, on a folder whose lease this test process holds with a heartbeat an
    hour old (as after a clock stepped forward): refused in one line, the lease left alone."""
    path = _lease(tmp_path)
    os.utime(path, (time.time() - 3600, time.time() - 3600))
    _one_line_error(launch(tmp_path, "--max-steps", "2", timeout=120), "in use by another run",
                    "its process is running")
    assert json.loads(path.read_text())["pid"] == os.getpid() and not (tmp_path / "checkpoints").exists()


# ---------------------------------------------------------------- what the run appends to


def test_a_killed_attempts_records_are_superseded_not_counted_twice(tmp_path):
    """A rank SIGKILLed in step 5 (attempt 0 logged steps 1-4, the newest checkpoint is step 3),
    a kill that cut the file's last line, then the rerun: metrics.jsonl holds each step once, in
    order; the dead attempt's steps 4-5 and the cut line are in metrics.superseded.jsonl. Without
    torchrun both starts are attempt 0, so a reader could not tell the duplicates apart."""
    first = launch(tmp_path, "--log-every", "1", faults="rank=1,step=5,phase=backward")
    # which rank the launcher names first (the killed one, or its peer's reset connection) is a race: not asserted
    assert first.returncode != 0 and "[fault injector] kill at rank=1,step=5" in first.stderr, first.stderr[-3000:]
    assert "[fault injector] armed by COURSE_FAULTS=rank=1,step=5,phase=backward" in first.stderr, first.stderr[-3000:]
    metrics = tmp_path / "metrics.jsonl"
    before = [json.loads(line) for line in metrics.read_text().splitlines()]
    lost = [r for r in before if r["step"] > 3]
    assert lost, f"attempt 0 logged nothing after its last checkpoint: {before}"
    with open(metrics, "a") as f:
        f.write('{"rank": 0, "step": 5, "ti')  # a kill in the middle of a line
    again = launch(tmp_path, "--log-every", "1")
    assert again.returncode == 0 and f"resuming at step 3 of {STEPS}" in again.stdout, again.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "train"] == list(range(1, STEPS + 1)), records
    saves = [r["step"] for r in records if r["event"] == "checkpoint"]
    assert saves == sorted(set(saves)), f"a checkpoint recorded twice: {saves}"
    assert [(r["step"], r["superseded"]) for r in records if r["event"] == "resume"] == [(3, len(lost) + 1)], records
    moved = [json.loads(line) for line in (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()]
    assert moved[:-1] == lost and moved[-1] == {"event": "torn", "text": '{"rank": 0, "step": 5, "ti'}, moved
    assert json.loads((tmp_path / "config.json").read_text())["run"]["output_dir"] == str(tmp_path)
    try:  # TensorBoard, where it is installed (the default --tensorboard writes it then)
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return
    board = EventAccumulator(str(tmp_path / "tensorboard"))
    board.Reload()
    assert [event.step for event in board.Scalars("train/loss")] == list(range(1, STEPS + 1)), \
        "TensorBoard shows the killed attempt's steps after its checkpoint twice"


def test_an_output_file_that_cannot_be_written_is_one_line(tmp_path):
    """metrics.jsonl is a folder here (a full disk or a read-only file take the same path: an
    OSError on a write in the run folder): one line naming it, not a traceback."""
    (tmp_path / "metrics.jsonl").mkdir(parents=True)
    _one_line_error(launch(tmp_path, "--max-steps", "2", timeout=120), f"cannot write {tmp_path / 'metrics.jsonl'}",
                    "Is a directory", "--output-dir")
    assert not list((tmp_path / "checkpoints").glob("step_*")), "a checkpoint written by a run that cannot report"


# ---------------------------------------------------------------- the dataset


def _digits_root(folder: Path, rows: np.ndarray) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(folder / "digits.csv.gz", "wt") as f:
        np.savetxt(f, rows, fmt="%d", delimiter=",")
    return folder


def _bundled_digits() -> np.ndarray:
    from common.data import DATA_DIR, DIGITS_FILE

    return np.loadtxt(DATA_DIR / DIGITS_FILE, delimiter=",", dtype=np.int64)


def _image_folder(root: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    import test_common_data as data_tests  # the tiny real-format writers of the data tests

    data_tests._write_image_folder(root)
    return root


IMAGENET = ("--dataset", "imagenet", "--global-batch", "2", "--image-size", "32", "--epochs", "2")


def test_a_dataset_that_changed_between_two_starts_is_refused(tmp_path):
    """The checkpoint holds each split's fingerprint. A training image renamed between two starts
    (the same number of files: it used to resume silently on another order): one line naming the
    split, before a step is trained; the checkpoint stays."""
    folder = _image_folder(tmp_path / "images")
    run = tmp_path / "imagenet-run"
    assert launch(run, *IMAGENET, "--data-root", str(folder), "--max-steps", "1", timeout=120).returncode == 0
    (folder / "train" / "n01440764" / "train_0.png").rename(folder / "train" / "n01440764" / "train_9.png")
    _one_line_error(launch(run, *IMAGENET, "--data-root", str(folder), timeout=120),
                    "the train split is not the one the checkpoint of step 1 was trained with", "--init-from")
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000000001.pt"]


def test_the_fingerprint_of_digits_is_their_content():
    """No process: the same number of rows with one pixel changed is another dataset (the run
    above shows what the trainer does with one); the same content in another folder is not."""
    import tempfile

    from solutions.phase4_production.trainer import data_checks
    from solutions.phase4_production.trainer.data import build_datasets

    rows = _bundled_digits()
    with tempfile.TemporaryDirectory() as folder:
        same = data_checks.identity(*build_datasets("digits", _digits_root(Path(folder) / "a", rows), None, 0)[:2])
        rows[:, 10] = 16 - rows[:, 10]
        other = data_checks.identity(*build_datasets("digits", _digits_root(Path(folder) / "b", rows), None, 0)[:2])
    bundled = data_checks.identity(*build_datasets("digits", None, None, 0)[:2])
    assert same == bundled and other["train"]["samples"] == bundled["train"]["samples"] == 1437
    with pytest.raises(ValueError, match=r"the train split is not the one the checkpoint of step 7 .*\(1437 samples"):
        data_checks.refuse_changed(bundled, other, 7)
    data_checks.refuse_changed(None, other, 7)  # a checkpoint written before the record: nothing to compare


def test_test_samples_that_are_training_samples_are_left_out_of_the_test_accuracy(tmp_path):
    """A digits file holding every row twice (the split then puts copies of most test rows in the
    training set: the test accuracy measured memory), an ImageFolder whose validation folder holds
    a copy of a training image, one that is a copy of the training folder."""
    from common.data import load_digits

    digits = _digits_root(tmp_path / "twice", np.concatenate([_bundled_digits()] * 2))
    train, test = load_digits("train", digits), load_digits("test", digits)
    seen = {x.numpy().tobytes() for x, _ in train}
    shared = sum(x.numpy().tobytes() in seen for x, _ in test)
    assert 0 < shared < len(test)
    proc = launch(tmp_path / "twice-run", "--data-root", str(digits), "--evaluate", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"note: {shared} of the {len(test)} test samples are byte for byte training samples" in proc.stderr, \
        proc.stderr[-3000:]
    folder = _image_folder(tmp_path / "images")
    shutil.copy(folder / "train" / "n01440764" / "train_1.png", folder / "val" / "n01443537" / "train_1.png")
    from solutions.phase4_production.trainer.data import build_datasets
    from solutions.phase4_production.trainer.data_checks import held_out

    train_set, test_set = build_datasets("imagenet", str(folder), 32, 0)[:2]
    kept = held_out(train_set, test_set, rank=1)  # in this process; the runs say it on rank 0
    assert [test_set.samples[i][0] for i in kept.indices] == \
        [p for p, _ in test_set.samples if not p.endswith("train_1.png")], kept.indices
    shutil.rmtree(folder / "val")
    shutil.copytree(folder / "train", folder / "val")
    _one_line_error(launch(tmp_path / "images-run", *IMAGENET, "--data-root", str(folder), "--evaluate", timeout=120),
                    "every one of the 4 test samples is also a training sample")


def test_imagefolder_splits_are_labelled_by_the_training_splits_class_folders(tmp_path):
    """No process: data.build_datasets on ImageFolder splits whose class folders differ. Each
    split used to number its own folders, so a class missing from val shifted every label after it."""
    from solutions.phase4_production.trainer.data import build_datasets

    folder = _image_folder(tmp_path / "images")
    shutil.rmtree(folder / "val" / "n01440764")
    train, test, _, _ = build_datasets("imagenet", str(folder), 32, 0)
    assert test.targets == [1, 1] and [label for _, label in test] == [1, 1], test.targets
    (folder / "val" / "n09999999").mkdir()
    shutil.copy(folder / "val" / "n01443537" / "val_0.png", folder / "val" / "n09999999" / "val_9.png")
    with pytest.raises(ValueError, match=r"has class folders that .* lacks \(n09999999\)"):
        build_datasets("imagenet", str(folder), 32, 0)


@pytest.mark.parametrize("dataset", ["digits", "cifar10"])
def test_an_unreadable_dataset_file_is_one_line_naming_it(tmp_path, dataset):
    """A truncated digits file, a CIFAR-10 batch that is not a pickle: they used to end in the
    decompressor's or unpickler's traceback."""
    root = tmp_path / "data"
    if dataset == "digits":
        root.mkdir()
        from common.data import DATA_DIR, DIGITS_FILE

        (root / DIGITS_FILE).write_bytes((DATA_DIR / DIGITS_FILE).read_bytes()[:3000])
        flags, needles = (), ["digits.csv.gz is not a readable digits file", "git checkout"]
    else:
        sys.path.insert(0, str(ROOT / "tests"))
        import test_common_data as data_tests

        root.mkdir()
        (data_tests._write_cifar(root, per_batch=4) / "test_batch").write_bytes(b"not a pickle")
        flags, needles = ("--dataset", "cifar10", "--global-batch", "4"), ["cannot be read (test_batch", "extract"]
    _one_line_error(launch(tmp_path / "run", *flags, "--data-root", str(root), timeout=120), *needles)


def test_synthetic_test_images_are_never_training_images():
    """No process: the synthetic test set drew sample i from seed 1_000_003 + i, which is training
    sample 1_000_003 + i of any synthetic set larger than that (a throughput run of ImageNet's size)."""
    from solutions.phase4_production.trainer.data import build_datasets

    train, test, _, _ = build_datasets("synthetic", None, 8, synthetic_size=2_000_000)
    assert not torch.equal(test[0][0], train[1_000_003][0])
