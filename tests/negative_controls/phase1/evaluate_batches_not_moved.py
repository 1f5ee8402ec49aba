"""evaluate feeds the loader's batches to the model as they come, never moving them to `device`: fine on a CPU, a device mismatch as soon as the model is on a GPU."""
import torch
import torch.distributed as dist

from solutions.phase1_data_parallel.trainer import *  # noqa: F401,F403

EXERCISE = "1.4"
CAUGHT_BY = ["test_1_4_evaluate_counts_every_rank"]


@torch.no_grad()
def evaluate(model, loader, device):
    was_training = model.training
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for inputs, targets in loader:
        counts[0] += (model(inputs).argmax(dim=1) == targets).sum()
        counts[1] += len(targets)
    model.train(was_training)
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()
