"""One lock per output folder (issue 14 rows 3, 5, 13, 14): a second run is refused or waits, the
lock of a killed run is reclaimed, a read-only folder is one clear error. Shards of one run share the
folder (issue 13); the short mutex for shared files leaves no file behind."""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diskfaults import read_only_folder
from wsi_milssl.atomic import temp_path
from wsi_milssl.errors import FolderLockedError, OutputError
from wsi_milssl.locks import (LOCK_FILENAME, MUTEX_FILENAME, folder_lock, folder_mutex, folder_writer, lock_holder,
                              shard_lock_filename)

REFUSED = r" is writing to this folder\. Fix: wait until it finishes, or write to another folder \(--out\)\.$"


def _hold(folder: Path, *, seconds: float, shard: tuple[int, int] | None = None) -> subprocess.Popen:
    """Another process that takes the folder's lock (as ``shard``), says so, and keeps it for ``seconds``."""
    proc = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from wsi_milssl.locks import folder_lock\n"
        f"with folder_lock({str(folder)!r}, shard={shard!r}):\n"
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
                rf"^{re.escape(str(folder))}: another wsi-milssl run \(pid {other.pid}, since .*\) is writing to "
                r"this folder\. "
                r"Fix: wait until it finishes, or write to another folder \(--out\)\.$")):
            with folder_lock(folder):
                pass
    finally:
        other.kill()
        other.wait()


def test_a_call_from_another_thread_is_refused_and_one_in_the_same_thread_nests(tmp_path):
    """Review BX: the nesting count was per process, so a second call from another thread (two fit() calls in a
    notebook's threads) shared the folder, and one run's files ended under the other's result."""
    import threading

    folder = tmp_path / "out"
    held, release, errors = threading.Event(), threading.Event(), []

    def first_run():
        with folder_lock(folder):
            with folder_lock(folder):  # the same thread: a stage inside a pipeline run
                held.set()
                release.wait(30)

    thread = threading.Thread(target=first_run)
    thread.start()
    try:
        assert held.wait(30)
        with pytest.raises(FolderLockedError,
                           match=rf"^{re.escape(str(folder))}: another wsi-milssl run \(pid {os.getpid()}, "):
            with folder_lock(folder):
                errors.append("entered")
        assert folder_writer(folder) is not None  # this thread does not hold it: the other thread writes it
    finally:
        release.set()
        thread.join(30)
    assert errors == [] and not (folder / LOCK_FILENAME).exists()
    with folder_lock(folder):  # free again
        assert folder_writer(folder) is None


@pytest.mark.parametrize("folder_mode, lock_mode", [(0o2775, 0o664), (0o755, 0o644), (0o777, 0o666)])
def test_a_lock_file_is_as_writable_as_its_folder_whatever_the_umask(tmp_path, folder_mode, lock_mode):
    """Review CB: under umask 022 a lock file was 0644 in a group's shared folder, so the next run of another group
    member could not open it to lock and record itself ("no permission to write in FOLDER", a chmod fix)."""
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(folder_mode)
    before = os.umask(0o022)
    try:
        with folder_lock(folder):
            assert (folder / LOCK_FILENAME).stat().st_mode & 0o777 == lock_mode
        with folder_mutex(folder):
            assert (folder / MUTEX_FILENAME).stat().st_mode & 0o777 == lock_mode
    finally:
        os.umask(before)


def test_wait_blocks_until_the_other_run_ends(tmp_path):
    folder = tmp_path / "out"
    other = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "from wsi_milssl.locks import folder_lock\n"
        f"with folder_lock({str(folder)!r}):\n"
        "    print('locked', flush=True)\n"
        "    time.sleep(1.5)\n"
        "    print(time.time(), flush=True)\n"  # as it lets go: no timing of this process's own (review EJ)
    )], stdout=subprocess.PIPE, text=True)
    assert other.stdout.readline().strip() == "locked"
    with folder_lock(folder, wait=True):
        got_it_at = time.time()
        assert lock_holder(folder)["pid"] == os.getpid()
    assert other.wait(timeout=30) == 0
    assert got_it_at >= float(other.stdout.readline())  # it waited until the other run let go


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
                    rf"^{re.escape(str(target))}: {what} \(Read-only file system: {re.escape(str(target))} is on a "
                    r"read-only file system\)\. "
                    r"Fix: write to a folder on a writable disk \(another --out\), or remount it read-write\.$")
                               ) as info:
                with folder_lock(target):
                    pass
            assert info.value.errno == errno.EROFS


@pytest.mark.parametrize("shard", [None, (0, 2)])
def test_a_read_only_folder_named_by_no_option_is_not_called_an_output(tmp_path, shard):
    """revV V1: the lock of a folder the run must write where it is (named_by None: label's stores folder, an
    input; the run folder train --resume continues) said "cannot write to this output folder" with the fix
    "another --out", which names no folder of those commands."""
    folder = tmp_path / "ro"
    with read_only_folder(folder):
        with pytest.raises(OutputError) as info:
            with folder_lock(folder, shard=shard, named_by=None):
                pass
    assert str(info.value) == (
        f"{folder}: cannot write to this folder (Read-only file system: {folder} is on a read-only file system). "
        "Fix: remount it read-write, or copy the folder to a writable disk and use the copy.")
    assert info.value.errno == errno.EROFS


def test_shards_of_one_run_share_the_folder_and_everything_else_is_refused(tmp_path):
    """Shard 1/2 runs beside shard 0/2; a second copy of shard 0/2, an unsharded run and a shard of
    another count are refused, naming the running shard's pid."""
    folder = tmp_path / "out"
    other = _hold(folder, seconds=60, shard=(0, 2))
    try:
        with folder_lock(folder, shard=(1, 2)):
            assert lock_holder(folder, shard=(0, 2))["pid"] == other.pid
            assert lock_holder(folder, shard=(1, 2))["shard"] == "1/2"
        assert (folder / shard_lock_filename(0, 2)).exists() and not (folder / shard_lock_filename(1, 2)).exists()
        running = rf"^{re.escape(str(folder))}: another wsi-milssl run \(shard 0/2, pid {other.pid}, since [^)]*\)"
        with pytest.raises(FolderLockedError, match=running + REFUSED):
            with folder_lock(folder, shard=(0, 2)):
                pass
        with pytest.raises(FolderLockedError, match=running + REFUSED):
            with folder_lock(folder):
                pass
        with pytest.raises(FolderLockedError, match=(
                running + r" is writing to this folder as a shard of 2, and this run is shard 3/4: shards of one run "
                r"must share the count\. Fix: wait until that run finishes, give every shard the same count, or "
                r"write to another folder \(--out\)\.$")):
            with folder_lock(folder, shard=(3, 4)):
                pass
        assert not (folder / shard_lock_filename(3, 4)).exists()
    finally:
        other.kill()
        other.wait()


def test_an_unsharded_run_refuses_shards(tmp_path):
    folder = tmp_path / "out"
    other = _hold(folder, seconds=60)
    try:
        with pytest.raises(FolderLockedError, match=rf"^{re.escape(str(folder))}: another wsi-milssl run "
                                                    rf"\(pid {other.pid}, " + r"[^)]*\)" + REFUSED):
            with folder_lock(folder, shard=(1, 2)):
                pass
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("named_by, fix", [
    ("--out", "wait until it finishes, or write to another folder (--out)."),
    ("OUT_DIR", "wait until it finishes, or write to another folder (OUT_DIR)."),  # synth, demo: an argument
    (None, "wait until it finishes."),  # train --resume, label's stores: writing elsewhere is no fix
])
def test_the_refusal_names_the_folder_as_the_command_takes_it(tmp_path, named_by, fix):
    """revS 5: the fix said `--out` for every command, also for synth/demo (OUT_DIR is an argument) and
    for train --resume (which must write its own run folder)."""
    folder = tmp_path / "out"
    other = _hold(folder, seconds=60)
    try:
        with pytest.raises(FolderLockedError) as info:
            with folder_lock(folder, named_by=named_by):
                pass
        assert str(info.value).endswith(f" is writing to this folder. Fix: {fix}")
        with pytest.raises(FolderLockedError) as info:
            with folder_lock(folder, shard=(0, 2), named_by=named_by):
                pass
        assert str(info.value).endswith(f" is writing to this folder. Fix: {fix}")
    finally:
        other.kill()
        other.wait()
    other = _hold(folder, seconds=60, shard=(0, 2))
    try:
        with pytest.raises(FolderLockedError) as info:
            with folder_lock(folder, shard=(1, 3), named_by=named_by):
                pass
        count_fix = ("wait until that run finishes, give every shard the same count, or write to another folder "
                     f"({named_by})." if named_by else "wait until that run finishes or give every shard the same count.")
        assert str(info.value).endswith(f"shards of one run must share the count. Fix: {count_fix}")
    finally:
        other.kill()
        other.wait()


def test_a_killed_shard_leaves_no_lock_and_its_temporaries_are_removed(tmp_path):
    """The files of a shard killed with -9 are taken over; its temporaries go, those of a live process
    stay; the last shard out leaves no lock file."""
    folder = tmp_path / "out"
    other = _hold(folder, seconds=60, shard=(0, 2))
    os.kill(other.pid, signal.SIGKILL)
    other.wait()
    dead = temp_path(folder / "a.h5", kind="partial").name.replace(f".{os.getpid()}.", f".{other.pid}.")
    live = temp_path(folder / "b.h5", kind="partial").name.replace(f".{os.getpid()}.", f".{os.getppid()}.")
    for name in (dead, live):
        (folder / name).write_bytes(b"x")
    assert sorted(p.name for p in folder.iterdir()) == sorted([LOCK_FILENAME, shard_lock_filename(0, 2), dead, live])
    with folder_lock(folder, shard=(0, 2)):  # the killed shard's own copy is not running any more
        assert lock_holder(folder, shard=(0, 2))["pid"] == os.getpid()
        assert not (folder / dead).exists() and (folder / live).exists()
    assert sorted(p.name for p in folder.iterdir()) == [live]


def test_folder_mutex_serialises_updates_across_processes_and_leaves_no_file(tmp_path):
    """Two processes add 1 to a counter 150 times each, reading and writing under the mutex (with a
    pause in between, so that updates without it would be lost)."""
    counter = tmp_path / "counter"
    counter.write_text("0")
    code = (
        "import time\n"
        "from pathlib import Path\n"
        "from wsi_milssl.locks import folder_mutex\n"
        f"path = Path({str(counter)!r})\n"
        "for _ in range(150):\n"
        "    with folder_mutex(path.parent):\n"
        "        with folder_mutex(path.parent):  # re-entrant\n"
        "            n = int(path.read_text())\n"
        "        time.sleep(0.001)\n"
        "        path.write_text(str(n + 1))\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert counter.read_text() == "300"
    assert [p.name for p in tmp_path.iterdir()] == ["counter"]


def test_scores_csv_updates_leave_no_lock_file(tmp_path):
    """Issue 14 row 13: update_scores_csv used to leave .scores.csv.lock behind for good."""
    from wsi_milssl.inference.exports import update_scores_csv

    update_scores_csv(tmp_path, {"b": 0.5})
    update_scores_csv(tmp_path, {"a": 0.25})
    assert [p.name for p in tmp_path.iterdir()] == ["scores.csv"]
    assert (tmp_path / "scores.csv").read_text() == "slide,score\na,0.250000\nb,0.500000\n"


def test_folder_writer_names_the_run_or_the_shards_that_hold_the_folder(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    assert folder_writer(folder) is None
    other = _hold(folder, seconds=60)
    try:
        assert f"pid {other.pid}" in folder_writer(folder)
    finally:
        other.kill()
        other.wait()
    assert folder_writer(folder) is None  # a killed run's file is no lock
    other = _hold(folder, seconds=60, shard=(1, 2))
    try:
        assert f"shard 1/2, pid {other.pid}" in folder_writer(folder)
    finally:
        other.kill()
        other.wait()
    assert folder_writer(folder) is None
    with folder_lock(folder):
        assert folder_writer(folder) is None  # this process's own run does not count


def test_a_run_that_fails_in_a_folder_it_created_leaves_no_empty_folder(tmp_path):
    """A run refused before writing anything (e.g. heatmap with a checkpoint of the wrong kind) used to leave
    its new, empty --out folder behind; a folder that existed, or one with files in it, stays."""
    new = tmp_path / "new" / "out"
    with pytest.raises(RuntimeError):
        with folder_lock(new):
            assert new.is_dir()
            raise RuntimeError("refused")
    assert not new.exists() and (tmp_path / "new").is_dir()  # parents are not ours to remove
    with pytest.raises(RuntimeError):
        with folder_lock(new):
            (new / "written.txt").write_text("x")
            raise RuntimeError("stopped")
    assert (new / "written.txt").is_file()
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(RuntimeError):
        with folder_lock(existing):
            raise RuntimeError("refused")
    assert existing.is_dir()


def test_heatmap_with_a_missing_checkpoint_leaves_no_out_folder(synth_dir, tmp_path, capsys):
    from wsi_milssl.cli import main

    out = tmp_path / "hm"
    assert main(["heatmap", str(synth_dir / "synth_000.tif"), "--model", str(tmp_path / "none.pt"),
                 "--out", str(out)]) != 0
    assert "checkpoint not found" in capsys.readouterr().err
    assert not out.exists()


def test_ones_own_read_only_lock_file_on_nfs_is_a_refusal_with_a_chmod_fix(tmp_path, monkeypatch):
    """Review CF: NFS turns flock into POSIX locks, which refuse an exclusive lock on a file opened read-only; one's
    own lock file without write permission was refused with "belongs to <oneself> ... ask <oneself> or an
    administrator". The operating system's answers (tests run as root) stand in for the user's and NFS's."""
    import fcntl

    import wsi_milssl.locks as locks

    folder = tmp_path / "mine"
    folder.mkdir()
    lock_file = folder / LOCK_FILENAME
    lock_file.write_text('{"pid": 1, "command": "a killed run"}\n')
    lock_file.chmod(0o444)
    real_open, real_flock = os.open, fcntl.flock

    def open_without_write_permission(path, flags, *args, **kwargs):
        if flags & os.O_ACCMODE == os.O_RDWR and Path(path) == lock_file:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    def flock_as_nfs(fd, operation):
        if operation & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real_flock(fd, operation)

    monkeypatch.setattr(locks.os, "open", open_without_write_permission)
    monkeypatch.setattr(locks.fcntl, "flock", flock_as_nfs)
    with pytest.raises(FolderLockedError) as err:
        with folder_lock(folder):
            pass
    message = str(err.value)
    assert message.startswith(f"{folder}: {LOCK_FILENAME} is read-only, and this file system does not lock files "
                              "opened read-only. Fix: `chmod u+w ")
    assert "belongs to" not in message and "ask " not in message


def test_another_users_lock_file_in_a_sticky_folder_is_a_refusal_naming_its_owner(tmp_path, monkeypatch):
    """Review CE: a dead run's lock file of another user, opened read-only, was to be replaced; in a sticky folder
    (only a file's owner may delete it) the unlink failed and folder_lock looped for ever at 100 % CPU. The tests
    run as root, whom permissions do not stop: the operating system's answers for another user stand in."""
    import wsi_milssl.locks as locks

    folder = tmp_path / "team"
    folder.mkdir()
    stale = folder / LOCK_FILENAME
    stale.write_text('{"pid": 1, "command": "a killed run"}\n')
    theirs = stale.stat().st_ino  # the other user's file: not this user's to write or (sticky folder) delete
    real_open, real_unlink = os.open, os.unlink

    def of_the_other_user(path) -> bool:
        return Path(path) == stale and stale.exists() and stale.stat().st_ino == theirs

    def open_as_other_user(path, flags, *args, **kwargs):
        if flags & os.O_ACCMODE == os.O_RDWR and of_the_other_user(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    def unlink_in_sticky_folder(path, *args, **kwargs):
        if of_the_other_user(path):
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(locks.os, "open", open_as_other_user)
    monkeypatch.setattr(locks.os, "unlink", unlink_in_sticky_folder)
    monkeypatch.setattr(locks.os, "geteuid", lambda: os.getuid() + 1)  # the file is not this user's
    started = time.monotonic()
    with pytest.raises(FolderLockedError, match=rf"^{re.escape(str(folder))}: {re.escape(LOCK_FILENAME)} belongs to "
                                                r".*, and this user can neither write it nor replace it here .*Fix: "
                                                r"ask .* to delete "):
        with folder_lock(folder):
            pass
    assert time.monotonic() - started < 5
    monkeypatch.setattr(locks.os, "unlink", real_unlink)  # a folder without the sticky bit: the file is replaced
    with folder_lock(folder):
        assert lock_holder(folder)["pid"] == os.getpid()


def test_a_folders_settings_record_is_read_for_the_shard_checks(tmp_path):
    """tile, label and heatmap shards compare their settings with the folder's record: none, not an object, or
    unreadable (the error names the file and the fix, in the stage's error class)."""
    from wsi_milssl.errors import StoreError
    from wsi_milssl.locks import folder_settings_record

    path = tmp_path / "tile_config.json"
    assert folder_settings_record(path, error=StoreError) is None
    path.write_text("[1, 2]")
    assert folder_settings_record(path, error=StoreError) is None
    path.write_text('{"patch_size_px": 256}')
    assert folder_settings_record(path, error=StoreError) == {"patch_size_px": 256}
    path.write_text("{not json")
    with pytest.raises(StoreError, match=r"tile_config\.json: cannot read the settings of this folder \(.*\)\. Fix: "
                                         r"write to a new folder with --out, or pass --overwrite\."):
        folder_settings_record(path, error=StoreError)


@pytest.mark.parametrize("target", ["a file", "nothing"])
def test_a_link_where_the_lock_file_goes_is_refused_and_its_target_kept(tmp_path, target):
    """Review EV, B2: the lock file was opened through a link: its target was truncated and overwritten with the
    lock record (in a group's shared folder, one member's file by another's run), and a dangling link ended in a
    FileNotFoundError traceback."""
    folder = tmp_path / "out"
    folder.mkdir()
    precious = tmp_path / "precious.txt"
    if target == "a file":
        precious.write_text("precious data\n")
    (folder / LOCK_FILENAME).symlink_to(precious)
    with pytest.raises(OutputError, match=rf"^{re.escape(str(folder / LOCK_FILENAME))}: is a symbolic link where "
                                          r"wsi-milssl keeps the lock file of .* Fix: remove the link"):
        with folder_lock(folder):
            pass
    assert (precious.read_text() == "precious data\n") if target == "a file" else not precious.exists()
