"""fit_alpha_beta fits a line through the origin (alpha = 0), as if latency were free."""
from solutions.phase1_data_parallel.comm_bench import *  # noqa: F401,F403

EXERCISE = "1.3"
CAUGHT_BY = ["test_1_3_fit_alpha_beta_recovers_the_model"]


def fit_alpha_beta(sizes_bytes, seconds):
    beta = sum(n * t for n, t in zip(sizes_bytes, seconds)) / sum(n * n for n in sizes_bytes)
    return 0.0, beta
