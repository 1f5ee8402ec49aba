"""broadcast_optimizer_state describes only the tensor entries of each parameter's state (a filter where the
reference passes other values through): an entry that is no tensor (a counter, LBFGS's n_iter) is lost on
every rank that receives."""

EXERCISE = "3.5"
CAUGHT_BY = ["test_3_5_broadcast_optimizer_state_of_trained_optimizers"]
EDITS = {
    "broadcast_optimizer_state": [
        ('                          if isinstance(v, torch.Tensor) else v for key, v in entry.items()}\n',
         '                          for key, v in entry.items() if isinstance(v, torch.Tensor)}\n'),
    ],
}
