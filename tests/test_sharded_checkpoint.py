"""The trainer's sharded checkpoints (solutions/phase4_production/trainer/sharded_checkpoint.py) on
FSDP2 models, gloo on CPU: each rank writes about 1/N of the bytes, a folder is trusted only
once committed, a corrupt one is set aside, a checkpoint of 2 ranks resumes on 1 and 3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from common.launch import run_world
from compare import assert_no_problems, diff_report

HIDDEN = 64


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.LayerNorm(HIDDEN), nn.ReLU())
                                      for _ in range(4)])  # where trainer.parallel.fsdp_units finds a ViT's blocks

    def forward(self, x):
        return self.layers(x)


class _Model(nn.Module):
    """A ViT-like stack: 4 blocks (each an FSDP unit) between a stem and a head."""

    def __init__(self):
        super().__init__()
        self.stem, self.encoder, self.head = nn.Linear(8, HIDDEN), _Encoder(), nn.Linear(HIDDEN, 5)

    def forward(self, x):
        return self.head(self.encoder(self.stem(x)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Model()


def _setup(kind: str = "fsdp"):
    from solutions.phase4_production.trainer.parallel import wrap_model

    model = _model()
    parallel = wrap_model(model, kind, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
    return parallel, optimizer, scheduler


def _train(parallel, optimizer, scheduler, steps: int, seed: int) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 100 + step * 10 + dist.get_rank())
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 5, (6,), generator=g)
        nn.functional.cross_entropy(parallel.net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def _save_then(folder: str, steps_before: int, steps_after: int) -> dict:
    """Train, save at `steps_before`, train on; return the full weights at both points and what
    each rank wrote."""
    from solutions.phase4_production.trainer.sharded_checkpoint import ShardedCheckpoints

    parallel, optimizer, scheduler = _setup()
    _train(parallel, optimizer, scheduler, steps_before, seed=1)
    store = ShardedCheckpoints(folder, keep=2)
    saved_at = parallel.full_state_dict()
    path = store.save(steps_before, parallel.module, optimizer, scheduler, progress={"step": steps_before})
    torch.manual_seed(1234 + dist.get_rank())  # RNG state at the save: the resumed run must get it back
    draw = torch.rand(3)
    _train(parallel, optimizer, scheduler, steps_after, seed=2)
    return {"path": str(path) if path else None, "saved": saved_at, "after": parallel.full_state_dict(),
            "draw": draw, "lr": scheduler.get_last_lr()}


def _resume(folder: str, steps_after: int) -> dict:
    from solutions.phase4_production.trainer.sharded_checkpoint import ShardedCheckpoints

    parallel, optimizer, scheduler = _setup()
    torch.manual_seed(99)  # anything: the checkpoint's RNG must replace it
    progress = ShardedCheckpoints(folder, keep=2).load_latest(parallel.module, optimizer, scheduler)
    loaded = parallel.full_state_dict()
    _train(parallel, optimizer, scheduler, steps_after, seed=2)
    return {"progress": progress, "loaded": loaded, "after": parallel.full_state_dict(),
            "lr": scheduler.get_last_lr()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[dict]]:
    folder = tmp_path_factory.mktemp("sharded") / "checkpoints"
    return folder, run_world(_save_then, 2, args=(str(folder), 3, 2))


def test_a_sharded_checkpoint_is_one_committed_folder_and_each_rank_writes_its_half(saved):
    folder, results = saved
    assert results[0]["path"] == str(folder / "step_000000003") and results[1]["path"] is None
    assert sorted(p.name for p in folder.iterdir()) == ["step_000000003"], "nothing but the committed folder"
    manifest = json.loads((folder / "step_000000003" / "COMMITTED").read_text())
    assert manifest["world_size"] == 2 and manifest["step"] == 3
    assert set(manifest["files"]) == {p.name for p in (folder / "step_000000003").iterdir()} - {"COMMITTED"}
    shards = {name: size for name, (size, _) in manifest["files"].items() if name.endswith(".distcp")}
    assert len(shards) == 2, f"one file of shards per rank, got {sorted(shards)}"
    total = sum(shards.values())
    for name, size in shards.items():
        assert 0.35 * total < size < 0.65 * total, \
            f"{name} holds {size} of the {total} bytes of shards: each of 2 ranks should write about half"


def test_a_sharded_checkpoint_resumes_bit_identically_at_the_same_world_size(saved):
    folder, before = saved
    after = run_world(_resume, 2, args=(str(folder), 2))
    assert after[0]["progress"]["step"] == 3
    problems = [diff_report(after[0]["loaded"][k], before[0]["saved"][k], f"loaded {k}", rtol=0, atol=0)
                for k in before[0]["saved"]]
    problems += [diff_report(after[0]["after"][k], before[0]["after"][k], f"2 steps after the resume: {k}", rtol=0, atol=0)
                 for k in before[0]["after"]]
    assert_no_problems([p for p in problems if p])
    assert after[0]["lr"] == before[0]["lr"], "the LR scheduler did not resume"


@pytest.mark.parametrize("world", [1, 3])
def test_a_sharded_checkpoint_of_2_ranks_resumes_on_1_and_3(saved, world):
    folder, before = saved
    after = run_world(_resume, world, args=(str(folder), 0))
    problems = [diff_report(after[0]["loaded"][k], before[0]["saved"][k], f"loaded into {world} rank(s): {k}",
                            rtol=0, atol=0) for k in before[0]["saved"]]
    assert_no_problems([p for p in problems if p])
    assert all(r["progress"]["step"] == 3 for r in after)


def _save_killed(folder: str, rank: int) -> None:
    """`rank` dies as the save of step 2 begins writing."""
    from solutions.phase4_production.recovery import FaultInjector
    from solutions.phase4_production.trainer.sharded_checkpoint import ShardedCheckpoints

    parallel, optimizer, scheduler = _setup()
    store = ShardedCheckpoints(folder, keep=2)
    store.save(1, parallel.module, optimizer, scheduler, progress={"step": 1})
    faults = FaultInjector.from_string(f"rank={rank},step=2,phase=save")
    faults.begin_step(2)
    store.save(2, parallel.module, optimizer, scheduler, progress={"step": 2}, faults=faults)


def _resume_step(folder: str) -> int | None:
    from solutions.phase4_production.trainer.sharded_checkpoint import ShardedCheckpoints

    parallel, optimizer, scheduler = _setup()
    progress = ShardedCheckpoints(folder).load_latest(parallel.module, optimizer, scheduler)
    return None if progress is None else progress["step"]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_kill_during_a_save_leaves_no_folder_that_is_trusted(tmp_path, rank):
    from common.launch import WorldError

    folder = tmp_path / "checkpoints"
    with pytest.raises(WorldError):
        run_world(_save_killed, 2, args=(str(folder), rank), timeout=60)
    names = sorted(p.name for p in folder.iterdir())
    assert names == [".step_000000002.tmp", "step_000000001"], names
    assert run_world(_resume_step, 2, args=(str(folder),)) == [1, 1]


def test_a_corrupt_folder_is_set_aside_and_an_older_one_resumed(tmp_path):
    folder = tmp_path / "checkpoints"
    run_world(_save_then, 2, args=(str(folder), 1, 0))
    run_world(_save_then, 2, args=(str(folder), 2, 0))  # a fresh run into the same folder: steps 1 and 2
    shard = next((folder / "step_000000002").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert run_world(_resume_step, 2, args=(str(folder),)) == [1, 1]
    assert (folder / "step_000000002.corrupt").is_dir() and not (folder / "step_000000002").exists()


def test_keep_prunes_whole_folders(tmp_path):
    folder = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        run_world(_save_then, 2, args=(str(folder), step, 0))
    assert sorted(p.name for p in folder.iterdir()) == ["step_000000002", "step_000000003"]
