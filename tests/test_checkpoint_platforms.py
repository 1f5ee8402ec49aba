"""The platform branches of the 4.1 reference's durability helpers, checked on Linux.

Not graded: `_fsync`, `_fsync_folder` and `_make_folder` sit outside the exercise markers,
so the learner's copy is the same code. What is checked is which call each platform gets
(macOS: fcntl F_FULLFSYNC, falling back to fsync; Windows: no folder fsync, since os.open
of a folder fails there), by replacing fcntl, sys.platform and os.open with stand-ins;
phase4_production/guidelines.md, 4.1 "Storage that is not a local POSIX disk", says why.
"""

from __future__ import annotations

import errno
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from solutions.phase4_production import checkpoint as ckpt

F_FULLFSYNC = 51  # its value on macOS; any number does for the stand-in


def _fake_fcntl(calls: list, refuse: bool = False):
    def fcntl(fd, cmd, *args):
        calls.append(("fcntl", cmd))
        if refuse:
            raise OSError(errno.ENOTSUP, "Operation not supported")
        return 0
    return types.SimpleNamespace(F_FULLFSYNC=F_FULLFSYNC, fcntl=fcntl)


@pytest.fixture
def fsyncs(monkeypatch) -> list:
    calls: list = []
    real = os.fsync

    def fsync(fd):
        calls.append(("fsync", fd))
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_macos_file_data_gets_full_fsync(tmp_path, monkeypatch, fsyncs):
    monkeypatch.setattr(ckpt, "fcntl", _fake_fcntl(fsyncs))
    with open(tmp_path / "f", "wb") as f:
        f.write(b"x")
        f.flush()
        ckpt._fsync(f.fileno())
    assert fsyncs == [("fcntl", F_FULLFSYNC)], "where fcntl has F_FULLFSYNC (macOS), it replaces fsync"


def test_macos_folder_gets_full_fsync(tmp_path, monkeypatch, fsyncs):
    monkeypatch.setattr(ckpt, "fcntl", _fake_fcntl(fsyncs))
    ckpt._fsync_folder(tmp_path)
    assert fsyncs == [("fcntl", F_FULLFSYNC)]


def test_full_fsync_refused_falls_back_to_fsync(tmp_path, monkeypatch, fsyncs):
    monkeypatch.setattr(ckpt, "fcntl", _fake_fcntl(fsyncs, refuse=True))
    ckpt._fsync_folder(tmp_path)
    assert [c[0] for c in fsyncs] == ["fcntl", "fsync"], "a file system that refuses F_FULLFSYNC gets fsync"


@pytest.mark.skipif(sys.platform == "darwin", reason="this checks a platform without F_FULLFSYNC")
def test_without_full_fsync_plain_fsync(tmp_path, fsyncs):
    ckpt._fsync_folder(tmp_path)
    assert [c[0] for c in fsyncs] == ["fsync"]


def _as_on_windows(monkeypatch) -> list:
    """sys.platform, fcntl and os.open as on Windows (where os.open of a folder raises
    PermissionError); returns the folders something tried to open."""
    opened: list = []
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if os.path.isdir(path):
            opened.append(os.fspath(path))
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_open(path, flags, *args, **kwargs)
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(ckpt, "fcntl", None)
    monkeypatch.setattr(os, "open", open_)
    return opened


def test_windows_skips_the_folder_fsync(tmp_path, monkeypatch, fsyncs):
    opened = _as_on_windows(monkeypatch)
    ckpt._fsync_folder(tmp_path)
    assert opened == [] and fsyncs == []


def test_windows_save_and_load_work(tmp_path, monkeypatch, fsyncs):
    """The whole protocol with Windows' refusals in place: the file's data is still fsynced,
    no folder is opened, and the checkpoint (in a folder save() creates) loads back."""
    folder = tmp_path / "run" / "checkpoints"
    opened = _as_on_windows(monkeypatch)
    manager = ckpt.CheckpointManager(folder, keep=1)
    for step in (1, 2):
        manager.save(step, {"w": torch.full((3,), float(step))})
    found = manager.load_latest()
    monkeypatch.undo()
    assert opened == [], f"os.open of a folder on Windows: {opened}"
    assert fsyncs, "the file's data was never fsynced"
    assert found is not None and found[0] == 2 and torch.equal(found[1]["w"], torch.full((3,), 2.0))
    assert sorted(p.name for p in folder.iterdir()) == ["step_000000002.pt"]


def test_make_folder_fsyncs_the_parent_of_each_new_folder(tmp_path, monkeypatch):
    synced: list = []
    monkeypatch.setattr(ckpt, "_fsync_folder", lambda folder: synced.append(
        (Path(folder), sorted(p.name for p in Path(folder).iterdir()))))
    ckpt._make_folder(tmp_path / "a" / "b")
    assert synced == [(tmp_path, ["a"]), (tmp_path / "a", ["b"])], "each parent, after its new entry exists"
    synced.clear()
    ckpt._make_folder(tmp_path / "a" / "b")
    assert synced == [], "a folder that exists already costs no fsync"
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        ckpt._make_folder(tmp_path / "file")
