"""time_grid reads (kind, j, k) but keeps 1F1B's dependencies between ranks (F on rank r after F on rank r-1), not between virtual stages: right for one stage per rank, wrong as soon as a rank holds several chunks."""

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_time_grid_of_any_schedule_interleaved"]
EDITS = {
    "time_grid": [
        ("    last = max([num_ranks - 1] + [k for row in rows for _, _, k in row])\n",
         "    last = num_ranks - 1\n"),
        ("            kind, j, k = rows[r][position[r]]\n",
         "            kind, j, _ = rows[r][position[r]]\n"
         "            k = r\n"),
    ],
}
