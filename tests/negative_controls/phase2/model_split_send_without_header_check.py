"""send_activation skips its check: a 9-dim activation goes out with an 11-value header (longer than HEADER_LEN), which no receiver can read."""

EXERCISE = "2.5"
CAUGHT_BY = ["test_2_5_send_activation_rejects_what_the_header_cannot_describe"]
EDITS = {
    "Mailbox.send_activation": [
        ("        if activation.dim() > MAX_DIMS or activation.dtype not in DTYPES:\n",
         "        if False:\n"),
    ],
}
