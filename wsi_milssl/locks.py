"""Locks of output folders: one run per folder, or the shards of one run together.

Every stage that writes a folder (``synth``, ``tile``, ``label``, ``train``, ``heatmap``, ``run``)
holds :func:`folder_lock` on it for the whole run. The lock is ``fcntl.flock`` on
``DIR/.wsi-milssl.lock``:

- an unsharded run takes it EXCLUSIVE, so it shares the folder with nobody;
- shard ``I`` of ``N`` (``--shard I/N``, or a torchrun rank) takes it SHARED, so the shards of one run
  write the folder together while an unsharded run is refused, and takes
  ``DIR/.wsi-milssl.shard-I-of-N.lock`` EXCLUSIVE, so a second copy of the same shard is refused. A
  shard is also refused while shards with another count ``N`` write there (their slides overlap).

Lock files record the holder's pid, host and command (refusals name them) and are deleted when free:
a holder deletes its file while still holding it; the last shard to leave deletes the folder's file.
The kernel releases a flock when the holding process exits in any way (kill -9 included), so a file a
killed run leaves behind is no lock at all: the next run takes it over (and removes stale shard
files). A run that took a lock checks that the file it locked is still the one at the path, because
the previous holder may have deleted it in between.

While holding the lock, the temporaries of killed runs in the folder are removed
(:func:`wsi_milssl.atomic.clean_stale_temporaries`, which keeps the temporaries of processes that
still run). A shard does this only when every other shard writing the folder runs on its host: a
process id says nothing about another machine's processes (SLURM array tasks on several nodes).

Within one process the lock is re-entrant (a pipeline that holds ``OUT`` may call stages that lock
``OUT`` again); worker processes forked by a holder share it.

:func:`folder_mutex` is the short lock for a read-modify-write of a file that concurrent runs
(shards) share, such as a status CSV: ``DIR/.wsi-milssl.mutex``, held for the update only.

:func:`folder_writer` tells a reader of a stage's outputs (``evaluate``) which other run (or shard)
still writes a folder.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shlex
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from wsi_milssl.atomic import clean_stale_temporaries, find_write_error, output_error
from wsi_milssl.distributed import Shard
from wsi_milssl.errors import ConfigError, FolderLockedError, OutputError

__all__ = ["LOCK_FILENAME", "MUTEX_FILENAME", "folder_lock", "folder_mutex", "folder_writer", "folder_write_error",
           "lock_holder", "other_shards_writing", "shard_lock_filename"]

log = logging.getLogger(__name__)

LOCK_FILENAME = ".wsi-milssl.lock"
MUTEX_FILENAME = ".wsi-milssl.mutex"
_SHARD_RE = re.compile(r"^\.wsi-milssl\.shard-(?P<index>[0-9]+)-of-(?P<count>[0-9]+)\.lock$")
#: How long a shard retries a lock that another shard holds for a moment only (while it checks or
#: deletes a lock file) before it concludes that the lock is taken.
SHARD_GRACE_S = 2.0

# (thread, real path of a folder) this process holds -> nesting depth. Per thread: a call from another thread
# (a notebook's) is another run that must be refused, not a nested one (review BX: two fit() calls in two threads
# shared one run folder).
_held: dict[tuple[int, str], int] = {}
_held_guard = threading.Lock()


def shard_lock_filename(index: int, count: int) -> str:
    """Name of the lock file of shard ``index`` of ``count`` in a folder."""
    return f".wsi-milssl.shard-{index}-of-{count}.lock"


def _read_record(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def lock_holder(folder: str | os.PathLike, *, shard: tuple[int, int] | None = None) -> dict | None:
    """What the lock file of ``folder`` (with ``shard`` = (I, N): of that shard) says about its last
    holder (pid, command, host, started; shard), or None when there is no readable record. The holder
    may have finished since."""
    name = LOCK_FILENAME if shard is None else shard_lock_filename(*shard)
    return _read_record(Path(folder) / name)


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
    shard = f"shard {holder['shard']}, " if holder.get("shard") else ""
    return f"another wsi-milssl run ({shard}pid {pid}{where}{since}: {command})"


def _shard_records(folder: Path) -> list[dict]:
    """Records of the shard lock files in ``folder`` (live or left by killed runs), by shard."""
    found = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    for name in names:
        m = _SHARD_RE.match(name)
        record = _read_record(folder / name) if m else None
        if record:
            found.append((int(m.group("count")), int(m.group("index")), record))
    return [r for _, _, r in sorted(found, key=lambda t: t[:2])]


def _describe_folder(folder: Path) -> str:
    """Who writes ``folder``: the shards that hold it, else the record of its lock file."""
    shards = _shard_records(folder)
    if shards:
        more = len(shards) - 1
        return _describe(shards[0]) + (f" with {more} more shard{'s' if more > 1 else ''}" if more else "")
    return _describe(lock_holder(folder))


def _elsewhere(named_by: str | None) -> str:
    """The fix's advice to write elsewhere, for an output folder named by ``named_by`` (see
    :func:`folder_lock`); empty when writing elsewhere is no fix."""
    return f"write to another folder ({named_by})" if named_by else ""


def _locked_message(folder: Path, who: str, named_by: str | None) -> str:
    elsewhere = _elsewhere(named_by)
    return (f"{folder}: {who} is writing to this folder. Fix: wait until it finishes"
            f"{f', or {elsewhere}' if elsewhere else ''}.")


def _record(fd: int, shard: tuple[int, int] | None = None) -> None:
    """Write who holds the lock into the lock file (best effort: it only improves messages)."""
    program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    if program in ("__main__.py", "wsi-milssl"):  # python -m wsi_milssl, or the console script
        program = "wsi-milssl"
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
            "command": shlex.join([program, *sys.argv[1:]])}  # quoted: paths with blanks (review EV)
    if shard is not None:
        info["shard"] = f"{shard[0]}/{shard[1]}"
    data = (json.dumps(info) + "\n").encode("utf-8")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except OSError as exc:  # a full disk: the stage reports it where it writes its outputs
        log.debug("cannot record the lock holder: %s", exc)


def _check_shard(shard) -> tuple[int, int] | None:
    """(I, N) of a shard (a pair or a :class:`wsi_milssl.distributed.Shard`), or None for an unsharded
    run (no shard, or one of one)."""
    if shard is None:
        return None
    if isinstance(shard, Shard):
        shard = shard[:2]
    try:
        index, count = (int(v) for v in shard)
    except (TypeError, ValueError):
        raise ConfigError(f"shard {shard!r} is not a pair (I, N) of integers.") from None
    if count < 1 or not 0 <= index < count:
        raise ConfigError(f"shard {index}/{count}: the shard must be 0..{max(count, 1) - 1} of {count} (0-based), "
                          "and the count at least 1.")
    return None if count == 1 else (index, count)


def folder_write_error(folder: Path, cause: OSError, what: str, named_by: str | None) -> OutputError:
    """The OutputError for ``folder`` that cannot be written (``what``: "cannot write to this", "cannot
    create this"): :func:`~wsi_milssl.atomic.output_error`'s for an output folder; for a folder the run must
    write where it is (``named_by`` None: the stores ``label`` rewrites, an input; the run folder ``train
    --resume`` continues) neither "output" nor another folder, but a fix for the folder itself."""
    if named_by is not None:
        return output_error(folder, cause, what=f"{what} output folder", folder=folder)
    code = cause.errno
    why = cause.strerror or str(cause)
    if code == errno.EROFS:
        why, fix = f"{why}: {folder} is on a read-only file system", (
            "remount it read-write, or copy the folder to a writable disk and use the copy")
    elif code in (errno.EACCES, errno.EPERM):
        why, fix = f"{why}: no permission to write in {folder}", (
            f"make it writable (`chmod u+w {shlex.quote(str(folder))}`, or ask its owner), or copy the folder and use the copy")
    elif code in (errno.ENOSPC, errno.EDQUOT):
        why, fix = f"{why}: the disk is full", f"free disk space where {folder} lives (`df -h {shlex.quote(str(folder))}`), and re-run"
    else:
        fix = f"check free disk space and permissions of {folder}, then re-run"
    return OutputError(f"{folder}: {what} folder ({why}). Fix: {fix}.", errno=code)


def _create_folder(folder: Path, named_by: str | None = "--out") -> str:
    """Create ``folder`` (and its parents) and return its real path, the key of its locks; a folder that
    cannot be made (read-only file system, no permission, full disk) raises OutputError naming it
    (``named_by``: see :func:`folder_lock`)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return os.path.realpath(folder)
    except OSError as exc:
        cause = find_write_error(exc, access=True)
        if cause is None:
            raise
        raise folder_write_error(folder, cause, "cannot create this", named_by) from None


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()  # only an empty folder: anything written in it keeps it
    except OSError:
        pass


@contextmanager
def folder_lock(path: str | os.PathLike, *, wait: bool = False,
                shard: tuple[int, int] | None = None, named_by: str | None = "--out") -> Iterator[Path]:
    """Hold the lock of output folder ``path`` (created if missing) for the ``with`` block.

    ``shard`` = (I, N) with N > 1: hold it as shard I of N (see the module docstring): the other
    shards of the run may hold it too; an unsharded run, a second copy of shard I/N and shards with
    another N may not. None (or N = 1): hold it alone.

    When the lock is taken: with ``wait`` block until it is released, else raise FolderLockedError
    naming the folder, the other run's pid and command, and the fix: wait, or write to another folder.
    ``named_by`` says how the user names this folder, for that fix: ``"--out"`` (the default), or
    ``"OUT_DIR"`` where the command takes it as an argument (``synth``, ``demo``); None where writing
    elsewhere is no fix (``train --resume`` continues its own run folder; ``label`` rewrites the stores
    of the folders it is given), so the fix is to wait. A folder that cannot be written (read-only
    file system, no permission, full disk) raises OutputError naming it and the fix. After the lock is
    taken, temporaries left in the folder by killed runs are removed. An unsharded run that created the
    folder and fails with nothing written in it removes it again (an early refusal leaves no empty
    folder that looks like an output). Yields the folder path.
    """
    folder = Path(path)
    shard = _check_shard(shard)
    created = not folder.exists()
    key = (threading.get_ident(), _create_folder(folder, named_by))
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
    if shard is None:
        try:
            with _exclusive(folder, wait=wait, named_by=named_by):
                with _holding(key):
                    yield folder
        except BaseException:
            if created:  # a run refused or stopped before writing anything leaves no empty folder behind
                _remove_if_empty(folder)
            raise
    else:
        with _as_shard(folder, shard, wait=wait, named_by=named_by):
            with _holding(key):
                yield folder


@contextmanager
def _holding(key: tuple[int, str]) -> Iterator[None]:
    with _held_guard:
        _held[key] = 1
    try:
        yield
    finally:
        with _held_guard:
            _held.pop(key, None)


@contextmanager
def _exclusive(folder: Path, *, wait: bool, named_by: str | None) -> Iterator[None]:
    lock_file = folder / LOCK_FILENAME
    fd = _acquire(folder, lock_file, shared=False, wait=wait, grace=0.0, who=lambda: _describe_folder(folder),
                  named_by=named_by)
    try:
        _record(fd)
        try:
            _scan_shards(folder)  # no shard runs while the folder is held alone: their files are stale
            clean_stale_temporaries(folder)
            yield
        finally:
            try:
                os.unlink(lock_file)  # while still holding it: see the module docstring
            except OSError:
                pass
    finally:
        os.close(fd)  # releases the flock (forked workers that share it hold it until they exit)


@contextmanager
def _as_shard(folder: Path, shard: tuple[int, int], *, wait: bool, named_by: str | None) -> Iterator[None]:
    index, count = shard
    lock_file = folder / LOCK_FILENAME
    shard_file = folder / shard_lock_filename(index, count)
    fd = _acquire(folder, lock_file, shared=True, wait=wait, grace=SHARD_GRACE_S,
                  who=lambda: _describe(lock_holder(folder)), named_by=named_by)
    sfd = None
    try:
        sfd = _acquire(folder, shard_file, shared=False, wait=wait, grace=SHARD_GRACE_S,
                       who=lambda: _describe(_read_record(shard_file)), named_by=named_by)
        _record(sfd, shard)
        others = _scan_shards(folder, skip=shard_file.name)
        clash = [rec for (_, n), rec in others if n != count]
        if clash:
            elsewhere = _elsewhere(named_by)
            raise FolderLockedError(
                f"{folder}: {_describe(clash[0])} is writing to this folder as a shard of {_count_of(clash[0])}, "
                f"and this run is shard {index}/{count}: shards of one run must share the count. Fix: wait until "
                f"that run finishes{',' if elsewhere else ' or'} give every shard the same count"
                f"{f', or {elsewhere}' if elsewhere else ''}."
            )
        here = socket.gethostname()
        if all(rec and rec.get("host") == here for _, rec in others):
            clean_stale_temporaries(folder)
        else:
            log.info("%s: shards on other hosts write here; temporaries of killed runs are removed by a later run",
                     folder)
        yield
    finally:
        if sfd is not None:
            try:
                os.unlink(shard_file)  # while still holding it
            except OSError:
                pass
            os.close(sfd)
        _leave_shared(folder, fd, lock_file)


def _count_of(record: dict) -> str:
    return str(record.get("shard", "?/?")).split("/")[-1]


def _leave_shared(folder: Path, fd: int, lock_file: Path) -> None:
    """Release a shard's hold of the folder lock; the last shard out deletes the lock file (and the
    files of killed shards)."""
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # drops the shared lock first
        except OSError:
            return  # other shards still hold it
        if _same_file(fd, lock_file):
            _scan_shards(folder)
            try:
                os.unlink(lock_file)
            except OSError:
                pass
    finally:
        os.close(fd)


def _scan_shards(folder: Path, *, skip: str = "") -> list[tuple[tuple[int, int], dict | None]]:
    """The shards that hold their lock files in ``folder`` ((I, N), record or None when not yet
    readable); deletes the files of shards that are gone."""
    live = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return live
    for name in names:
        m = _SHARD_RE.match(name)
        if m is None or name == skip:
            continue
        path = folder / name
        if path.is_symlink():  # no shard writes a link: never opened (and written) through one (review EV)
            continue
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            continue
        except OSError:
            try:  # another user's shard file: a read-only descriptor takes the flock as well (review CB)
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                live.append(((int(m.group("index")), int(m.group("count"))), _read_record(path)))
                continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                live.append(((int(m.group("index")), int(m.group("count"))), _read_record(path)))
                continue
            if _same_file(fd, path):  # a killed shard's file (exclusive: nobody else may delete it now)
                try:
                    os.unlink(path)
                except OSError:
                    pass
        finally:
            os.close(fd)
    return live


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` is still the file open as ``fd`` (a holder may have deleted it meanwhile)."""
    try:
        mine = os.fstat(fd)
        current = os.stat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno == errno.ESTALE:  # a network file system: the file was deleted meanwhile
            return False
        raise
    return (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino)


def _try_flock(fd: int, operation: int, grace: float) -> bool:
    """Take the flock without blocking, retrying for ``grace`` seconds; False when it stays taken."""
    deadline = time.monotonic() + grace
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def _open_lock_file(folder: Path, lock_file: Path, named_by: str | None = "--out") -> int:
    """A descriptor of ``lock_file`` (created, as writable as ``folder`` is for its group and others). Another
    user's lock file that this user may not write, in a folder it may write, is opened read-only: flock takes
    such a descriptor, so a live run is named as the holder, and a dead run's file is replaced
    (:func:`_replace_if_read_only`; review CB: it was "no permission to write in FOLDER", with a chmod fix)."""
    try:  # not through a link (review EV: a link there had its target truncated and overwritten with the record)
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOENT and os.path.islink(lock_file)):
            raise OutputError(f"{lock_file}: is a symbolic link where wsi-milssl keeps the lock file of {folder}, so "
                              "it is not written through. Fix: remove the link (`rm "
                              f"{shlex.quote(str(lock_file))}`) and run again.", errno=exc.errno) from None
        if exc.errno in (errno.EACCES, errno.EPERM) and os.access(folder, os.W_OK | os.X_OK):
            try:
                return os.open(lock_file, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                pass
        cause = find_write_error(exc, access=True)
        if cause is None:
            raise
        raise folder_write_error(folder, cause, "cannot write to this", named_by) from None
    _share_like_folder(fd, folder)
    return fd


def _share_like_folder(fd: int, folder: Path) -> None:
    """Give a lock file this user owns the group and other write bits of its folder (a group's shared folder
    under umask 022: the next run of another member must open it read-write to record itself)."""
    try:
        st, folder_st = os.fstat(fd), os.stat(folder)
        if st.st_uid != os.geteuid():
            return
        wanted = folder_st.st_mode & 0o022
        mode = st.st_mode & 0o777
        if wanted & 0o020 and st.st_gid != folder_st.st_gid:  # the folder's group, not the creator's (no setgid)
            try:
                os.fchown(fd, -1, folder_st.st_gid)
            except OSError:  # not a group of this user's
                pass
        if wanted & ~mode:
            os.fchmod(fd, mode | wanted | (wanted << 1))  # the write bits and their read bits
    except OSError:  # best effort: the lock works without it
        pass


def _read_only(fd: int) -> bool:
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY


def _replace_if_read_only(fd: int, lock_file: Path, named_by: str | None = "--out") -> bool:
    """True (``fd`` closed and ``lock_file`` removed) when ``fd``, held exclusively, is a read-only descriptor of
    another user's lock file left by a run that ended: the caller opens a new file of its own. Where the file
    cannot be removed (a sticky folder, whose files only their owners may delete), FolderLockedError naming its
    owner (review CE: the caller looped on it for ever)."""
    if not _read_only(fd):
        return False
    try:
        os.unlink(lock_file)  # held exclusively: no run holds it
    except FileNotFoundError:
        pass
    except OSError:
        os.close(fd)
        raise _foreign_lock_error(lock_file, named_by) from None
    os.close(fd)
    return True


def _foreign_lock_error(lock_file: Path, named_by: str | None) -> FolderLockedError:
    """The refusal for another user's lock file that this user can neither write nor take over."""
    elsewhere = _elsewhere(named_by)
    try:
        import pwd

        uid = lock_file.stat().st_uid
        try:
            owner = pwd.getpwuid(uid).pw_name
        except KeyError:
            owner = f"uid {uid}"
    except OSError:
        uid, owner = None, "another user"
    if uid == os.geteuid():  # one's own file without write permission (NFS; review CF: "ask <oneself>")
        return FolderLockedError(
            f"{lock_file.parent}: {lock_file.name} is read-only, and this file system does not lock files opened "
            f"read-only. Fix: `chmod u+w {shlex.quote(str(lock_file))}` (or delete it when no run of yours writes "
            f"the folder){f', or {elsewhere}' if elsewhere else ''}.")
    return FolderLockedError(
        f"{lock_file.parent}: {lock_file.name} belongs to {owner}, and this user can neither write it nor replace "
        f"it here (a folder where only a file's owner may delete it, or a file system that does not lock files "
        f"opened read-only). Fix: ask {owner} or an administrator to delete {lock_file} when no run of theirs "
        f"writes the folder{f', or {elsewhere}' if elsewhere else ''}.")


def _acquire(folder: Path, lock_file: Path, *, shared: bool, wait: bool, grace: float,
             who: Callable[[], str], named_by: str | None) -> int:
    """Open and flock the lock file (shared or exclusive); returns its descriptor. ``who()`` describes
    the holder for the refusal, ``named_by`` how the folder is named (see :func:`folder_lock`). Retries when the file was deleted or replaced by the previous holder
    between our open and our flock."""
    operation = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    while True:
        fd = _open_lock_file(folder, lock_file, named_by)
        try:
            try:
                taken = _try_flock(fd, operation, grace)
            except OSError as exc:  # NFS turns flock into POSIX locks: no exclusive lock on a read-only file
                if exc.errno == errno.EBADF and _read_only(fd):
                    raise _foreign_lock_error(lock_file, named_by) from None
                raise
            if not taken:
                if not wait:
                    raise FolderLockedError(_locked_message(folder, who(), named_by))
                log.warning("%s: waiting for %s to finish", folder, who())
                fcntl.flock(fd, operation)
            same = _same_file(fd, lock_file)
        except BaseException:
            os.close(fd)
            raise
        if same and not shared and _replace_if_read_only(fd, lock_file, named_by):
            continue
        if same:
            return fd
        os.close(fd)  # the previous holder deleted the file after we opened it: take the new one


def _shard_alive(folder: Path, index: int, count: int) -> bool:
    """Whether shard (I, N) holds its lock file in ``folder`` now (a probe that deletes nothing)."""
    return _held_by_another(folder / shard_lock_filename(index, count))


def _held_by_another(lock_file: Path) -> bool:
    """Whether another process holds ``lock_file`` exclusively (a shared probe, released at once)."""
    try:
        fd = os.open(lock_file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return not _try_flock(fd, fcntl.LOCK_SH, 0.0)
    finally:
        os.close(fd)


def folder_writer(path: str | os.PathLike) -> str | None:
    """Who writes folder ``path`` now: the description of the other run (or of one of the shards) that
    holds its lock, with pid and command, or None when no run does (a run of this process does not
    count). For readers of a stage's outputs that must not read a half-written folder."""
    folder = Path(path)
    with _held_guard:
        if _held.get((threading.get_ident(), os.path.realpath(folder))):
            return None
    if _held_by_another(folder / LOCK_FILENAME):
        return _describe(lock_holder(folder))
    for name in _shard_names(folder):
        m = _SHARD_RE.match(name)
        if _shard_alive(folder, int(m.group("index")), int(m.group("count"))):
            return _describe(_read_record(folder / name))
    return None


def refuse_written_folder(path: str | os.PathLike, *, named_by: str | None = None) -> None:
    """FolderLockedError, as :func:`folder_lock` words it, when another run writes folder ``path`` now: for a
    command that takes the lock later and should be refused before its other work (review BJ: `train` printed
    its start line, and under torchrun the other ranks a second, misleading error, before the refusal)."""
    who = folder_writer(path)
    if who is not None:
        raise FolderLockedError(_locked_message(Path(path), who, named_by))


def folder_settings_record(path: str | os.PathLike, *, error: type[Exception]) -> dict | None:
    """The settings a stage recorded in its output folder (``path``: its ``tile_config.json``,
    ``label_config.json``, ``heatmap_config.json``), for a shard to compare with its own; None when there is none
    (or it is not a JSON object). ``error`` (the stage's error class) names the file and the fix when it cannot be
    read."""
    try:
        recorded = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise error(f"{path}: cannot read the settings of this folder ({exc}). Fix: write to a new folder with "
                    "--out, or pass --overwrite.") from None
    return recorded if isinstance(recorded, dict) else None


def other_shards_writing(path: str | os.PathLike, shard: tuple[int, int]) -> list[tuple[int, int]]:
    """The shards (I, N) other than ``shard`` that hold their lock in folder ``path`` now: the shards of a
    run still writing there (to tell them from an earlier, finished run's files)."""
    folder = Path(path)
    found = []
    for name in _shard_names(folder):
        m = _SHARD_RE.match(name)
        index, count = int(m.group("index")), int(m.group("count"))
        if (index, count) != (int(shard[0]), int(shard[1])) and _shard_alive(folder, index, count):
            found.append((index, count))
    return found


def _shard_names(folder: Path) -> list[str]:
    try:
        return sorted(n for n in os.listdir(folder) if _SHARD_RE.match(n))
    except OSError:
        return []


# ----------------------------------------------------------------------------------------------
# Short locks for shared files
# ----------------------------------------------------------------------------------------------

_mutex_guard = threading.Lock()
_mutex_threads: dict[str, threading.RLock] = {}
_mutex_depth: dict[str, int] = {}


@contextmanager
def folder_mutex(path: str | os.PathLike) -> Iterator[Path]:
    """Hold the short exclusive lock of folder ``path`` (created if missing) for a read-modify-write
    of a file that concurrent runs share (the shards' status and score CSVs). Blocks until it is free;
    threads of one process take turns; re-entrant in one thread. The lock file
    ``DIR/.wsi-milssl.mutex`` is a regular file (flock on it works across the hosts of a network file
    system) and is deleted before the lock is released, so none is left behind. Yields the folder.
    """
    folder = Path(path)
    key = _create_folder(folder)
    with _mutex_guard:
        guard = _mutex_threads.setdefault(key, threading.RLock())
    with guard:
        if _mutex_depth.get(key):
            _mutex_depth[key] += 1
            try:
                yield folder
            finally:
                _mutex_depth[key] -= 1
            return
        mutex = folder / MUTEX_FILENAME
        fd = _lock_mutex(folder, mutex)
        _mutex_depth[key] = 1
        try:
            yield folder
        finally:
            _mutex_depth[key] = 0
            try:
                os.unlink(mutex)  # while still holding it: a waiter that opened it retries on a new file
            except OSError:
                pass
            os.close(fd)


def _lock_mutex(folder: Path, mutex: Path) -> int:
    while True:
        fd = _open_lock_file(folder, mutex)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:
                if exc.errno == errno.EBADF and _read_only(fd):  # NFS: no exclusive lock on a read-only file
                    raise _foreign_lock_error(mutex, None) from None
                if exc.errno != errno.ESTALE:  # a network file system: the file was deleted meanwhile
                    raise
                same = False
            else:
                same = _same_file(fd, mutex)
        except BaseException:
            os.close(fd)
            raise
        if same and _replace_if_read_only(fd, mutex, None):
            continue
        if same:
            return fd
        os.close(fd)
