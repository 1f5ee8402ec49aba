"""The ring's neighbours are the group indices rank +- 1, passed to send/receive as if they were global ranks: right on the whole world, wrong in a group."""

EXERCISE = "2.9"
CAUGHT_BY = ["test_2_9_ring_attention_on_a_group_communicates_only_within_it"]
EDITS = {
    "_ring_peers": [
        ("    return dist.get_global_rank(group, (rank + 1) % cp), dist.get_global_rank(group, (rank - 1) % cp)\n",
         "    return (rank + 1) % cp, (rank - 1) % cp\n"),
    ],
}
