"""Exercise 1.4: synchronous data-parallel training, by hand.

Each of p ranks holds a full copy of the model and a shard of every global batch B:

    start:   broadcast parameters and buffers from rank 0   -> identical replicas
    step:    g_r = grad of mean loss over my n_r samples
             g   = sum_r n_r * g_r / sum_r n_r              -> all-reduce, every rank
             w  <- optimizer(w, g)                           -> replicas stay identical

so p ranks take exactly the step one process would take on the whole batch B.

    python -m solutions.phase1_data_parallel.trainer                 # 2 CPU ranks, digits
    torchrun --standalone --nproc_per_node=2 -m solutions.phase1_data_parallel.trainer

Production: torch.nn.parallel.DistributedDataParallel (bucketed all-reduce overlapped
with backward) plus torch.utils.data.DistributedSampler.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from tqdm import tqdm

from common.data import DATASET_SHAPES, get_dataset
from common.distributed import current_device
from common.models import MODEL_NAMES, build_model

from .sampler import make_loader


def broadcast_parameters(model: nn.Module, src: int = 0) -> None:
    """Make every rank's parameters AND buffers (e.g. BatchNorm statistics) equal to rank `src`'s."""
    raise NotImplementedError('TODO 1.4: dist.broadcast every tensor of model.parameters() and model.buffers() from src (in place, under torch.no_grad())')


def sync_gradients(model: nn.Module, local_batch_size: int) -> None:
    """Replace each rank's gradient by the gradient of the mean loss over the global batch.

    With a mean loss on every rank, the global gradient is sum_r n_r * g_r / sum_r n_r.
    When every n_r is equal this is the plain average of the g_r. A parameter without a
    gradient counts as a zero gradient, so every rank makes the same collective calls.
    """
    raise NotImplementedError('TODO 1.4: all-reduce the global sample count, then for each parameter all-reduce grad * n_r and divide by it')


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """One synchronous step on this rank's part of the batch. Returns the global mean loss."""
    raise NotImplementedError('TODO 1.4: zero_grad, forward, cross-entropy (mean over the local batch), backward, sync_gradients, step; all-reduce loss * n / N for the return value')


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> float:
    """Accuracy over the union of all ranks' loaders (not just this rank's share)."""
    raise NotImplementedError('TODO 1.4: count correct and total on this rank, all-reduce both counts (SUM), return correct / total')


@dataclass
class TrainConfig:
    dataset: str = "digits"
    data_root: str | None = None
    model: str = "mlp"
    epochs: int = 5
    batch_size: int = 32  # per rank
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    progress: bool = True


def eval_loader(dataset, batch_size: int, rank: int, world_size: int) -> DataLoader:
    """An unpadded strided shard, so every test sample is counted exactly once."""
    return DataLoader(Subset(dataset, range(rank, len(dataset), world_size)), batch_size=batch_size)


def train(config: TrainConfig) -> dict:
    """Train on every rank of the current process group; returns the same summary on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = current_device()
    train_set = get_dataset(config.dataset, "train", config.data_root)
    test_set = get_dataset(config.dataset, "test", config.data_root)
    in_shape, num_classes = DATASET_SHAPES[config.dataset]

    model = build_model(config.model, in_shape, num_classes, seed=config.seed + rank).to(device)
    broadcast_parameters(model)  # ranks start from different weights on purpose: this fixes it
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    loader = make_loader(train_set, config.batch_size, rank, world, seed=config.seed)
    test_loader = eval_loader(test_set, 256, rank, world)

    history, start = [], time.perf_counter()
    for epoch in range(config.epochs):
        loader.sampler.set_epoch(epoch)
        bar = tqdm(loader, desc=f"epoch {epoch + 1}/{config.epochs}", disable=rank != 0 or not config.progress, leave=False)
        losses = []
        for inputs, targets in bar:
            losses.append(train_step(model, optimizer, inputs.to(device), targets.to(device)))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        accuracy = evaluate(model, test_loader, device)
        history.append({"epoch": epoch + 1, "loss": sum(losses) / len(losses), "test_accuracy": accuracy})
        if rank == 0 and config.progress:
            tqdm.write(f"epoch {epoch + 1}/{config.epochs}  loss {history[-1]['loss']:.4f}  test accuracy {accuracy:.2%}")
    return {
        "config": asdict(config), "world_size": world, "history": history,
        "test_accuracy": history[-1]["test_accuracy"] if history else evaluate(model, test_loader, device),
        "seconds": time.perf_counter() - start,
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
    }


def _train_rank(config: TrainConfig) -> dict:
    summary = train(config)
    if dist.get_rank() != 0:
        summary.pop("state_dict")  # rank 0's copy is enough to send back
    return summary


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description="Synchronous data-parallel training (phase 1 reference).")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start on this machine (ignored under torchrun)")
    parser.add_argument("--dataset", default="digits", choices=sorted(DATASET_SHAPES))
    parser.add_argument("--data-root", default=None, help="folder holding CIFAR-10 or ImageNet (see data/README.md)")
    parser.add_argument("--model", default="mlp", choices=MODEL_NAMES)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before the run is declared hung")
    args = parser.parse_args(argv)
    if args.nproc < 1 or args.epochs < 1 or args.batch_size < 1 or args.lr <= 0:
        parser.error("--nproc, --epochs and --batch-size must be >= 1 and --lr > 0")
    config = TrainConfig(dataset=args.dataset, data_root=args.data_root, model=args.model, epochs=args.epochs,
                         batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    return config, args


def main(argv: list[str] | None = None) -> None:
    from common.launch import exit_on_user_error, run_or_join

    config, args = parse_args(argv)
    with exit_on_user_error():
        summary = run_or_join(_train_rank, args.nproc, args=(config,), timeout=args.timeout)
    if summary is not None:
        print(f"test accuracy {summary['test_accuracy']:.2%} after {config.epochs} epochs on "
              f"{summary['world_size']} ranks ({summary['seconds']:.1f}s)")


if __name__ == "__main__":
    main()
