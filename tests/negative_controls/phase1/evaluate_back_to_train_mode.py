"""evaluate ends with model.train(): a model handed over in eval mode (a final evaluation, a frozen feature extractor) comes back in train mode."""
import torch
import torch.distributed as dist

from solutions.phase1_data_parallel.trainer import *  # noqa: F401,F403

EXERCISE = "1.4"
CAUGHT_BY = ["test_1_4_evaluate_runs_the_model_in_eval_mode"]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        counts[0] += (model(inputs).argmax(dim=1) == targets).sum()
        counts[1] += len(targets)
    model.train()
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()
