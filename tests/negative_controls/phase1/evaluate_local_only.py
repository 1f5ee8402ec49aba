"""evaluate returns this rank's accuracy on its own shard, never combining the counts."""
import torch

from solutions.phase1_data_parallel.trainer import *  # noqa: F401,F403

EXERCISE = "1.4"
CAUGHT_BY = ["test_1_4_evaluate_counts_every_rank"]


@torch.no_grad()
def evaluate(model, loader, device):
    correct = total = 0
    for inputs, targets in loader:
        correct += (model(inputs.to(device)).argmax(1).cpu() == targets).sum().item()
        total += len(targets)
    return correct / total
