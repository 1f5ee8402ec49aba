"""The trainer's input pipeline, regularisers and host synchronisations, piece by piece.

End-to-end runs (resumes with every regulariser on, --benchmark-loader) are in
tests/test_trainer.py and tests/test_trainer_fsdp.py; here each piece is checked against
torchvision's or torch's own implementation of the same thing, in one process.
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest
import torch

from common.launch import run_world
from solutions.phase4_production.trainer.config import parse_config
from solutions.phase4_production.elastic import ElasticSampler
from solutions.phase4_production.trainer.augment import erase_box
from solutions.phase4_production.trainer.data import RankBatches, SeededSamples, repeated_batch, sample_seed
from solutions.phase4_production.trainer.device_stage import BatchMixing, DeviceBatches, InputStage, erase

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- sampling: repeated augmentation, neighbours


def _global(batches_per_rank: list[list], neighbour: bool) -> list:
    """One step's global batch from every rank's share (the neighbour dropped)."""
    return [key for share in batches_per_rank for key in (share[1:] if neighbour else share)]


@pytest.mark.parametrize("reps, neighbour", [(1, True), (3, False), (4, True)])
def test_rank_batches_are_the_same_global_batches_at_every_world_size(reps, neighbour):
    sampler = ElasticSampler(100, 12, seed=5)
    sampler.advance()  # resumed at step 1
    by_world = {}
    for world in (1, 2, 3, 5):
        shares = [list(RankBatches(sampler, r, world, reps, neighbour)) for r in range(world)]
        assert all(len(s) == sampler.steps_per_epoch - 1 for s in shares)
        by_world[world] = [_global([s[t] for s in shares], neighbour) for t in range(len(shares[0]))]
        if neighbour:  # each share starts with the sample before it in the global batch
            for t in range(len(shares[0])):
                glob = by_world[world][t]
                starts = np.cumsum([0] + [len(s[t]) - 1 for s in shares])[:-1]
                assert [s[t][0] for s in shares] == [glob[start - 1] for start in starts]
    assert by_world[1] == by_world[2] == by_world[3] == by_world[5], "the global batches depend on the world size"


def test_repeated_augmentation_holds_each_sample_reps_times_with_its_own_copy_number():
    order = list(range(100, 200))
    batch = repeated_batch(order, step=2, global_batch=12, reps=3)
    samples = collections.Counter(i for i, _ in batch)
    assert set(samples) == set(order[8:12]) and set(samples.values()) == {3}, batch
    assert sorted(c for i, c in batch if i == order[8]) == [0, 1, 2], "copies must differ (their augmentation does)"
    assert [i for i, _ in batch[:4]] == [i for i, _ in batch[4:8]], "copies sit ceil(B/reps) apart (other ranks)"
    uneven = repeated_batch(order, step=0, global_batch=10, reps=4)  # ceil(10/4) = 3 samples, the last 2 copies cut
    assert len(uneven) == 10 and collections.Counter(i for i, _ in uneven) == {100: 4, 101: 3, 102: 3}
    assert repeated_batch(order, 1, 12, 1) == [(i, 0) for i in order[12:24]]


def test_a_copy_is_augmented_differently_and_copy_zero_keeps_the_old_seed():
    class Noise(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return torch.rand(3)

    samples = SeededSamples(Noise(), seed=7)
    assert torch.equal(samples[(1, 4)], samples[(1, 4, 0)])
    assert not torch.equal(samples[(1, 4, 0)], samples[(1, 4, 1)])
    assert sample_seed(7, 1, 4) == ((7 * 1_000_003 + 1) * 1_000_000_007 + 4) % 2**63, "earlier runs' seeds changed"


# ---------------------------------------------------------------- batch mixing


def test_batch_mixing_is_torchvisions_mixup_and_cutmix_on_the_global_batch_at_any_world_size():
    """Mixed shares (each with its predecessor) put together are the batch mixed on one rank;
    and that is v2.MixUp/v2.CutMix with the drawn parameters on the global batch, rolled."""
    from torchvision.transforms import v2

    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(12, 3, 8, 8, generator=gen), torch.randint(10, (12,), generator=gen)
    mixing = BatchMixing(0.2, 1.0, 10, seed=3)
    chosen = set()
    for step in range(12):
        which, params = mixing.draw(step, 8, 8)
        chosen.add(which)
        whole_x, whole_y = mixing(torch.cat([x[-1:], x]), torch.cat([y[-1:], y]), step)
        for world in (2, 3):
            bounds = np.linspace(0, 12, world + 1).astype(int)
            parts = [mixing(x[[s - 1, *range(s, e)]], y[[s - 1, *range(s, e)]], step) for s, e in zip(bounds, bounds[1:])]
            assert torch.equal(torch.cat([p[0] for p in parts]), whole_x), f"step {step}, {world} ranks"
            assert torch.equal(torch.cat([p[1] for p in parts]), whole_y)
        reference = v2.MixUp(alpha=0.2, num_classes=10) if which == 0 else v2.CutMix(alpha=1.0, num_classes=10)
        reference.make_params = lambda flat, params=params: params
        ref_x, ref_y = reference(x, y)  # rolled over the global batch: sample 0 pairs with the last
        assert torch.equal(ref_x, whole_x) and torch.equal(ref_y, whole_y)
        assert torch.allclose(whole_y.sum(1), torch.ones(12)), "soft targets must sum to one"
    assert chosen == {0, 1}, "both MixUp and CutMix are chosen over the steps"


def test_mixing_draws_follow_torchvisions_distributions():
    """lambda ~ Beta(alpha, alpha); the choice is even; CutMix's box as v2.CutMix derives it."""
    mixing = BatchMixing(0.2, 1.0, 10, seed=0)
    draws = [mixing.draw(step, 32, 32) for step in range(4000)]
    mix = [p["lam"] for w, p in draws if w == 0]
    cut = [p for w, p in draws if w == 1]
    assert 0.45 < len(mix) / len(draws) < 0.55
    assert abs(np.mean(mix) - 0.5) < 0.03 and abs(np.var(mix) - 0.25 / 1.4 * 1.0) < 0.02  # Beta(.2,.2): var 1/(4(2a+1))
    for p in cut[:50]:
        x1, y1, x2, y2 = p["box"]
        assert 0 <= x1 <= x2 <= 32 and 0 <= y1 <= y2 <= 32
        assert p["lam_adjusted"] == pytest.approx(1 - (x2 - x1) * (y2 - y1) / 1024)


# ---------------------------------------------------------------- random erasing


def test_erase_boxes_are_torchvisions_random_erasing_draws_and_the_device_zeroes_them():
    from torchvision.transforms import v2

    image = torch.rand(3, 20, 24) + 1.0  # no zeros of its own
    boxes = []
    for seed in range(40):
        torch.manual_seed(seed)
        box = erase_box(image.shape, 0.5)
        torch.manual_seed(seed)
        expected = v2.RandomErasing(p=0.5, value=0)(image.clone())
        got = erase(image.clone()[None], box[None])[0]
        assert torch.equal(got, expected), f"seed {seed}: box {box.tolist()}"
        boxes.append(box)
    erased = [b for b in boxes if b[2] > 0]
    assert 0 < len(erased) < len(boxes), "about half the samples are erased"


# ---------------------------------------------------------------- the device stage


def test_the_device_stage_normalises_uint8_as_to_tensor_and_normalize_do():
    from torchvision import transforms as T

    images = torch.randint(0, 256, (4, 3, 6, 5), dtype=torch.uint8)
    stats = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    x, y = InputStage(torch.device("cpu"), stats)((images, torch.arange(4)))
    expected = torch.stack([T.Normalize(*stats)(im.float().div(255)) for im in images])
    assert torch.equal(x, expected) and torch.equal(y, torch.arange(4))
    floats = torch.rand(2, 1, 8, 8)  # digits: used as they are
    assert torch.equal(InputStage(torch.device("cpu"), None)((floats, torch.zeros(2)))[0], floats)


def test_device_batches_yield_the_loaders_batches_in_order():
    data = [(torch.full((2, 3), float(k)), torch.tensor([k, k])) for k in range(5)]
    seen = list(DeviceBatches(data, InputStage(torch.device("cpu")), torch.device("cpu")))
    assert [int(y[0]) for _, y in seen] == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------- ImageNet decoding


def _folder(root: Path, n: int = 3) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                yy, xx = np.mgrid[0:75, 0:100]
                pixels = np.stack([np.sin(xx / (5 + i + c)) * 90 + yy + 60 for c in range(3)], -1)
                pixels = np.clip(pixels + rng.normal(0, 8, pixels.shape), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(root / split / cls / f"{i}.jpg", quality=90)
    return root


def test_decode_pil_is_the_earlier_pipeline_bit_for_bit_and_tensor_the_same_crops(tmp_path):
    """--decode pil then the device's normalisation gives the float pipeline of earlier versions
    (common.data.image_folder: PIL crop, flip, ToTensor, Normalize) exactly, sample by sample;
    --decode tensor draws the same crops and flips (its resampling differs in rounding)."""
    from common.data import IMAGENET_MEAN, IMAGENET_STD, image_folder
    from solutions.phase4_production.trainer.augment import imagenet

    root = _folder(tmp_path)
    old = SeededSamples(image_folder(root, "train", image_size=32, augment=True), seed=1)
    stage = InputStage(torch.device("cpu"), (IMAGENET_MEAN, IMAGENET_STD))
    pil = SeededSamples(imagenet(str(root), True, 32, 36, "pil"), seed=1)
    tensor = SeededSamples(imagenet(str(root), True, 32, 36, "tensor"), seed=1)
    for key in [(0, i) for i in range(6)] + [(3, 2), (3, 5, 1)]:
        x_old, y_old = old[key]
        x_pil, y_pil = pil[key]
        assert x_pil.dtype == torch.uint8 and y_pil == y_old
        assert torch.equal(stage((x_pil[None], torch.tensor([y_pil])))[0][0], x_old), f"sample {key}"
        x_tensor = tensor[key][0]
        assert (x_tensor.float() - x_pil.float()).abs().mean() < 3.0, f"sample {key}: another crop?"
    val = imagenet(str(root), False, 24, 28, "tensor")[0][0]
    assert val.shape == (3, 24, 24) and val.dtype == torch.uint8


def test_gpu_decode_path_on_the_cpu_crops_what_the_worker_drew(tmp_path):
    """--decode cuda's device half (DeviceDecode) run with the CPU as the device: the same
    crop and flip as the tensor path for the same draws. The batch comes from a loader
    worker, as in training: the files' bytes must cross its queue (a DataLoader timeout turns
    a wedged queue into an error, not a hang)."""
    from torch.utils.data import DataLoader

    from solutions.phase4_production.trainer.augment import imagenet
    from solutions.phase4_production.trainer.data import collate
    from solutions.phase4_production.trainer.device_stage import DeviceDecode

    root = _folder(tmp_path)
    files = SeededSamples(imagenet(str(root), True, 32, 36, "cuda"), seed=2)
    tensor = SeededSamples(imagenet(str(root), True, 32, 36, "tensor"), seed=2)
    keys = [(0, i) for i in range(6)]
    batch, = DataLoader(files, batch_sampler=[keys], num_workers=1, collate_fn=collate, timeout=60)
    assert batch[0]["jpeg_sizes"].shape == (6,) and batch[0]["box"].shape == (6, 4)
    images = DeviceDecode(torch.device("cpu"), True, 32, 36)(batch[0])
    expected = torch.stack([tensor[k][0] for k in keys])
    assert images.shape == expected.shape and (images.float() - expected.float()).abs().max() <= 1.0
    val = collate([SeededSamples(imagenet(str(root), False, 24, 28, "cuda"), seed=0)[(0, i)] for i in range(2)])
    assert DeviceDecode(torch.device("cpu"), False, 24, 28)(val[0]).shape == (2, 3, 24, 24)


# ---------------------------------------------------------------- weight decay groups, EMA


@pytest.mark.parametrize("name", ["cnn", "resnet18", "vit_b_16"])
def test_weight_decay_groups_default_to_the_old_rule_and_take_the_embeddings_apart(name):
    from common.models import build_model
    from solutions.phase4_production.trainer.step import make_optimizer, parameter_groups

    shape = (3, 32, 32) if name != "cnn" else (1, 8, 8)
    model = build_model(name, shape, 10)
    cfg = parse_config(["--weight-decay", "0.1"], check_paths=False)
    decay = {id(p): g["weight_decay"] for g in make_optimizer(cfg.optim, model, cfg.data.global_batch).param_groups
             for p in g["params"]}
    assert decay == {id(p): 0.1 if p.ndim > 1 else 0.0 for p in model.parameters()}, \
        "the default groups must decay exactly the parameters of more than one dimension"
    cfg = parse_config(["--weight-decay", "0.3", "--norm-weight-decay", "0.01", "--bias-weight-decay", "0.02",
                        "--transformer-embedding-decay", "0"], check_paths=False)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g: {names[id(p)] for p in params} for g, _, params in parameter_groups(cfg.optim, model)}
    if name == "vit_b_16":
        assert groups["embeddings"] == {"class_token", "encoder.pos_embedding"}
        assert "encoder.layers.encoder_layer_0.ln_1.bias" in groups["norms"]
        assert "encoder.layers.encoder_layer_0.self_attention.in_proj_bias" in groups["biases"]
    else:
        assert "embeddings" not in groups
    decay = {names[id(p)]: g["weight_decay"] for g in make_optimizer(cfg.optim, model, cfg.data.global_batch).param_groups
             for p in g["params"]}
    assert {decay[n] for n in groups["norms"]} == {0.01} and {decay[n] for n in groups["weights"]} == {0.3}


def test_ema_is_averaged_model_with_torchvisions_decay_and_warmup():
    """Against torch's own AveragedModel(get_ema_multi_avg_fn) fed the same weights."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from solutions.phase4_production.trainer.ema import WeightsEMA, ema_decay

    cfg = parse_config(["--model-ema", "--model-ema-steps", "4", "--epochs", "600", "--global-batch", "1024",
                        "--warmup-epochs", "1"], check_paths=False)
    assert ema_decay(cfg.model.model_ema_decay, cfg.data.global_batch, cfg.model.model_ema_steps, cfg.optim.epochs) \
        == pytest.approx(1 - 2e-5 * 1024 * 4 / 600), "torchvision's adjustment"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    ema = WeightsEMA(model, 0.9, every=4, warmup_epochs=1)
    reference = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    for step in range(1, 25):
        with torch.no_grad():
            model[0].weight.add_(torch.randn(4, 4))
            model(torch.randn(8, 4))  # BatchNorm statistics move
        epoch = (step - 1) // 8  # 8 steps per epoch: the first is warm-up
        acted = ema.update(step, epoch, model)
        assert acted == (step % 4 == 0)
        if acted:
            reference.update_parameters(model)
            if epoch < 1:
                reference.n_averaged.fill_(0)
        for mine, theirs in zip(ema.module.state_dict().values(), reference.module.state_dict().values()):
            assert torch.equal(mine, theirs), f"step {step}"
    assert ema.updates == int(reference.n_averaged) == 4


def test_deferred_timer_reads_the_device_only_in_collect(monkeypatch):
    """On CUDA, stop() keeps the events; collect() waits once (the newest event) and gives
    StepTimer's times. A fake Event stands in for CUDA's."""
    from solutions.phase4_production.trainer.sync import DeferredTimer

    calls = collections.Counter()

    class Event:
        clock = 0.0

        def __init__(self, enable_timing=False):
            self.t = None

        def record(self, stream=None):
            Event.clock += 1.0
            self.t = Event.clock

        def synchronize(self):
            calls["synchronize"] += 1

        def elapsed_time(self, other):
            calls["elapsed_time"] += 1
            return (other.t - self.t) * 1000.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.update(["cuda.synchronize"]))
    timer = DeferredTimer("cpu")
    timer.on_cuda = True
    for _ in range(3):
        timer.start()
        with timer.phase("forward"):
            pass
        timer.stop(samples=4)
    assert not calls, f"stop() read the device: {dict(calls)}"
    times = timer.collect()
    assert calls["synchronize"] == 1 and "cuda.synchronize" not in calls
    assert [t["step"] for t in times] == [3.0, 3.0, 3.0] and [t["forward"] for t in times] == [1.0, 1.0, 1.0]
    assert times[0]["other"] == 2.0 and times[0]["samples_per_s"] == pytest.approx(4 / 3)
    assert timer.collect() == []


# ---------------------------------------------------------------- host synchronisations per step

_READS = [(torch.Tensor, "item"), (torch.Tensor, "tolist"), (torch.Tensor, "cpu"), (torch.Tensor, "__float__"),
          (torch.Tensor, "__int__"), (torch.Tensor, "__bool__"), (torch.Tensor, "__index__")]


def _count_device_reads(argv: list[str], backend: str | None = None) -> dict:
    """A rank of the trainer with every way of reading a tensor back (or waiting for the
    device) counted, per step: {step (1-based): {call: count}}. A call between begin_step(k)
    and begin_step(k + 1) belongs to step k + 1 (its work and the boundary after it).
    With --compile, torch.compile runs with `backend` (aot_eager: dynamo's graphs and
    autograd's split as inductor gets them, without inductor's code generation; what breaks
    a graph or recompiles it is decided before the backend) and "dynamo" holds, per step
    begun, torch._dynamo's counters so far (frames compiled, graph breaks; a private API,
    torch 2.14.1)."""
    from torch._dynamo.utils import counters as dynamo

    from solutions.phase4_production import recovery
    from solutions.phase4_production.trainer.loop import train

    if backend is not None:
        compile_ = torch.compile
        torch.compile = lambda model, **kw: compile_(model, **{**kw, "backend": backend})
    counts: dict = collections.defaultdict(collections.Counter)
    compiled: dict = {}
    now = [0]

    def counted(name, original):
        def wrapper(*args, **kwargs):
            counts[now[0]][name] += 1
            return original(*args, **kwargs)
        return wrapper

    for owner, name in _READS:
        setattr(owner, name, counted(name, getattr(owner, name)))
    torch.cuda.synchronize = counted("cuda.synchronize", torch.cuda.synchronize)
    for name in ("synchronize", "elapsed_time", "query", "wait"):
        setattr(torch.cuda.Event, name, counted(f"Event.{name}", getattr(torch.cuda.Event, name)))
    torch.cuda.Stream.synchronize = counted("Stream.synchronize", torch.cuda.Stream.synchronize)
    begin = recovery.FaultInjector.begin_step

    def begin_step(self, step):
        now[0] = step + 1
        compiled[step] = _dynamo_so_far(dynamo)
        return begin(self, step)

    recovery.FaultInjector.begin_step = begin_step
    summary = train(parse_config(argv))
    compiled["end"] = _dynamo_so_far(dynamo)
    return {"counts": {k: dict(v) for k, v in counts.items()}, "step": summary["step"], "dynamo": compiled}


def _dynamo_so_far(counters) -> dict:
    return {"frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": dict(counters["graph_break"])}


def _bare_compiled_ddp_breaks(argv: list[str], backend: str) -> dict:
    """The graph breaks of torch.compile(DDP(model)) alone: the model the trainer builds from
    `argv`, three steps of its micro-batches (no_sync but the last, as the trainer's step
    calls them: where DDP breaks depends on the order of its calls), nothing of the trainer
    around it."""
    import contextlib

    import torch.distributed as dist
    from torch._dynamo.utils import counters as dynamo
    from torch.nn.parallel import DistributedDataParallel as DDP

    from common.models import build_model
    from solutions.phase4_production.elastic import plan_batches
    from solutions.phase4_production.trainer.data import build_datasets

    cfg, rank = parse_config(argv), dist.get_rank()
    torch._dynamo.reset()
    dynamo.clear()
    data = cfg.data
    _, _, shape, classes = build_datasets(data.dataset, data.data_root, data.image_size, data.synthetic_size)
    net = torch.compile(DDP(build_model(cfg.model.name, shape, classes, seed=0)), backend=backend)
    plan = plan_batches(data.global_batch, dist.get_world_size(), data.micro_batch or data.global_batch)
    slices = plan.micro_slices(rank)
    for _ in range(3):
        x = torch.randn(plan.shares[rank], *shape)
        for i, (part, _weight) in enumerate(slices):
            with net.no_sync() if i < len(slices) - 1 else contextlib.nullcontext():
                net(x[part]).sum().backward()
    dist.barrier()
    return dict(dynamo["graph_break"])


def _compiled_world(argv: list[str], backend: str) -> dict:
    """The trainer with --compile (its counts, as _count_device_reads), then, in the same
    world, a bare compiled DDP forward and backward of the same model (world > 1)."""
    import torch.distributed as dist

    result = _count_device_reads(argv, backend)
    if dist.get_world_size() > 1:
        result["bare_ddp_breaks"] = _bare_compiled_ddp_breaks(argv, backend)
    return result


def test_a_step_that_is_not_logged_reads_nothing_back_from_the_device(tmp_path):
    """Two ranks, every regulariser on, loader workers (their processes are the CPU side on any
    device): the steps that write no log line, save nothing, evaluate nothing and report no
    straggler call none of the functions that wait for a GPU (Tensor.item/tolist/cpu/
    __float__/__int__/__bool__/__index__, torch.cuda.synchronize, Event.synchronize/
    elapsed_time/query/wait, Stream.synchronize), run here on the CPU, the same code path.
    Tensor.numpy() is not counted: it refuses device tensors, so it can only read the host's."""
    argv = ["--model", "cnn", "--epochs", "1", "--global-batch", "64", "--max-steps", "12", "--log-every", "5",
            "--checkpoint-every", "100", "--straggler-every", "100", "--workers", "1", "--progress", "false",
            "--output-dir", str(tmp_path), "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--auto-augment", "ra",
            "--random-erase", "0.25", "--ra-reps", "2", "--model-ema", "--model-ema-steps", "3",
            "--label-smoothing", "0.1", "--grad-clip", "1.0"]
    results = run_world(_count_device_reads, 2, args=(argv,), timeout=240)
    for rank, result in enumerate(results):
        assert result["step"] == 12
        counts = result["counts"]
        quiet = [s for s in range(3, 12) if s % 5]  # not logged (5, 10), saved or evaluated (12)
        reads = {s: counts.get(s, {}) for s in quiet if counts.get(s)}
        assert not reads, f"rank {rank}: steps that log nothing read the device: {reads}"
        assert counts.get(5) and counts.get(10), f"rank {rank}: the logged steps read nothing? {counts}"


_COMPILED = ["--model", "cnn", "--epochs", "1", "--global-batch", "60", "--micro-batch", "20", "--max-steps", "12",
             "--log-every", "5", "--checkpoint-every", "100", "--straggler-every", "100", "--workers", "0",
             "--progress", "false", "--compile", "--label-smoothing", "0.1", "--grad-clip", "1.0"]


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_compiled_step_adds_no_graph_break_recompiles_nothing_after_warm_up_and_reads_nothing(tmp_path, nproc):
    """--compile (aot_eager here: graph breaks and recompiles are dynamo's decisions, before
    any backend), 12 steps, 3 micro-batches per step on 2 ranks (20, 10 and 10 samples on
    each: two batch sizes, so step 1 compiles twice). One rank: the model is one graph, no
    break (no DDP: nothing to reduce). Two ranks: DDP's forward breaks the graph where torch
    itself breaks it (the same breaks as torch.compile(DDP(model)) alone, counted in the same
    world): the trainer adds none (its loss, mixing, timers and fault points are outside the
    compiled module). Either way nothing is compiled after step 2, and the steps that log,
    save and evaluate nothing read nothing back from the device."""
    argv = [*_COMPILED, "--output-dir", str(tmp_path), "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0"]
    results = run_world(_compiled_world, nproc, args=(argv, "aot_eager"), timeout=240)
    for rank, result in enumerate(results):
        assert result["step"] == 12
        dynamo = result["dynamo"]
        assert dynamo[2]["frames"] == dynamo["end"]["frames"], \
            f"rank {rank}: torch.compile compiled again after step 2: {dynamo}"
        breaks = dynamo["end"]["graph_breaks"]
        if nproc == 1:
            assert not breaks and dynamo["end"]["graphs"] >= 1, f"one rank: graph breaks {breaks}"
        else:
            assert breaks and set(breaks) == set(result["bare_ddp_breaks"]), \
                f"rank {rank}: the trainer's graph breaks {breaks} are not only DDP's {result['bare_ddp_breaks']}"
        quiet = [s for s in range(3, 12) if s % 5]
        reads = {s: result["counts"].get(s) for s in quiet if result["counts"].get(s)}
        assert not reads, f"rank {rank}: compiled steps that log nothing read the device: {reads}"


# ---------------------------------------------------------------- a stuck loader worker


def _run_on_folder(out: Path, root: Path, *extra: str):
    """The trainer on the ImageFolder at `root`: one rank, one loader worker, one step per epoch."""
    from test_trainer import launch

    return launch(out, "--dataset", "imagenet", "--data-root", str(root), "--image-size", "32", "--global-batch", "7",
                  "--workers", "1", *extra, nproc=1, timeout=120)


def _error_lines(proc) -> list[str]:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def test_an_unreadable_image_is_one_line_naming_it_and_the_run_ends(tmp_path):
    """An empty .jpg in the training folder, read by a loader worker: exit 2 (no restart fixes
    it) with one line naming the file, and the run ends: a rank leaving with an error must not
    wait on its workers, which ignore SIGTERM (subprocess.run waits for every holder of its
    pipes, so a worker left behind fails this test by its timeout). --decode pil's reader
    says the same, called directly."""
    from solutions.phase4_production.trainer.augment import UnreadableImage, read_rgb_pil

    root = _folder(tmp_path / "data")
    (root / "train" / "b" / "empty.jpg").write_bytes(b"")
    proc = _run_on_folder(tmp_path / "run", root)
    errors = _error_lines(proc)
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "cannot read the image" in errors[0] and "empty.jpg" in errors[0], errors
    with pytest.raises(UnreadableImage, match="empty.jpg"):
        read_rgb_pil(str(root / "train" / "b" / "empty.jpg"))


@pytest.mark.parametrize("where, extra", [("step 1", []), ("--benchmark-loader", ["--benchmark-loader", "2"])])
def test_a_loader_worker_stuck_on_a_file_ends_the_attempt_in_one_line(tmp_path, where, extra):
    """One "image" is a named pipe nobody writes: the worker that opens it (--decode pil opens
    the file; torchvision's read_file would refuse a file of size 0) blocks for good, as on a
    network file system that stopped answering. The run must end after --loader-timeout
    with one line naming the loader and where it waited (exit 1: torchrun would restart it),
    in the training loop and outside it alike, and no worker may outlive it (subprocess.run
    waits for every holder of its pipes)."""
    import os

    root = _folder(tmp_path / "data")
    os.mkfifo(root / "train" / "a" / "stuck.jpg")
    proc = _run_on_folder(tmp_path / "run", root, "--decode", "pil", "--loader-timeout", "2", *extra)
    errors = _error_lines(proc)
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: {where}: no batch from the 1 loader worker(s) in 2 s (--loader-timeout)"), \
        errors
