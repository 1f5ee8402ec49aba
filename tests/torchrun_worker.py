"""The end of a rank started by a real torchrun agent in a test: report, then leave.

    report_and_exit(lambda: run(ref), result_dir / f"rank{rank}.pkl")

`work()` returns plain data, which is pickled to `result_path` (written under a temporary
name and renamed, so the test never reads half a file). If it raises, the error (type,
message, traceback) is written there instead. A rank that succeeded waits for its peers
before tearing the group down; a failing rank leaves at once with exit code 1, so its
agent stops (or restarts) the job without waiting for a timeout.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch.distributed as dist


def report_and_exit(work: Callable[[], Any], result_path: Path) -> NoReturn:
    try:
        result, code = work(), 0
    except Exception as exc:  # noqa: BLE001 - reported by the test
        result = {"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
        code = 1
    tmp = result_path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(result))
    os.replace(tmp, result_path)
    if code == 0:
        dist.barrier()  # nobody tears the group down while a peer still works
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
