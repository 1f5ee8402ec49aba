"""send_activation and recv_activation agree on dtype codes of their own (float16 and bfloat16 swapped), not DTYPES' indices: each reads itself, and misreads a sender that follows the documented header."""

EXERCISE = "2.5"
CAUGHT_BY = ["test_2_5_header_protocol_matches_the_reference"]
EDITS = {
    "Mailbox.send_activation": [
        ("        header = [DTYPES.index(activation.dtype), activation.dim(), *activation.shape]\n",
         "        header = [_CODES.index(activation.dtype), activation.dim(), *activation.shape]\n"),
    ],
    "Mailbox.recv_activation": [
        ("        dtype, ndim = DTYPES[header[0]], header[1]\n",
         "        dtype, ndim = _CODES[header[0]], header[1]\n"),
    ],
}


_CODES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
