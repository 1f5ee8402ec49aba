"""evaluate all-reduces (local accuracy x local count, local count): right for every shard but an empty one, whose 0/0 accuracy is NaN."""
import torch
import torch.distributed as dist

from solutions.phase1_data_parallel.trainer import *  # noqa: F401,F403

EXERCISE = "1.4"
CAUGHT_BY = ["test_1_4_evaluate_weights_shards_by_their_size"]


@torch.no_grad()
def evaluate(model, loader, device):
    was_training = model.training
    model.eval()
    correct = torch.zeros((), dtype=torch.float64, device=device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        correct += (model(inputs).argmax(dim=1) == targets).sum()
        total += len(targets)
    model.train(was_training)
    stats = torch.stack([correct / total * total, total])  # the local accuracy, weighted by the local count
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()
