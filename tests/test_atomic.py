"""Atomic writes: one temporary-name rule, clean errors for full or read-only disks, and clean-up of
the temporaries a killed run leaves (issue 14 rows 1, 5, 13)."""

from __future__ import annotations

import errno
import os
import shlex
import signal
import subprocess
import sys

import pytest

from diskfaults import file_size_limit, read_only_folder
from wsi_milssl.atomic import atomic_open, atomic_write_bytes, check_writable, clean_stale_temporaries, temp_path
from wsi_milssl.errors import OutputError


def _dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temporary_names_are_unique_hidden_and_name_their_process(tmp_path):
    a, b = temp_path(tmp_path / "last.pt"), temp_path(tmp_path / "last.pt")
    assert a != b and a.parent == tmp_path
    assert a.name.startswith(".last.pt.") and a.name.endswith(".tmp") and f".{os.getpid()}." in a.name
    assert temp_path(tmp_path / "s.h5", kind="partial").name.endswith(".partial")
    with pytest.raises(ValueError, match="temporary kind must be one of tmp, partial, old, scratch; got 'x'"):
        temp_path(tmp_path / "s.h5", kind="x")


def test_a_file_whose_name_fits_is_written_however_long_and_a_name_too_long_is_named(tmp_path, monkeypatch):
    # the temporary adds ~25 bytes to the name: cut to fit, so a slide named with 240 characters gets its store
    long_name = "é" * 100 + "x" * 40 + ".h5"  # 243 bytes in UTF-8
    tmp = temp_path(tmp_path / long_name, kind="partial")
    assert len(os.fsencode(tmp.name)) <= 255 and tmp.name.endswith(".partial")
    assert atomic_write_bytes(tmp_path / long_name, b"abc").read_bytes() == b"abc"
    assert [p.name for p in tmp_path.iterdir()] == [long_name]  # no temporary left
    dead = _dead_pid()
    monkeypatch.setattr(os, "getpid", lambda: dead)  # the name a dead process cut to fit (its id may be longer)
    stale = temp_path(tmp_path / long_name, kind="partial")
    monkeypatch.undo()
    assert f".{dead}." in stale.name and len(os.fsencode(stale.name)) <= 255
    stale.write_bytes(b"x")
    assert clean_stale_temporaries(tmp_path) == [stale]  # a cut name is still recognised
    too_long = "y" * 256
    with pytest.raises(OutputError, match=r"y{256}: cannot write this file \(.*: the name is 256 bytes long\)\. "
                                          r"Fix: shorten the name \(file systems take at most 255 bytes"):
        atomic_write_bytes(tmp_path / too_long, b"abc")
    assert [p.name for p in tmp_path.iterdir()] == [long_name]


def test_stale_temporaries_of_dead_processes_are_removed_others_kept(tmp_path):
    dead = _dead_pid()
    stale_file = tmp_path / f".last.pt.{dead}.0123abcd.tmp"
    stale_file.write_bytes(b"x" * 1000)
    stale_store = tmp_path / f".s.zarr.{dead}.89abcdef.partial"
    (stale_store / "coords").mkdir(parents=True)
    live = temp_path(tmp_path / "best.pt")  # this process: still running
    live.write_bytes(b"y")
    parent = tmp_path / f".x.tif.{os.getppid()}.00000000.partial"  # a live process of someone else
    parent.write_bytes(b"z")
    unrelated = [tmp_path / ".hidden", tmp_path / f".a.{dead}.tmp", tmp_path / "last.pt"]
    for p in unrelated:
        p.write_bytes(b"keep")
    # review CQ: tile's qc/ images are written under the folder's lock too; other subfolders are not cleaned
    (tmp_path / "qc").mkdir()
    stale_qc = tmp_path / "qc" / f".s.png.{dead}.0123abcd.tmp"
    stale_qc.write_bytes(b"q")
    (tmp_path / "other").mkdir()
    elsewhere = tmp_path / "other" / f".s.png.{dead}.0123abcd.tmp"
    elsewhere.write_bytes(b"q")
    removed = clean_stale_temporaries(tmp_path)
    assert sorted(removed) == sorted([stale_file, stale_store, stale_qc])
    assert not stale_file.exists() and not stale_store.exists() and not stale_qc.exists()
    assert live.exists() and parent.exists() and all(p.exists() for p in unrelated) and elsewhere.exists()


def test_kill_9_mid_write_leaves_a_temporary_that_the_next_locked_run_removes(tmp_path):
    """Row 13: a checkpoint save killed with SIGKILL leaves ``.last.pt.<pid>.<random>.tmp``; the next
    run that locks the folder (every stage does) removes it."""
    from wsi_milssl.locks import folder_lock

    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from wsi_milssl.atomic import atomic_open\n"
        f"with atomic_open({str(tmp_path / 'last.pt')!r}) as fh:\n"
        "    fh.write(b'x' * 1_000_000); fh.flush(); print('written', flush=True); time.sleep(60)\n"
    )], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "written"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    left = list(tmp_path.glob(f".last.pt.{child.pid}.*.tmp"))
    assert len(left) == 1 and left[0].stat().st_size == 1_000_000 and not (tmp_path / "last.pt").exists()
    with folder_lock(tmp_path):
        assert list(tmp_path.glob(".last.pt.*")) == []


def test_atomic_open_on_a_read_only_folder_is_one_clean_error(tmp_path):
    """Row 5: one OutputError naming the file and the fix, no second error from the clean-up."""
    folder = tmp_path / "ro"
    with read_only_folder(folder):
        with pytest.raises(OutputError, match=r"ro/metrics\.json: cannot write this file \(Read-only file system: "
                                              r".*ro is on a read-only file system\)\. Fix: write to a folder on a "
                                              r"writable disk") as info:
            atomic_write_bytes(folder / "metrics.json", b"{}")
    assert info.value.errno == errno.EROFS
    assert info.value.__context__ is None or info.value.__suppress_context__
    assert list(folder.iterdir()) == []


def test_atomic_open_on_a_full_disk_removes_the_temporary(tmp_path):
    """A write past the limit fails with OutputError (also when a library such as torch wraps the
    OSError in its own exception), and nothing is left behind."""
    import torch

    with file_size_limit(50_000):
        with pytest.raises(OutputError, match=r"big\.bin: cannot write this file \(File too large: .*Fix: "):
            atomic_write_bytes(tmp_path / "big.bin", b"x" * 200_000)
        with pytest.raises(OutputError, match=r"last\.pt: cannot write this file \(File too large"):
            with atomic_open(tmp_path / "last.pt") as fh:
                torch.save({"w": torch.zeros(100_000)}, fh)  # torch raises RuntimeError from the OSError
    assert list(tmp_path.iterdir()) == []
    # a failure that is not about the disk passes through unchanged
    with pytest.raises(ZeroDivisionError):
        with atomic_open(tmp_path / "x.bin") as fh:
            fh.write(b"1")
            1 / 0
    assert list(tmp_path.iterdir()) == []


def test_enospc_names_the_folder_and_how_to_free_space(tmp_path):
    from wsi_milssl.atomic import output_error

    err = output_error(tmp_path / "run" / "last.pt", OSError(errno.ENOSPC, "No space left on device"))
    assert str(err) == (f"{tmp_path}/run/last.pt: cannot write this file (No space left on device: the disk is "
                        f"full). Fix: free disk space where {tmp_path}/run lives "
                        f"(`df -h {shlex.quote(str(tmp_path / 'run'))}`), or "
                        "write to another folder, and re-run.")
    assert err.errno == errno.ENOSPC


def test_check_writable_makes_the_folders_leaves_files_and_no_temporary(tmp_path):
    existing = tmp_path / "old.json"
    existing.write_text("kept")
    check_writable(tmp_path / "new" / "deeper" / "x.png", existing, None)
    assert (tmp_path / "new" / "deeper").is_dir() and list((tmp_path / "new" / "deeper").iterdir()) == []
    assert existing.read_text() == "kept" and sorted(p.name for p in tmp_path.iterdir()) == ["new", "old.json"]


def test_check_writable_names_a_path_whose_folder_cannot_be_made(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(OutputError, match=r"a_file/x\.md: cannot write this file \(.*a_file cannot be made there\)\. "
                                          r"Fix: give a path under a folder that exists"):
        check_writable(tmp_path / "ok.json", tmp_path / "a_file" / "x.md")
    with read_only_folder(tmp_path / "ro"):
        with pytest.raises(OutputError, match="read-only file system"):
            check_writable(tmp_path / "ro" / "x.png")
