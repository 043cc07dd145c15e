"""One lock per output folder (issue 14 rows 3, 5, 13, 14): a second run is refused or waits, the
lock of a killed run is reclaimed, a read-only folder is one clear error."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diskfaults import read_only_folder
from wsi_milssl.errors import FolderLockedError, OutputError
from wsi_milssl.locks import LOCK_FILENAME, folder_lock, lock_holder


def _hold(folder: Path, *, seconds: float) -> subprocess.Popen:
    """Another process that takes the folder's lock, says so, and keeps it for ``seconds``."""
    proc = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from wsi_milssl.locks import folder_lock\n"
        f"with folder_lock({str(folder)!r}):\n"
        "    print('locked', flush=True)\n"
        f"    time.sleep({seconds})\n"
    )], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_is_refused_naming_the_folder_and_the_other_pid(tmp_path):
    folder = tmp_path / "out"
    other = _hold(folder, seconds=60)
    try:
        assert lock_holder(folder)["pid"] == other.pid
        with pytest.raises(FolderLockedError, match=(
                rf"^{folder}: another wsi-milssl run \(pid {other.pid}, since .*\) is writing to this folder\. "
                r"Fix: wait until it finishes, or write to another folder \(--out\)\.$")):
            with folder_lock(folder):
                pass
    finally:
        other.kill()
        other.wait()


def test_wait_blocks_until_the_other_run_ends(tmp_path):
    folder = tmp_path / "out"
    other = _hold(folder, seconds=1.5)
    start = time.monotonic()
    with folder_lock(folder, wait=True):
        waited = time.monotonic() - start
        assert lock_holder(folder)["pid"] == os.getpid()
    assert other.wait(timeout=30) == 0
    assert waited > 1.0  # it waited for the other run's 1.5 s


def test_the_lock_of_a_killed_run_is_reclaimed_and_removed_after_use(tmp_path):
    folder = tmp_path / "out"
    other = _hold(folder, seconds=60)
    os.kill(other.pid, signal.SIGKILL)
    other.wait()
    assert (folder / LOCK_FILENAME).exists()  # kill -9 leaves the file, but the kernel freed the lock
    with folder_lock(folder) as held:
        assert held == folder and lock_holder(folder)["pid"] == os.getpid()
        with folder_lock(folder):  # re-entrant within one process
            pass
        second = subprocess.run([sys.executable, "-c", f"from wsi_milssl.locks import folder_lock\n"
                                                       f"with folder_lock({str(folder)!r}): pass"],
                                capture_output=True, text=True)  # ... but not for other processes
        assert second.returncode == 1 and f"FolderLockedError: {folder}: another wsi-milssl run (pid {os.getpid()}" \
            in second.stderr
    assert list(folder.iterdir()) == []


def test_a_read_only_output_folder_is_one_clear_error(tmp_path):
    folder = tmp_path / "ro"
    with read_only_folder(folder):
        for target, what in ((folder, "cannot write to this output folder"),
                             (folder / "run", "cannot create this output folder")):
            with pytest.raises(OutputError, match=(
                    rf"^{target}: {what} \(Read-only file system: {target} is on a read-only file system\)\. "
                    r"Fix: write to a folder on a writable disk \(another --out\), or remount it read-write\.$")
                               ) as info:
                with folder_lock(target):
                    pass
            assert info.value.errno == errno.EROFS
