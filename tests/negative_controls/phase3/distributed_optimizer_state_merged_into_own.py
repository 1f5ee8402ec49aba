"""broadcast_optimizer_state merges the root's state into each receiver's own instead of replacing it: a
parameter the root holds no state for (a root that never stepped, a parameter it never updated) keeps the
receiver's old moments, so the ranks' optimizers differ after the broadcast that was to make them equal."""

EXERCISE = "3.5"
CAUGHT_BY = ["test_3_5_broadcast_optimizer_state_of_trained_optimizers"]
EDITS = {
    "broadcast_optimizer_state": [
        ('        optimizer.load_state_dict({"state": state, "param_groups": structure["param_groups"]})\n',
         '        optimizer.load_state_dict({"state": {**optimizer.state_dict()["state"], **state},\n'
         '                                   "param_groups": structure["param_groups"]})\n'),
    ],
}
