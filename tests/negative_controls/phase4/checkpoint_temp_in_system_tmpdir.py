"""atomic_save builds the file in the system's temporary folder and renames it onto the checkpoint: the
rename is atomic only when both folders share a file system (else EXDEV, or a copy that can be seen half-done)."""
import tempfile
from pathlib import Path

from solutions.phase4_production import checkpoint as _reference
from solutions.phase4_production.checkpoint import *  # noqa: F401,F403

EXERCISE = "4.1"
CAUGHT_BY = ["test_4_1_temporary_file_in_the_checkpoint_folder"]


def atomic_save(obj, path):
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix="ckpt-")  # the bug: not in path.parent
    try:
        with os.fdopen(fd, "wb") as f:
            writer = _reference._HashingWriter(f)
            torch.save(obj, writer)
            f.write(MAGIC + writer.sha.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    _reference._fsync_folder(path.parent)
