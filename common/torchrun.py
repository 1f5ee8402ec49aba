"""Start real `torchrun` agents from tests and benchmarks, and never leave a process behind.

    port = free_port()
    with Torchrun(timeout=60, env={"PYTHONPATH": root}) as job:
        for node in range(2):
            job.start(multi_node_args(nnodes=2, nproc_per_node=2, port=port, rdzv_id="t")
                      + ["-m", "my.module"])
        agents = job.wait()          # every agent exited 0, or TorchrunError with each output tail
    agents[0].output                 # what agent 0 and its workers printed

Each `start` runs one torchrun agent (`python -m torch.distributed.run`, which is what
the `torchrun` script runs) in its own session, with stdout and stderr in a file. At
the deadline, on an agent that fails, and when the `with` block ends, every process of
the job is killed: the agents, their workers, and whatever those started.

Why not just kill the agent's process group: torch 2.14's agent starts each worker of
`-m module` / `script.py` with `subprocess.Popen(..., start_new_session=True)`
(torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py),
so workers live in sessions and groups of their own, and an agent killed with SIGKILL
leaves them running. So every process of a job carries a marker in its environment
(COURSE_TORCHRUN_JOB=<unique id>, inherited by every child that does not replace its
environment), and killing the job scans /proc for it (Linux). Elsewhere (macOS) the
job kills, before the agents, every descendant it finds through `ps` and each one's
process group. On Linux a small watchdog process also kills the job if this process
dies without cleaning up (killed by a signal, pytest interrupted), or 30 s after the
deadline if nobody called `wait`. `free_port()` asks the OS for a port.

Elastic jobs lose a node on purpose: `agent.kill()` SIGKILLs ONE agent and every process
it started (each agent's processes also carry COURSE_TORCHRUN_AGENT=<job id>.<index>),
while the other agents of the job keep running; `wait` then expects the others to
finish and does not count the killed one as a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

MARKER = "COURSE_TORCHRUN_JOB"
AGENT_MARKER = "COURSE_TORCHRUN_AGENT"  # <job id>.<agent index>: one agent and its workers
_HAS_PROC = Path("/proc/self/environ").exists()
_WATCHDOG_GRACE_S = 30.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on `host` (the OS picks it; nothing holds it afterwards)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_command() -> list[str]:
    """The torchrun of this interpreter: `python -m torch.distributed.run` (the `torchrun`
    console script calls torch.distributed.run.main; this form needs no PATH)."""
    return [sys.executable, "-m", "torch.distributed.run"]


def multi_node_args(nnodes: int, nproc_per_node: int, port: int, rdzv_id: str, host: str = "127.0.0.1") -> list[str]:
    """torchrun flags for one agent of an `nnodes`-node job meeting at a c10d rendezvous on host:port.
    The same flags for every agent: the rendezvous assigns the node ranks (GROUP_RANK)."""
    return [f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={host}:{port}", f"--rdzv-id={rdzv_id}", "--max-restarts=0"]


class TorchrunError(RuntimeError):
    """An agent failed (or the job missed its deadline); the message has each agent's output tail."""

    def __init__(self, summary: str, agents: list["Agent"]):
        self.agents = agents
        tails = "\n".join(f"--- agent {a.index}: {a.describe()} ---\n{a.tail()}" for a in agents)
        super().__init__(f"{summary}\n{tails}")


class TorchrunTimeout(TorchrunError):
    """The job did not finish before its deadline; everything was killed."""


@dataclass
class Agent:
    """One torchrun agent: its command, process and output file."""

    index: int
    args: list[str]
    proc: subprocess.Popen
    log: Path
    killed: bool = field(default=False)
    marker: str = field(default="")  # value of AGENT_MARKER in this agent's processes
    _kept: str | None = field(default=None, repr=False)  # the output, once the job's files are gone

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    @property
    def output(self) -> str:
        """Everything the agent and its workers wrote to stdout and stderr so far."""
        if self._kept is not None:
            return self._kept
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self) -> None:
        """SIGKILL this agent and every process it started (its workers are in sessions of
        their own, so killing the agent alone would leave them running); the job's other
        agents keep running. Returns once none of them is alive."""
        self.killed = True
        doomed = _descendants({self.proc.pid}) if not _HAS_PROC and self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.kill()  # first, so it cannot restart the workers we kill next
        self.proc.wait()
        _kill_pids_and_groups(doomed)
        if _HAS_PROC and self.marker:
            _kill_marked(self.marker, AGENT_MARKER)

    def tail(self, chars: int = 3000) -> str:
        text = self.output
        return text if len(text) <= chars else "..." + text[-chars:]

    def describe(self) -> str:
        code = self.proc.poll()
        state = "running" if code is None else "killed" if self.killed else f"exit code {code}"
        return f"torchrun {' '.join(self.args)} ({state})"


class Torchrun:
    """A job of torchrun agents with one deadline, `timeout` seconds after construction."""

    def __init__(self, timeout: float, env: dict[str, str] | None = None, cwd: str | Path | None = None):
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.env = dict(os.environ, **(env or {}))
        self.job_id = uuid.uuid4().hex
        self.env[MARKER] = self.job_id
        self.cwd = cwd
        self.agents: list[Agent] = []
        self._dir = Path(tempfile.mkdtemp(prefix="course-torchrun-"))
        self._watchdog: subprocess.Popen | None = None

    def __enter__(self) -> "Torchrun":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
        for agent in self.agents:
            agent._kept = agent.output
        shutil.rmtree(self._dir, ignore_errors=True)

    def start(self, torchrun_args: list[str], env: dict[str, str] | None = None) -> Agent:
        """Start one agent: `torchrun <torchrun_args>`, its own session, output to a file."""
        if self._watchdog is None and _HAS_PROC:
            self._watchdog = _start_watchdog(self.job_id, time.time() + self.deadline - time.monotonic())
        index = len(self.agents)
        log = self._dir / f"agent{index}.log"
        with open(log, "wb") as out:
            marker = f"{self.job_id}.{index}"
            proc = subprocess.Popen([*torchrun_command(), *torchrun_args], cwd=self.cwd, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    env=dict(self.env, **(env or {}), **{AGENT_MARKER: marker}),
                                    start_new_session=hasattr(os, "setsid"))
        agent = Agent(index, list(torchrun_args), proc, log, marker=marker)
        self.agents.append(agent)
        return agent

    def wait(self, timeout: float | None = None) -> list[Agent]:
        """Wait until every agent exits; return them. An agent exiting non-zero kills the
        job and raises TorchrunError; the deadline (or `timeout` from now, if sooner)
        kills it and raises TorchrunTimeout. Either way no process of the job is left.
        An agent killed on purpose (`agent.kill()`) is neither waited for nor a failure."""
        deadline = self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout)
        while True:
            failed = [a for a in self.agents if not a.killed and a.returncode not in (None, 0)]
            if failed:
                self.kill()
                raise TorchrunError(f"torchrun agent {failed[0].index} failed ({failed[0].describe()})", self.agents)
            if all(a.killed or a.returncode == 0 for a in self.agents):
                self.kill()  # workers an agent left behind (it does not wait for grandchildren)
                return self.agents
            if time.monotonic() >= deadline:
                self.kill()
                raise TorchrunTimeout(f"torchrun job did not finish within {self.timeout:.0f}s; killed it",
                                      self.agents)
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL every process of the job (agents, workers, their children) and reap the agents."""
        if not _HAS_PROC:
            _kill_pids_and_groups(_descendants({a.proc.pid for a in self.agents if a.proc.poll() is None}))
        for agent in self.agents:
            if agent.proc.poll() is None:
                agent.killed = True
                _kill_group(agent.proc.pid)
                agent.proc.kill()
        if _HAS_PROC:
            _kill_marked(self.job_id)
        for agent in self.agents:
            agent.proc.wait()
        if self._watchdog is not None and self._watchdog.poll() is None:
            self._watchdog.kill()
            self._watchdog.wait()

    def processes(self) -> list[int]:
        """Pids of this job's live processes (Linux: by marker; elsewhere: the agents)."""
        if _HAS_PROC:
            return _marked_pids(self.job_id)
        return [a.proc.pid for a in self.agents if a.proc.poll() is None]



def run_agent(torchrun_args: list[str], *, timeout: float, env: dict[str, str] | None = None,
              cwd: str | Path | None = None) -> tuple[str, int | None]:
    """One torchrun agent run to its end: (its output, its exit code). An agent that fails
    is returned, not raised (callers look at what it printed); missing the deadline raises
    TorchrunTimeout. Raises RuntimeError if any process of the job outlived it."""
    job = Torchrun(timeout=timeout, env=env, cwd=cwd)
    with job:
        agent = job.start(torchrun_args)
        try:
            job.wait()
        except TorchrunTimeout:
            raise
        except TorchrunError:
            pass
        left = job.processes()
    if left:
        raise RuntimeError(f"processes {left} of the torchrun job outlived it")
    return agent.output, agent.returncode


def _kill_group(pid: int) -> None:
    if hasattr(os, "killpg"):
        try:
            os.killpg(pid, signal.SIGKILL)  # the group it leads, if it leads one
        except (ProcessLookupError, PermissionError):
            pass


def _kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _kill_pids_and_groups(pids) -> None:
    """SIGKILL each process and the process group it leads."""
    for pid in pids:
        _kill_group(pid)
        _kill_pid(pid)


def _kill_marked(value: str, variable: str = MARKER, pause_s: float = 0.02) -> None:
    """SIGKILL every live process whose environment holds variable=value. A process may fork
    while we scan, so scan again (up to 50 times, `pause_s` apart) until none is left."""
    for _ in range(50):
        pids = _marked_pids(value, variable)
        if not pids:
            return
        for pid in pids:
            _kill_pid(pid)
        time.sleep(pause_s)


def _marked_pids(job_id: str, variable: str = MARKER) -> list[int]:
    """Live (not zombie) processes whose environment holds variable=job_id."""
    needle = f"{variable}={job_id}".encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes() + b"\0":
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # dead, waiting for its parent to reap it
        except (OSError, IndexError):  # gone, or not ours to read
            continue
        found.append(int(entry.name))
    return found


def _descendants(roots: set[int]) -> list[int]:
    """Every process under `roots` (POSIX `ps`), deepest first."""
    try:
        table = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    children: dict[int, list[int]] = {}
    for line in table.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            children.setdefault(int(parts[1]), []).append(int(parts[0]))
    found, todo = [], list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found[::-1]


def _start_watchdog(job_id: str, deadline_epoch: float) -> subprocess.Popen:
    """A process (not of the job: no marker) that kills the job when this process is gone
    or the deadline is long past; `kill()` ends it when the job ends normally."""
    root = str(Path(__file__).resolve().parent.parent)
    code = (f"import sys; sys.path.insert(0, {root!r}); from common.torchrun import _watch; "
            f"_watch({os.getpid()}, {job_id!r}, {deadline_epoch + _WATCHDOG_GRACE_S!r})")
    env = {k: v for k, v in os.environ.items() if k != MARKER}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def _watch(parent: int, job_id: str, kill_at: float) -> None:
    while time.time() < kill_at and os.getppid() == parent:  # reparented: our parent is gone
        time.sleep(0.5)
    _kill_marked(job_id, pause_s=0.05)
