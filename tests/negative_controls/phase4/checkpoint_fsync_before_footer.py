"""atomic_save fsyncs the temporary file once torch.save has written the state, then appends the footer and
renames: the footer (and whatever torch.save left in the buffer) was never made durable, so after a power cut
the renamed file can end short and fail its checksum."""
from solutions.phase4_production import checkpoint as _reference
from solutions.phase4_production.checkpoint import *  # noqa: F401,F403

EXERCISE = "4.1"
CAUGHT_BY = ["test_4_1_data_fsynced_before_rename_folder_after"]


def atomic_save(obj, path):
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            writer = _reference._HashingWriter(f)
            torch.save(obj, writer)
            f.flush()
            os.fsync(f.fileno())  # the bug: "the data is safe now"; the footer comes after
            f.write(MAGIC + writer.sha.digest())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _reference._fsync_folder(path.parent)


class CheckpointManager(_reference.CheckpointManager):
    def save(self, step, state):
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path_for(step)
        atomic_save(state, path)
        for old in self.steps()[:-self.keep]:
            self.path_for(old).unlink(missing_ok=True)
        return path
