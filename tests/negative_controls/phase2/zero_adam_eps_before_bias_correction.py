"""adam_update divides sqrt(v) + eps by sqrt(1 - b2^t) (the Adam paper's "epsilon hat" form), where torch.optim.Adam adds eps after the correction: the same for eps far below sqrt(v), not otherwise."""
import math

from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_adam_update_any_hyperparameters"]


def adam_update(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay=0.0):
    beta1, beta2 = betas
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
    param.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(eps), value=-step_size)
