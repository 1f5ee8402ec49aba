"""fit_alpha_beta is plain least squares: the largest sizes' noise decides alpha (2x too big, or 5x too small, in the test)."""
import torch

from solutions.phase1_data_parallel.comm_bench import *  # noqa: F401,F403

EXERCISE = "1.3"
CAUGHT_BY = ["test_1_3_fit_lets_small_sizes_determine_alpha"]


def fit_alpha_beta(sizes_bytes, seconds):
    n = torch.tensor(sizes_bytes, dtype=torch.float64)
    design = torch.stack([torch.ones_like(n), n], dim=1)
    t = torch.tensor(seconds, dtype=torch.float64).unsqueeze(1)
    alpha, beta = torch.linalg.lstsq(design, t).solution.squeeze(1).tolist()
    return alpha, beta
