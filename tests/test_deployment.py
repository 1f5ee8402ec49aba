"""The deployment files launch the trainer's real CLI and validate offline (no docker, no cluster).

Each file's command line is cut into its torchrun part, parsed by torchrun's own parser,
and the trainer's part, parsed by the trainer's (solutions.phase4_production.config). The
files themselves go through the validators the dev extra installs.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from solutions.phase4_production.config import parse_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "solutions" / "phase4_production" / "deployment"
K8S = DEPLOY / "kubernetes"
MODULE = "solutions.phase4_production.train"
STORE_FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def tool(name: str) -> str:
    """A validator's executable (the venv's bin first); fails, never skips, when it is missing."""
    found = Path(sys.executable).parent / name
    path = str(found) if found.exists() else shutil.which(name)
    assert path, f"{name} is not installed: run pip install -e \".[dev]\""
    return path


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool(args[0]), *args[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120)


def check_torchrun_command(argv: list[str]) -> None:
    """`torchrun <args> -m solutions.phase4_production.train <trainer args>` parses with both parsers."""
    from torch.distributed.run import get_args_parser

    assert argv[0] == "torchrun", f"expected a torchrun command, got {argv}"
    parsed = get_args_parser().parse_args(argv[1:])
    assert parsed.module and parsed.training_script == MODULE, f"torchrun does not run -m {MODULE}: {argv}"
    check_trainer_args(parsed.training_script_args)


def check_trainer_args(args: list[str]) -> None:
    try:
        parse_config(args)
    except SystemExit as exc:
        pytest.fail(f"the trainer rejects {args} (exit {exc.code}); see the line above")


def yaml_file(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


# ---------------------------------------------------------------- docker


def test_dockerfile_runs_the_trainer_and_passes_hadolint():
    text = (DEPLOY / "Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    assert cmd[:3] == ["python", "-m", MODULE], cmd
    check_trainer_args(cmd[3:])
    assert re.search(rf"{STORE_FIX}=1", text), f"the image must set {STORE_FIX}=1"
    assert re.search(r"^FROM nvidia/cuda:[\w.]+-cudnn-runtime-", text, re.M), "a pinned CUDA runtime base"
    proc = run_tool("hadolint", str(DEPLOY / "Dockerfile"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_runs_two_nodes_of_the_trainer_and_validates():
    compose = yaml_file(DEPLOY / "docker-compose.yaml")
    services = compose["services"]
    assert len(services) == 2, list(services)
    for name, service in services.items():
        check_torchrun_command(service["command"])
        assert "--nnodes=2" in service["command"] and "--rdzv-backend=c10d" in service["command"], name
        assert service["environment"][STORE_FIX] == "1", name
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
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    check_torchrun_command(container["command"] + container.get("args", []))
    assert env_of(container)[STORE_FIX] == "1"
    assert any(m["mountPath"] == "/checkpoints" for m in container["volumeMounts"])
    assert_matches_crd("pytorchjob.schema.json", job, ("spec", "elasticPolicy"), "maxReplicas")


def test_trainjob_runs_the_trainer_and_matches_the_crd():
    job = yaml_file(K8S / "trainjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    trainer = job["spec"]["trainer"]
    check_torchrun_command(trainer["command"] + trainer.get("args", []))
    assert env_of(trainer)[STORE_FIX] == "1"
    assert_matches_crd("trainjob.schema.json", job, ("spec", "trainer"), "numNodes")


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
    text = (DEPLOY / "slurm" / "train.sbatch").read_text()
    for directive in ("--requeue", "--signal=B:TERM@", "--ntasks-per-node=1"):
        assert f"#SBATCH {directive}" in text, f"missing #SBATCH {directive}"
    assert "scontrol requeue" in text and re.search(r"^trap \w+ TERM$", text, re.M), "no requeue on SIGTERM"
    assert f"export {STORE_FIX}=1" in text
    joined = text.replace("\\\n", " ")
    line = next(line for line in joined.splitlines() if line.startswith("srun "))
    words = shlex.split(re.sub(r"\$\{?(\w+)\}?", lambda m: f"X{m.group(1)}", line.rstrip("& ")))
    words = [w.replace("XSLURM_NNODES", "2") for w in words]
    check_torchrun_command(words[words.index("torchrun"):])
    proc = run_tool("shellcheck", str(DEPLOY / "slurm" / "train.sbatch"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


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
