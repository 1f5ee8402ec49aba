"""The deployment files launch the trainer's real CLI, agree with it, and validate offline (no docker, no cluster).

Each file's command line is cut into its torchrun part, parsed by torchrun's own parser (with the
PET_* variables the Kubernetes operators set), and the trainer's part, parsed by the trainer's
(solutions.phase4_production.trainer.config). From each launch the tests derive what the cluster will do
with it: every world size it can reach (each must split the recipe's global batch), the time
between the stop signal and SIGKILL (torchrun's --shutdown-timeout must end inside it), the
environment of the ranks (NCCL watchdog and flight recorder; every name must be one torch reads)
and the CPUs per node (enough for the loader workers). The files themselves go through the
validators the dev extra installs.
"""

from __future__ import annotations

import argparse
import copy
import json
import mmap
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pytest
import yaml

from solutions.phase4_production.trainer.config import TrainConfig, parse_config
from solutions.phase4_production.elastic import plan_batches

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "solutions" / "phase4_production" / "deployment"
K8S = DEPLOY / "kubernetes"
MODULE = "solutions.phase4_production.train"
STORE_FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

# Seconds from the stop signal to SIGKILL where a file cannot set it: `docker stop` and
# `docker run --stop-timeout` default to 10 (an image cannot change it); a pod's
# terminationGracePeriodSeconds defaults to 30.
DOCKER_STOP_TIMEOUT_S = 10
K8S_DEFAULT_GRACE_S = 30
# What torchrun needs after its --shutdown-timeout: SIGKILL the ranks that are left, reap them
# and exit (well under a second when the ranks are gone; the cluster files leave 30 s, which
# also covers SLURM's requeue). More than MAX_UNUSED_S of the grace left unused is grace wasted:
# the preemption budget is min(grace, --shutdown-timeout).
AGENT_MARGIN_S = 2
MAX_UNUSED_S = 30

# The NCCL watchdog, async error handling and flight recorder, set by every launch file.
NCCL_FLAGS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
              "TORCH_NCCL_ENABLE_MONITORING": "1"}
# The flight recorder's size under torch 2.14's name (TORCH_NCCL_TRACE_BUFFER_SIZE is the deprecated one: it warns).
NCCL_COUNTS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")
FR_DUMP_FILE = "TORCH_FR_DUMP_TEMP_FILE"


def tool(name: str) -> str:
    """A validator's executable (the venv's bin first); fails, never skips, when it is missing."""
    found = Path(sys.executable).parent / name
    path = str(found) if found.exists() else shutil.which(name)
    assert path, f"{name} is not installed: run pip install -e \".[dev]\""
    return path


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool(args[0]), *args[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120)


def parse_torchrun(argv: list[str], pet: dict | None = None) -> argparse.Namespace:
    """torchrun's own parse of `torchrun <args> -m solutions.phase4_production.train <trainer args>`,
    with the PET_* variables an operator sets (`pet`, without the prefix) and no others; the
    trainer's part must parse with the trainer's parser."""
    from torch.distributed.run import get_args_parser

    assert argv[0] == "torchrun", f"expected a torchrun command, got {argv}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env.update({f"PET_{k}": str(v) for k, v in (pet or {}).items()})
    with mock.patch.dict(os.environ, env, clear=True):  # torchrun reads PET_* when it builds its parser
        parsed = get_args_parser().parse_args(argv[1:])
    assert parsed.module and parsed.training_script == MODULE, f"torchrun does not run -m {MODULE}: {argv}"
    check_trainer_args(parsed.training_script_args)
    return parsed


def check_trainer_args(args: list[str]) -> TrainConfig:
    try:
        return parse_config(args, check_paths=False)  # paths of the cluster, not of this machine
    except SystemExit as exc:
        pytest.fail(f"the trainer rejects {args} (exit {exc.code}); see the line above")


def yaml_file(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def cpu_quantity(value) -> float:
    """A Kubernetes CPU quantity ("88", 88, "87500m") in CPUs."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def duration_s(value: str) -> float:
    """A compose duration ("120s", "2m", "1m30s") in seconds."""
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+)s)?", str(value))
    assert match and any(match.groups()), f"cannot read the duration {value!r}"
    hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return hours * 3600 + minutes * 60 + seconds


# ---------------------------------------------------------------- every launch, as the cluster sees it


@dataclass
class Launch:
    """One way a deployment file starts torchrun."""

    name: str
    torchrun: argparse.Namespace   # torchrun's parse, PET_* variables applied
    node_counts: range             # every number of nodes (torchrun agents) the file lets it run on
    grace_s: float                 # from the stop signal the file's scheduler sends to its SIGKILL
    env: dict = field(default_factory=dict)  # what the file puts in the ranks' environment
    cpus_per_node: float | None = None       # CPUs reserved per node (None: the file reserves none)

    @property
    def config(self) -> TrainConfig:
        return check_trainer_args(self.torchrun.training_script_args)

    @property
    def nproc(self) -> int:
        nproc = str(self.torchrun.nproc_per_node)
        assert nproc.isdigit(), f"{self.name}: --nproc-per-node={nproc} makes the world size depend on the machine"
        return int(nproc)

    @property
    def world_sizes(self) -> list[int]:
        return [nodes * self.nproc for nodes in self.node_counts]


def torchrun_nodes(parsed: argparse.Namespace) -> range:
    from torch.distributed.run import parse_min_max_nnodes

    low, high = parse_min_max_nnodes(str(parsed.nnodes))
    return range(low, high + 1)


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each logical line of the Dockerfile."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def image_env() -> dict:
    env = {}
    for instruction, args in dockerfile_instructions():
        if instruction == "ENV":
            env.update(word.split("=", 1) for word in shlex.split(args))
    return env


def dockerfile_launch() -> Launch:
    cmd = json.loads(next(args for instruction, args in dockerfile_instructions() if instruction == "CMD"))
    parsed = parse_torchrun(cmd)
    return Launch("Dockerfile", parsed, torchrun_nodes(parsed), DOCKER_STOP_TIMEOUT_S, image_env())


def compose_launch(service_name: str) -> Launch:
    service = yaml_file(DEPLOY / "docker-compose.yaml")["services"][service_name]
    parsed = parse_torchrun(service["command"])
    env = {**image_env(), **{k: str(v) for k, v in service.get("environment", {}).items()}}
    grace = duration_s(service.get("stop_grace_period", f"{DOCKER_STOP_TIMEOUT_S}s"))
    return Launch(f"docker-compose.yaml:{service_name}", parsed, torchrun_nodes(parsed), grace, env)


def pytorchjob_launch() -> Launch:
    spec = yaml_file(K8S / "pytorchjob-elastic.yaml")["spec"]
    policy = spec["elasticPolicy"]
    pod = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    container = pod["containers"][0]
    # Training Operator v1 (elastic): PET_NNODES=min:max, PET_NPROC_PER_NODE, PET_MAX_RESTARTS, rendezvous
    pet = {"NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}", "NPROC_PER_NODE": spec["nprocPerNode"],
           "MAX_RESTARTS": policy["maxRestarts"], "RDZV_BACKEND": policy["rdzvBackend"]}
    parsed = parse_torchrun(container["command"] + container.get("args", []), pet)
    cpus = container.get("resources", {}).get("requests", {}).get("cpu")
    return Launch("kubernetes/pytorchjob-elastic.yaml", parsed, torchrun_nodes(parsed),
                  pod.get("terminationGracePeriodSeconds", K8S_DEFAULT_GRACE_S), env_of(container),
                  None if cpus is None else cpu_quantity(cpus))


def trainjob_pod_patch(job: dict) -> dict:
    """The pod spec the TrainJob patches into the runtime's `node` replicated job."""
    for patch in job["spec"].get("runtimePatches", []):
        for replicated in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            if replicated["name"] == "node":
                return replicated["template"]["spec"]["template"]["spec"]
    return {}


def trainjob_launch() -> Launch:
    job = yaml_file(K8S / "trainjob.yaml")
    trainer = job["spec"]["trainer"]
    # Trainer v2's torch plugin: PET_NNODES=numNodes, PET_NPROC_PER_NODE=numProcPerNode (+ master address)
    pet = {"NNODES": trainer["numNodes"], "NPROC_PER_NODE": trainer["numProcPerNode"]}
    parsed = parse_torchrun(trainer["command"] + trainer.get("args", []), pet)
    cpus = trainer.get("resourcesPerNode", {}).get("requests", {}).get("cpu")
    return Launch("kubernetes/trainjob.yaml", parsed, torchrun_nodes(parsed),
                  trainjob_pod_patch(job).get("terminationGracePeriodSeconds", K8S_DEFAULT_GRACE_S),
                  env_of(trainer), None if cpus is None else cpu_quantity(cpus))


def sbatch_text() -> str:
    return (DEPLOY / "slurm" / "train.sbatch").read_text()


def sbatch_directives() -> dict:
    return dict(re.findall(r"^#SBATCH (--[\w-]+)(?:=(\S*))?", sbatch_text(), re.M))


def sbatch_launch() -> Launch:
    text, directives = sbatch_text(), sbatch_directives()
    low, high = re.fullmatch(r"(\d+)(?:-(\d+))?", directives["--nodes"]).groups()
    nodes = range(int(low), int(high or low) + 1)
    line = next(line for line in text.replace("\\\n", " ").splitlines() if line.startswith("srun "))
    words = shlex.split(re.sub(r"\$\{?(\w+)\}?", lambda m: f"X{m.group(1)}", line.rstrip("& ")))
    words = [w.replace("XSLURM_NNODES", str(nodes.start)) for w in words]  # torchrun gets the allocated count
    parsed = parse_torchrun(words[words.index("torchrun"):])
    assert torchrun_nodes(parsed) == range(nodes.start, nodes.start + 1), "torchrun must get --nnodes=$SLURM_NNODES"
    grace = int(re.fullmatch(r"B:TERM@(\d+)", directives["--signal"]).group(1))
    env = dict(re.findall(r"^export (\w+)=(\S+)$", text, re.M))
    cpus = int(directives["--cpus-per-task"]) * int(directives["--ntasks-per-node"])
    return Launch("slurm/train.sbatch", parsed, nodes, grace, env, cpus)


LAUNCHES = {
    "Dockerfile": dockerfile_launch,
    "docker-compose.yaml:node0": lambda: compose_launch("node0"),
    "docker-compose.yaml:node1": lambda: compose_launch("node1"),
    "kubernetes/pytorchjob-elastic.yaml": pytorchjob_launch,
    "kubernetes/trainjob.yaml": trainjob_launch,
    "slurm/train.sbatch": sbatch_launch,
}
CLUSTER_LAUNCHES = ["kubernetes/pytorchjob-elastic.yaml", "kubernetes/trainjob.yaml", "slurm/train.sbatch"]


def test_every_file_that_launches_the_trainer_is_checked_here():
    launching = {str(path.relative_to(DEPLOY)) for path in DEPLOY.rglob("*")
                 if path.is_file() and path.suffix != ".md" and MODULE in path.read_text(errors="ignore")}
    checked = {name.split(":")[0] for name in LAUNCHES}
    assert launching == checked, f"launch files not in LAUNCHES: {sorted(launching - checked)}"
    services = yaml_file(DEPLOY / "docker-compose.yaml")["services"]
    assert {f"docker-compose.yaml:{name}" for name in services} <= set(LAUNCHES), sorted(services)


@pytest.mark.parametrize("name", LAUNCHES)
def test_every_world_size_a_file_can_reach_splits_its_global_batch(name):
    """Shares may differ by a sample, but plan_batches refuses a world with more ranks than the
    global batch has samples, or shares too small for the micro-batches; the trainer would stop
    at start, every attempt at that size, until the restarts run out."""
    launch = LAUNCHES[name]()
    cfg = launch.config
    refused = []
    for world in launch.world_sizes:
        try:
            plan_batches(cfg.data.global_batch, world, cfg.data.micro_batch or cfg.data.global_batch)
        except ValueError as exc:
            refused.append(f"{world} ranks: {exc}")
    assert not refused, (f"{name} can run on {list(launch.node_counts)} nodes x {launch.nproc} ranks, but the "
                         f"trainer refuses " + "; ".join(refused))


@pytest.mark.parametrize("name", LAUNCHES)
def test_torchrun_stops_the_ranks_inside_the_grace_period(name):
    """The preemption budget is min(grace, --shutdown-timeout): torchrun SIGKILLs the ranks after
    its shutdown timeout (default 30 s), the scheduler kills everything after its grace. The
    timeout must end first, with time left for the agent to exit."""
    launch = LAUNCHES[name]()
    timeout = launch.torchrun.shutdown_timeout
    if timeout is None:
        timeout = int(launch.env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30))
    assert timeout + AGENT_MARGIN_S <= launch.grace_s, (
        f"{name}: torchrun --shutdown-timeout={timeout} s, but the scheduler kills after {launch.grace_s} s")
    assert launch.grace_s - timeout <= MAX_UNUSED_S, (
        f"{name}: the scheduler gives {launch.grace_s} s, but torchrun kills the ranks after {timeout} s: "
        "raise --shutdown-timeout")


@pytest.mark.parametrize("name", LAUNCHES)
def test_the_nccl_watchdog_and_flight_recorder_are_set(name):
    launch = LAUNCHES[name]()
    env = launch.env
    assert env.get(STORE_FIX) == "1", f"{name} must set {STORE_FIX}=1"
    wrong = {k: env.get(k) for k, v in NCCL_FLAGS.items() if env.get(k) != v}
    assert not wrong, f"{name}: expected {NCCL_FLAGS}, got {wrong}"
    for key in NCCL_COUNTS:
        assert str(env.get(key, "")).isdigit() and int(env[key]) > 0, f"{name}: {key}={env.get(key)}"
    output_dir = launch.config.run.output_dir.rstrip("/")
    assert str(env.get(FR_DUMP_FILE, "")).startswith(output_dir + "/"), (
        f"{name}: {FR_DUMP_FILE}={env.get(FR_DUMP_FILE)} should put the traces in the output folder {output_dir}")


def _torch_sources_containing(names: set[str]) -> set[str]:
    """The names found in the installed torch: its Python files and distributed headers (quoted)
    or its libraries' string tables (NUL-terminated)."""
    import torch

    root = Path(torch.__file__).resolve().parent
    found: set[str] = set()
    texts = [*root.glob("distributed/**/*.py"), *root.glob("include/torch/csrc/distributed/**/*.hpp")]
    for path in texts:
        text = path.read_bytes()
        found |= {n for n in names - found if f'"{n}"'.encode() in text}
    for library in root.glob("lib/*torch*"):
        if names <= found or not library.is_file() or library.stat().st_size == 0:
            continue
        with library.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            found |= {n for n in names - found if data.find(n.encode() + b"\0") >= 0}
    return found


def test_torch_reads_every_variable_the_launch_files_set():
    names = {key for make in LAUNCHES.values() for key in make().env if key.startswith("TORCH_")}
    assert set(NCCL_FLAGS) | set(NCCL_COUNTS) | {FR_DUMP_FILE, STORE_FIX} <= names
    unknown = names - _torch_sources_containing(names)
    assert not unknown, f"the installed torch never reads {sorted(unknown)}: a misspelled or retired name"


@pytest.mark.parametrize("name", CLUSTER_LAUNCHES)
def test_each_node_reserves_a_cpu_per_rank_and_per_loader_worker(name):
    launch = LAUNCHES[name]()
    need = launch.nproc * (launch.config.data.workers + 1)
    assert launch.cpus_per_node is not None and launch.cpus_per_node >= need, (
        f"{name}: {launch.nproc} ranks x ({launch.config.data.workers} loader workers + 1) need {need} CPUs per node, "
        f"it reserves {launch.cpus_per_node}")


# ---------------------------------------------------------------- docker


def pinned(package: str):
    """The version specifier pyproject.toml gives `package`."""
    from packaging.requirements import Requirement

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    for dependency in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        requirement = Requirement(dependency)
        if requirement.name == package:
            return requirement.specifier
    pytest.fail(f"pyproject.toml does not pin {package}")


def test_dockerfile_runs_torchrun_on_the_pinned_torch_and_passes_hadolint():
    instructions = dockerfile_instructions()
    base = next(args for instruction, args in instructions if instruction == "FROM")
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-runtime", base)
    assert match, f"base the image on an official PyTorch CUDA runtime tag, not {base}"
    torch_version = match.group(1)
    assert pinned("torch").contains(torch_version), f"the image's torch {torch_version} is outside pyproject's {pinned('torch')}"
    install = " ".join(args for instruction, args in instructions if instruction == "RUN" and "pip install" in args)
    assert f'"torch=={torch_version}"' in install, "pip must keep the image's torch (pin torch==<the tag's version>)"
    assert dockerfile_launch().torchrun.standalone, "the default command is a one-machine torchrun"
    proc = run_tool("hadolint", str(DEPLOY / "Dockerfile"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_runs_two_nodes_of_the_trainer_and_validates():
    compose = yaml_file(DEPLOY / "docker-compose.yaml")
    services = compose["services"]
    assert len(services) == 2, list(services)
    for name, service in services.items():
        parsed = parse_torchrun(service["command"])
        assert parsed.nnodes == "2" and parsed.rdzv_backend == "c10d", name
        assert any(v.startswith("checkpoints:") for v in service["volumes"]), f"{name}: no shared checkpoint volume"
    proc = run_tool("check-jsonschema", "--builtin-schema", "vendor.compose-spec", str(DEPLOY / "docker-compose.yaml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------- kubernetes


def _schema_errors(schema_name: str, document: dict) -> list[str]:
    import jsonschema

    schema = json.loads((K8S / "schemas" / schema_name).read_text())
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in jsonschema.Draft7Validator(schema).iter_errors(document)]


def assert_matches_crd(schema_name: str, job: dict, section: tuple[str, ...], field: str) -> None:
    """The job validates against the schema derived from its CRD, and a copy whose `field`
    (under the keys `section`) lost its last letter does not: the schema is closed."""
    assert _schema_errors(schema_name, job) == []
    typo = copy.deepcopy(job)
    parent = typo
    for key in section:
        parent = parent[key]
    parent[field[:-1]] = parent.pop(field)
    assert any(field[:-1] in e for e in _schema_errors(schema_name, typo)), "the schema must reject a misspelled field"


def test_pytorchjob_is_elastic_runs_the_trainer_and_matches_the_crd():
    job = yaml_file(K8S / "pytorchjob-elastic.yaml")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    policy = job["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] == "c10d" and policy["minReplicas"] < policy["maxReplicas"], policy
    assert policy["maxRestarts"] >= 1, policy
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    container = pod["containers"][0]
    assert any(m["mountPath"] == "/checkpoints" for m in container["volumeMounts"])
    assert any(m["mountPath"] == "/dev/shm" for m in container["volumeMounts"]), "loader workers need /dev/shm"
    assert "terminationGracePeriodSeconds" in pod, "say how long a preempted pod has to checkpoint"
    assert_matches_crd("pytorchjob.schema.json", job, ("spec", "elasticPolicy"), "maxReplicas")


def test_trainjob_runs_the_trainer_and_matches_the_crd():
    job = yaml_file(K8S / "trainjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    pod = trainjob_pod_patch(job)
    assert "terminationGracePeriodSeconds" in pod, "say how long a preempted pod has to checkpoint"
    mounts = {m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
    assert {"/checkpoints", "/dev/shm"} <= mounts, mounts
    assert_matches_crd("trainjob.schema.json", job, ("spec", "trainer"), "numNodes")


def test_trainjob_restarts_come_from_the_runtime_and_the_readme_says_how():
    """TrainJob v1alpha1 patches only pod-level fields of the runtime's JobSet: a JobSet
    failurePolicy (restarts when a node is lost) cannot be set from the job, so the README must
    tell the cluster admin to put it in the runtime."""
    job = yaml_file(K8S / "trainjob.yaml")
    patched = copy.deepcopy(job)
    patched["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["failurePolicy"] = {"maxRestarts": 3}
    assert _schema_errors("trainjob.schema.json", patched), (
        "the TrainJob CRD now accepts a JobSet failurePolicy in runtimePatches: set the restarts in trainjob.yaml")
    readme = (DEPLOY / "README.md").read_text()
    assert "failurePolicy" in readme and "maxRestarts" in readme, "the README must say where the restarts come from"


def test_checkpoint_volume_claim_is_valid_kubernetes():
    claim = yaml_file(K8S / "pvc.yaml")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "every pod mounts the checkpoints"
    names = {v["persistentVolumeClaim"]["claimName"]
             for v in yaml_file(K8S / "pytorchjob-elastic.yaml")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
             ["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert claim["metadata"]["name"] in names, names
    proc = run_tool("kubernetes-validate", "--strict", str(K8S / "pvc.yaml"))
    assert proc.returncode == 0 and "passed" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


# ---------------------------------------------------------------- slurm, terraform


def test_sbatch_runs_srun_torchrun_requeues_and_passes_shellcheck():
    text, directives = sbatch_text(), sbatch_directives()
    for directive in ("--requeue", "--signal", "--ntasks-per-node"):
        assert directive in directives, f"missing #SBATCH {directive}"
    assert directives["--ntasks-per-node"] == "1", "one torchrun agent per node"
    assert "scontrol requeue" in text and re.search(r"^trap \w+ TERM$", text, re.M), "no requeue on SIGTERM"
    sbatch_launch()  # torchrun and trainer parse
    proc = run_tool("shellcheck", str(DEPLOY / "slurm" / "train.sbatch"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_sbatch_log_opens_in_a_fresh_clone():
    """SLURM opens --output (and --error) before the script runs: a folder that a fresh clone
    lacks (runs/ is git-ignored) fails the job before it starts."""
    directives = sbatch_directives()
    for key in ("--output", "--error"):
        if key in directives:
            assert "/" not in directives[key], f"#SBATCH {key}={directives[key]}: write the log in the submit folder"


def test_terraform_parses_and_has_a_gpu_node_group_and_shared_storage():
    import hcl2

    blocks: dict = {}
    for path in sorted((DEPLOY / "terraform").glob("*.tf")):
        for kind, items in hcl2.load(path.open()).items():
            blocks.setdefault(kind, []).extend(items if isinstance(items, list) else [items])
    unquote = lambda name: name.strip('"')  # noqa: E731 - python-hcl2 8 keeps the quotes
    resources = {unquote(kind): {unquote(n): body for n, body in named.items()}
                 for block in blocks["resource"] for kind, named in block.items()}
    group = resources["aws_eks_node_group"]["gpu"]
    assert "NVIDIA" in unquote(group["ami_type"]), group["ami_type"]
    assert {"aws_efs_file_system", "aws_efs_mount_target"} <= set(resources), sorted(resources)
    variables = {unquote(name): body for block in blocks["variable"] for name, body in block.items()}
    assert re.match(r"p\d", unquote(variables["instance_type"]["default"])), "the default instance has GPUs"
    outputs = {unquote(name) for block in blocks["output"] for name in block}
    assert {"node_group", "efs_file_system_id"} <= outputs, outputs
    assert "terraform destroy" in (DEPLOY / "README.md").read_text(), "the README must say how to stop paying"
