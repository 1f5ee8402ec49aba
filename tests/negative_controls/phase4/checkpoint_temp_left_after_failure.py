"""atomic_save writes a temporary file and renames it, but when pickling or the rename fails it leaves the
temporary file behind: every failed save adds a stray file the size of a checkpoint to the folder."""
from pathlib import Path

from solutions.phase4_production import checkpoint as _reference
from solutions.phase4_production.checkpoint import *  # noqa: F401,F403

EXERCISE = "4.1"
CAUGHT_BY = ["test_4_1_failed_save_leaves_no_temporary_file"]


def atomic_save(obj, path):
    path = Path(path)
    partial = path.parent / (path.name + ".partial")
    with open(partial, "wb") as f:  # the bug: nothing removes `partial` when this block raises
        writer = _reference._HashingWriter(f)
        torch.save(obj, writer)
        f.write(MAGIC + writer.sha.digest())
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    _reference._fsync_folder(path.parent)
