"""The GPU suite: what only a CUDA GPU can show. One command, on a machine with a GPU:

    pytest -m gpu                                   # these tests (2.5 minutes on one H100, the report's own test aside)
    python benchmarks/gpu_report.py --json gpu.json # the numbers: trainer vs bare loop, MFU, loader, fsdp

Plain `pytest` (and so CI) never runs them: conftest.py skips every test marked `gpu` unless
`-m gpu` is given, and without CUDA they skip anyway. Each test uses one GPU (a world of one
rank on NCCL: two ranks cannot share a GPU under NCCL). Last run of these tests: one H100,
2026-11-26; of the report: one H200, 2026-11-28 (solutions/phase4_production/README.md, "The GPU
suite")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.launch import run_world
from common.torchrun import run_agent

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parent.parent
MODULE = "solutions.phase4_production.train"
NCCL = {"COURSE_BACKEND": "nccl"}  # conftest pins gloo for the graded CPU tests
ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "COURSE_BACKEND": "nccl",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
FINGERPRINT = re.compile(r"^final weights sha256: ([0-9a-f]{64})$", re.M)
SMALL = ["--dataset", "synthetic", "--image-size", "64", "--synthetic-size", "2048", "--model", "resnet18",
         "--global-batch", "64", "--epochs", "1", "--checkpoint-every", "5", "--progress", "false"]


def _torchrun(out: Path, *extra: str, restarts: int = 0) -> tuple[str, int]:
    return run_agent(["--standalone", "--nproc-per-node=1", f"--max-restarts={restarts}", "-m", MODULE,
                      "--output-dir", str(out), *SMALL, *extra], timeout=600, env=ENV, cwd=ROOT)


def test_the_trainer_on_one_gpu_with_nccl_bf16_channels_last_and_compile(tmp_path):
    output, code = _torchrun(tmp_path, "--amp", "bf16", "--channels-last", "on", "--compile", "--max-steps", "20",
                             "--log-every", "5")
    assert code == 0, output[-4000:]
    assert "rank 0 of 1 on cuda:0" in output, output[-4000:]
    assert re.search(r"test accuracy \d+\.\d+% after \d+ epochs on 1 ranks", output), output[-4000:]
    assert FINGERPRINT.search(output), output[-4000:]


def test_a_killed_gpu_run_resumes_to_the_same_weights_with_deterministic_kernels(tmp_path):
    """--deterministic (cuBLAS workspace, no cuDNN autotuning, deterministic algorithms): the run
    killed at step 7 and restarted by torchrun resumes from step 5 and ends on the uninterrupted
    run's weights. Checkpoints are written in the step (--async-checkpoint off): on a GPU, where
    the background writer is the default, a kill two steps (milliseconds) after a save
    comes before the write commits, and the restart then rightly begins at step 0 (first H100 run,
    2026-11-26); tests/test_trainer.py kills the background writer on purpose."""
    flags = ["--deterministic", "--async-checkpoint", "off", "--amp", "bf16", "--channels-last", "on",
             "--max-steps", "12", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--random-erase", "0.25", "--model-ema",
             "--model-ema-steps", "2"]
    whole, code = _torchrun(tmp_path / "whole", *flags)
    assert code == 0, whole[-4000:]
    killed, code = _torchrun(tmp_path / "killed", *flags, "--fail-at-step", "7", "--fail-rank", "0", restarts=1)
    assert code == 0 and "attempt 1: resuming at step 5" in killed, killed[-4000:]
    assert FINGERPRINT.search(killed).group(1) == FINGERPRINT.search(whole).group(1), "the resumed run differs on the GPU"


def test_cuda_rng_is_captured_and_restored():
    """4.1's capture_rng records the current CUDA device's generator; restore_rng puts it back."""
    from solutions.phase4_production.checkpoint import capture_rng, restore_rng

    torch.cuda.init()
    torch.cuda.manual_seed(3)
    state = capture_rng()
    assert "cuda" in state, "capture_rng left out the CUDA generator"
    first = torch.rand(4, device="cuda")
    torch.rand(100, device="cuda")
    restore_rng(state)
    assert torch.equal(torch.rand(4, device="cuda"), first)


def _ring_and_buckets() -> dict:
    """3.1's ring all-reduce and 3.2's BucketedDDP on this rank's GPU (NCCL)."""
    import copy

    from solutions.phase3_multi_node.bucketed_ddp import BucketedDDP
    from solutions.phase3_multi_node.ring import ring_all_reduce

    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.arange(1027, dtype=torch.float32, device=device)
    ring = ring_all_reduce(x.clone())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)
    reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), device_ids=[device.index])
    ours = BucketedDDP(model, bucket_cap_mb=0.001)
    data = torch.randn(8, 16, device=device)
    ours(data).sum().backward()
    reference(data).sum().backward()
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.module.parameters()))
    return {"ring": torch.equal(ring, x), "buckets": same, "device": str(ring.device)}


def test_ring_all_reduce_and_bucketed_ddp_on_a_gpu():
    result = run_world(_ring_and_buckets, 1, env=NCCL, timeout=300)[0]
    assert result == {"ring": True, "buckets": True, "device": "cuda:0"}, result


def _powersgd_on_gpu() -> dict:
    """4.4's powersgd_hook against torch's own on a CUDA model; the global CUDA RNG untouched."""
    import copy

    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    from solutions.phase4_production.compression import PowerSGDState, powersgd_hook

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(device)
    ours = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=[device.index])
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=[device.index])
    ours.register_comm_hook(PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2), powersgd_hook)
    theirs.register_comm_hook(torch_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                                           start_powerSGD_iter=2), torch_powersgd.powerSGD_hook)
    same, untouched = True, True
    for step in range(4):
        data = torch.randn(16, 64, device=device, generator=torch.Generator(device).manual_seed(step))
        before = torch.cuda.get_rng_state()
        ours(data).square().mean().backward()
        untouched &= torch.equal(before, torch.cuda.get_rng_state())
        theirs(data).square().mean().backward()
        same &= all(torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters()))
        for model in (ours, theirs):
            model.zero_grad(set_to_none=True)
    return {"same": same, "cuda_rng_untouched": untouched}


def test_powersgd_on_a_gpu_matches_torchs_hook_and_leaves_the_cuda_generator():
    result = run_world(_powersgd_on_gpu, 1, env=NCCL, timeout=300)[0]
    assert result == {"same": True, "cuda_rng_untouched": True}, result


def test_step_timer_and_the_deferred_timer_use_cuda_events():
    """4.5's StepTimer on CUDA (events, one synchronisation in stop()) and the trainer's
    DeferredTimer (none until collect()) both give device time: positive, parts summing up."""
    from solutions.phase4_production.monitoring import StepTimer
    from solutions.phase4_production.trainer.sync import DeferredTimer

    x = torch.randn(2048, 2048, device="cuda")
    for timer in (StepTimer("cuda"), DeferredTimer("cuda")):
        timer.start()
        with timer.phase("forward"):
            for _ in range(20):
                x = x @ x / 2048
        times = timer.stop(samples=1)
        times = times if times is not None else timer.collect()[0]
        assert times["forward"] > 0 and times["step"] >= times["forward"]
        assert abs(sum(times[p] for p in (*timer.phases, "other")) - times["step"]) < 1e-6


def test_device_batches_prefetch_on_a_side_stream_and_decode_on_the_gpu(tmp_path):
    """The side-stream prefetcher gives the CPU path's values; nvjpeg's crops match the CPU
    decoder's to within rounding."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_trainer_pipeline import _folder

    from common.data import IMAGENET_MEAN, IMAGENET_STD
    from solutions.phase4_production.trainer.augment import imagenet
    from solutions.phase4_production.trainer.data import SeededSamples, collate
    from solutions.phase4_production.trainer.device_stage import DeviceBatches, DeviceDecode, InputStage

    stats = (IMAGENET_MEAN, IMAGENET_STD)
    data = [(torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8).pin_memory(), torch.arange(4))
            for _ in range(3)]
    cpu = [x for x, _ in DeviceBatches(data, InputStage(torch.device("cpu"), stats), torch.device("cpu"))]
    gpu = [x for x, _ in DeviceBatches(data, InputStage(torch.device("cuda"), stats), torch.device("cuda"))]
    assert all(torch.allclose(a, b.cpu(), atol=1e-6) for a, b in zip(cpu, gpu))
    root = _folder(tmp_path)
    files = SeededSamples(imagenet(str(root), True, 32, 36, "cuda"), seed=2)
    tensor = SeededSamples(imagenet(str(root), True, 32, 36, "tensor"), seed=2)
    keys = [(0, i) for i in range(6)]
    images = DeviceDecode(torch.device("cuda"), True, 32, 36)(collate([files[k] for k in keys])[0])
    expected = torch.stack([tensor[k][0] for k in keys])
    assert images.is_cuda and (images.cpu().float() - expected.float()).abs().mean() < 3.0


def test_the_gpu_report_writes_its_json(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_report.py", "--quick", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env={**os.environ, **ENV})
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    report = json.loads(out.read_text())
    assert report["device"] and report["versions"]["torch"] and "trainer_vs_bare" in report, report
