"""The ring's P2POps are built without the group (P2POp(dist.isend, t, nxt)): the right global peers, but the sends and receives run on the default group, not the context-parallel one."""

EXERCISE = "2.9"
CAUGHT_BY = ["test_2_9_ring_attention_on_a_group_communicates_only_within_it"]
EDITS = {
    "_ring_exchange": [
        ("    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors] + \\\n"
         "          [dist.P2POp(dist.irecv, t, prv, group) for t in received]\n",
         "    ops = [dist.P2POp(dist.isend, t, nxt) for t in tensors] + \\\n"
         "          [dist.P2POp(dist.irecv, t, prv) for t in received]\n"),
    ],
}
