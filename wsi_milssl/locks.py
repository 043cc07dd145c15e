"""One lock per output folder, so that two runs never write into the same folder at once.

Every stage that writes a folder (``synth``, ``tile``, ``train``, ``run``) holds
:func:`folder_lock` on it for the whole run. The lock is ``fcntl.flock`` on ``DIR/.wsi-milssl.lock``,
a file that records the holder's pid and command and is deleted when the run ends. The kernel
releases a flock when the holding process exits in any way (kill -9 included), so the file a killed
run leaves behind is no lock at all: the next run takes it over. (A run that took the lock checks
that the file it locked is still the one at the path, because the previous holder may have deleted
it in between.) While holding the lock, the temporaries of killed runs in that folder are removed
(:func:`wsi_milssl.atomic.clean_stale_temporaries`).

Within one process the lock is re-entrant (a pipeline that holds ``OUT`` may call stages that lock
``OUT`` again); worker processes forked by a holder share it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from wsi_milssl.atomic import clean_stale_temporaries, find_write_error, output_error
from wsi_milssl.errors import FolderLockedError

__all__ = ["LOCK_FILENAME", "folder_lock", "lock_holder"]

log = logging.getLogger(__name__)

LOCK_FILENAME = ".wsi-milssl.lock"

_held: dict[str, int] = {}  # real path of a folder this process holds -> nesting depth
_held_guard = threading.Lock()


def lock_holder(folder: str | os.PathLike) -> dict | None:
    """What the lock file of ``folder`` says about its last holder (pid, command, host, started), or
    None when there is no readable record. The holder may have finished since."""
    try:
        data = json.loads((Path(folder) / LOCK_FILENAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _describe(holder: dict | None) -> str:
    if not holder:
        return "another wsi-milssl run"
    pid = holder.get("pid")
    command = str(holder.get("command") or "")
    if len(command) > 200:
        command = command[:197] + "..."
    started = holder.get("started")
    since = ""
    if isinstance(started, (int, float)):
        since = time.strftime(", since %Y-%m-%d %H:%M:%S", time.localtime(started))
    host = holder.get("host")
    where = f" on {host}" if host and host != socket.gethostname() else ""
    return f"another wsi-milssl run (pid {pid}{where}{since}: {command})"


def _record(fd: int) -> None:
    """Write who holds the lock into the lock file (best effort: it only improves messages)."""
    program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    if program in ("__main__.py", "wsi-milssl"):  # python -m wsi_milssl, or the console script
        program = "wsi-milssl"
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
            "command": " ".join([program, *sys.argv[1:]])}
    data = (json.dumps(info) + "\n").encode("utf-8")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except OSError as exc:  # a full disk: the stage reports it where it writes its outputs
        log.debug("cannot record the lock holder: %s", exc)


@contextmanager
def folder_lock(path: str | os.PathLike, *, wait: bool = False) -> Iterator[Path]:
    """Hold the exclusive lock of output folder ``path`` (created if missing) for the ``with`` block.

    When another process holds it: with ``wait`` block until it is released, else raise
    FolderLockedError naming the folder and the other run's pid and command. A folder that cannot be
    written (read-only file system, no permission, full disk) raises OutputError naming it and the
    fix. After the lock is taken, temporaries left in the folder by killed runs are removed. Yields
    the folder path.
    """
    folder = Path(path)
    lock_file = folder / LOCK_FILENAME
    try:
        folder.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(folder)
    except OSError as exc:
        cause = find_write_error(exc, access=True)
        if cause is None:
            raise
        raise output_error(folder, cause, what="cannot create this output folder", folder=folder) from None
    with _held_guard:
        depth = _held.get(key, 0)
        if depth:
            _held[key] = depth + 1
    if depth:
        try:
            yield folder
        finally:
            with _held_guard:
                _held[key] -= 1
        return

    fd = _acquire(folder, lock_file, wait=wait)
    try:
        _record(fd)
        with _held_guard:
            _held[key] = 1
        try:
            clean_stale_temporaries(folder)
            yield folder
        finally:
            with _held_guard:
                _held.pop(key, None)
            try:
                os.unlink(lock_file)  # while still holding it: see the module docstring
            except OSError:
                pass
    finally:
        os.close(fd)  # releases the flock (forked workers that share it hold it until they exit)


def _acquire(folder: Path, lock_file: Path, *, wait: bool) -> int:
    """Open and flock the lock file; returns its descriptor. Retries when the file was deleted or
    replaced by the previous holder between our open and our flock."""
    while True:
        try:
            fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            cause = find_write_error(exc, access=True)
            if cause is None:
                raise
            raise output_error(folder, cause, what="cannot write to this output folder", folder=folder) from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = lock_holder(folder)
                if not wait:
                    raise FolderLockedError(
                        f"{folder}: {_describe(holder)} is writing to this folder. Fix: wait until it "
                        "finishes, or write to another folder (--out)."
                    ) from None
                log.warning("%s: waiting for %s to finish", folder, _describe(holder))
                fcntl.flock(fd, fcntl.LOCK_EX)
            mine = os.fstat(fd)
            try:
                current = os.stat(lock_file)
            except FileNotFoundError:
                current = None
        except BaseException:
            os.close(fd)
            raise
        if current is not None and (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
            return fd
        os.close(fd)  # the previous holder deleted the file after we opened it: take the new one
