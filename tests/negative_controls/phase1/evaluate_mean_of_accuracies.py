"""evaluate averages the ranks' accuracies: wrong when the shards differ in size."""
import torch
import torch.distributed as dist

from solutions.phase1_data_parallel.trainer import *  # noqa: F401,F403

EXERCISE = "1.4"
CAUGHT_BY = ["test_1_4_evaluate_weights_shards_by_their_size"]


@torch.no_grad()
def evaluate(model, loader, device):
    was_training = model.training
    model.eval()
    correct = total = 0
    for inputs, targets in loader:
        correct += (model(inputs.to(device)).argmax(1) == targets.to(device)).sum().item()
        total += len(targets)
    model.train(was_training)
    accuracy = torch.tensor([correct / total], dtype=torch.float64, device=device)
    dist.all_reduce(accuracy)
    return accuracy.item() / dist.get_world_size()
