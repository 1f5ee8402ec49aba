"""load_balanced_positions returns the contiguous chunk of rank r (positions r*n..(r+1)*n), not chunks r and 2cp-1-r."""

EXERCISE = "2.9"
CAUGHT_BY = ["test_2_9_load_balanced_positions"]
EDITS = {
    "load_balanced_positions": [
        ("    c = seq_len // (2 * cp)\n"
         "    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])\n",
         "    n = seq_len // cp\n"
         "    return torch.arange(rank * n, (rank + 1) * n)\n"),
    ],
}
