"""Atomic file output: write a temporary file in the same folder, fsync, rename.

A killed process never leaves a file under the final name that looks complete. Every stage writes
its small outputs (JSON, CSV, PNG, XML, checkpoints, the generated TIFF) through :func:`atomic_open`
or the helpers built on it; patch stores have their own commit step (:mod:`wsi_milssl.store`).

One rule names every temporary (:func:`temp_path`): ``.<final name>.<pid>.<random>.<kind>`` beside
the final file, so two writers never share a name, and the temporaries of a killed run are
recognised and removed by the next run that locks the folder (:func:`clean_stale_temporaries`,
called by :func:`wsi_milssl.locks.folder_lock`). Failures to write (full disk, read-only file
system, no permission) become :class:`~wsi_milssl.errors.OutputError` through :func:`output_error`.
"""

from __future__ import annotations

import csv
import errno as errno_
import io
import json
import logging
import os
import re
import secrets
import shlex
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator, Mapping, Sequence

from wsi_milssl.errors import OutputError

__all__ = [
    "TEMP_KINDS",
    "atomic_open",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_write_csv",
    "check_writable",
    "remove_quietly",
    "merge_csv_rows",
    "clean_stale_temporaries",
    "find_write_error",
    "output_error",
    "preallocate",
    "temp_path",
]

log = logging.getLogger(__name__)

#: The kinds of temporary :func:`temp_path` makes: a file being written (``tmp``), a patch store or
#: slide being written (``partial``), the old copy of a store during a swap (``old``), scratch space.
TEMP_KINDS: tuple[str, ...] = ("tmp", "partial", "old", "scratch")
_TEMP_RE = re.compile(r"^\.(?P<target>.+)\.(?P<pid>[1-9][0-9]{0,9})\.(?P<token>[0-9a-f]{8})\.(?P<kind>%s)$"
                      % "|".join(TEMP_KINDS))

# errno values that can only come from writing: translated wherever they appear.
_WRITE_ERRNOS = {errno_.ENOSPC, errno_.EDQUOT, errno_.EFBIG, errno_.EROFS}
# ... and these too when they come from opening or renaming the output itself.
_ACCESS_ERRNOS = {errno_.EACCES, errno_.EPERM}
#: the longest file name (one path component) that Linux and macOS file systems take, in bytes
NAME_MAX_BYTES = 255


def temp_path(path: str | os.PathLike, *, kind: str = "tmp") -> Path:
    """A new, unique temporary name beside ``path``: ``.<name>.<pid>.<8 hex>.<kind>``.

    Hidden (store and slide searches skip it), unique per call (process id and a random token), and
    recognisable by :func:`clean_stale_temporaries` once its process is gone. ``<name>`` is cut to fit the
    file system's 255-byte limit on a name, so that a file whose own name fits can be written (a slide
    named with 240 characters).
    """
    if kind not in TEMP_KINDS:
        raise ValueError(f"temporary kind must be one of {', '.join(TEMP_KINDS)}; got {kind!r}.")
    path = Path(path)
    tail = f".{os.getpid()}.{secrets.token_hex(4)}.{kind}"
    name = os.fsencode(path.name)[:NAME_MAX_BYTES - 1 - len(tail)]  # a cut inside a character: surrogate escapes
    return path.with_name(f".{os.fsdecode(name)}{tail}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    except OSError:
        return True
    return True


def clean_stale_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Delete the temporaries (files or folders named by :func:`temp_path`) in ``folder`` whose
    process no longer exists; returns what was removed.

    Call it only while holding the folder's lock (:func:`wsi_milssl.locks.folder_lock` does): every
    writer into the folder then either holds the lock (this process) or is gone. Temporaries of a
    process that still runs are kept (a reused process id only delays the clean-up). Not recursive, but for the
    subfolders :data:`LOCKED_SUBFOLDERS` that a stage writes under its folder's lock (review CQ: ``qc/``).
    """
    folder = Path(folder)
    removed: list[Path] = []
    for name in LOCKED_SUBFOLDERS:
        if (folder / name).is_dir() and not (folder / name).is_symlink():
            removed += _clean_stale_temporaries_here(folder / name)
    return removed + _clean_stale_temporaries_here(folder)


#: Subfolders written only by the run that holds their parent folder's lock (tile's quality-control images).
LOCKED_SUBFOLDERS = ("qc",)


def _clean_stale_temporaries_here(folder: Path) -> list[Path]:
    """:func:`clean_stale_temporaries` of ``folder`` itself (no subfolder)."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP_RE.match(entry.name)
        if m is None:
            continue
        pid = int(m.group("pid"))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        path = folder / entry.name
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError as exc:
            log.warning("%s: cannot remove the temporary left by a killed run (%s)", path, exc)
            continue
        log.info("%s: removed a temporary left by a run that was killed (pid %d)", path, pid)
        removed.append(path)
    return removed


def find_write_error(exc: BaseException, *, access: bool = False) -> OSError | None:
    """The OSError behind ``exc`` (itself, or its cause/context: torch and h5py wrap them) that says
    the output cannot be written (disk full, file too large, read-only; with ``access`` also
    permission denied), or None."""
    wanted = _WRITE_ERRNOS | (_ACCESS_ERRNOS if access else set())
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, OSError) and exc.errno in wanted:
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def output_error(path: str | os.PathLike, exc: OSError, *, what: str = "cannot write this file",
                 folder: str | os.PathLike | None = None) -> OutputError:
    """An OutputError for a failed write of ``path``: ``PATH: what (cause). Fix: ...``.

    The fix depends on the cause: free space (full disk or quota), another file system (read-only,
    file too large), permissions, or a path whose folder cannot be made. ``folder`` (default: the parent
    of ``path``) is the folder named in the fix, quoted for a shell in a command; without permission, the
    nearest folder of ``folder`` that exists (the one that refused a folder to be made in it) is named.
    """
    path = Path(path)
    folder = Path(folder) if folder is not None else path.parent
    code = exc.errno
    cause = exc.strerror or str(exc)
    if code in (errno_.ENOSPC, errno_.EDQUOT):
        cause, fix = f"{cause}: the disk is full", (
            f"free disk space where {folder} lives (`df -h {shlex.quote(str(folder))}`), or write to another "
            "folder, and re-run")
    elif code == errno_.EROFS:
        cause, fix = f"{cause}: {folder} is on a read-only file system", (
            "write to a folder on a writable disk (another --out), or remount it read-write")
    elif code == errno_.EFBIG:
        cause, fix = f"{cause}: the file grew past a size limit", (
            f"raise the file-size limit (`ulimit -f`) or write to another file system than {folder}'s")
    elif code in (errno_.EACCES, errno_.EPERM):
        existing = _nearest_existing(folder)
        cause, fix = f"{cause}: no permission to write in {existing}", (
            f"make it writable (`chmod u+w {shlex.quote(str(existing))}`) or write to another folder")
    elif code == errno_.ENAMETOOLONG:
        n_bytes = len(os.fsencode(path.name))
        cause, fix = (f"{cause}: the name is {n_bytes} bytes long" if n_bytes > NAME_MAX_BYTES else
                      f"{cause}: the path is too long"), (
            f"shorten the name (file systems take at most {NAME_MAX_BYTES} bytes; an output named after a slide "
            "adds up to 16 characters to the slide's name), e.g. rename the slide, or write to a shorter folder path")
    elif code == errno_.EISDIR:
        cause, fix = f"{cause}: {path} is a folder", "give the path of a file, or move the folder away"
    elif code in (errno_.ENOENT, errno_.ENOTDIR, errno_.EEXIST) and folder.is_dir():
        cause, fix = f"{cause}: no file can be made in {folder}", (
            "write to a folder on an ordinary writable disk (another output path)")
    elif code in (errno_.ENOENT, errno_.ENOTDIR, errno_.EEXIST):
        cause, fix = f"{cause}: {folder} cannot be made there", (
            "give a path under a folder that exists and is writable (a part of this one is missing or is a "
            "file)")
    else:
        fix = f"check free disk space and permissions of {folder}, then re-run"
    return OutputError(f"{path}: {what} ({cause}). Fix: {fix}.", errno=code)


def _nearest_existing(folder: Path) -> Path:
    """``folder``, or its nearest parent folder that exists: where a folder to be made was refused. A path behind
    a folder without search permission cannot be looked at, and counts as missing."""
    while True:
        try:
            os.stat(folder)
            return folder
        except OSError:
            if folder.parent == folder:
                return folder
            folder = folder.parent


def preallocate(fd: int, n_bytes: int) -> None:
    """Reserve the first ``n_bytes`` of the open file ``fd`` on its disk now (``posix_fallocate``).

    A file that is written through a memory map (or a shared-memory segment) is sparse until its pages
    are touched; on a full disk that touch is a SIGBUS that kills the process ("Bus error"), where a
    write(2) would have failed. After this call a full disk or a file-size limit has already raised
    OSError (ENOSPC, EFBIG), which :func:`output_error` turns into the usual message. A file system
    without ``fallocate`` (EOPNOTSUPP, EINVAL) or a system without the call leaves the file as it is.
    """
    if n_bytes <= 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, n_bytes)
    except OSError as exc:
        if exc.errno not in (errno_.EOPNOTSUPP, errno_.EINVAL):
            raise


def remove_quietly(path: str | os.PathLike) -> None:
    """Delete ``path`` if it is there; a failure (a read-only folder) is ignored."""
    try:
        Path(path).unlink(missing_ok=True)
    except OSError:  # a read-only folder: nothing was created there
        pass


def check_writable(*paths: str | os.PathLike | None) -> None:
    """Fail now rather than after a long run: for every given ``path`` (None is skipped), create its
    folder and a temporary file beside it, then remove the temporary. A path that cannot be written
    raises OutputError naming it and the fix; an existing file is left as it is."""
    for path in paths:
        if path is None:
            continue
        path = Path(path)
        _refuse_folder(path)
        tmp = temp_path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb"):
                pass
        except OSError as exc:
            raise output_error(path, find_write_error(exc, access=True) or exc) from None
        finally:
            remove_quietly(tmp)


def _refuse_folder(path: Path) -> None:
    """OutputError naming ``path`` when it is an existing folder (a file cannot replace it)."""
    if os.path.isdir(path):  # False for a name too long (Path.is_dir raises), which the write then names
        raise output_error(path, IsADirectoryError(errno_.EISDIR, os.strerror(errno_.EISDIR), str(path)))


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary sibling of ``path`` for writing; on success fsync and rename it to ``path``.

    The temporary name is unique per call (:func:`temp_path`), and the file gets the usual
    permissions (0666 minus the umask). Text modes write UTF-8 with newlines untranslated (as the
    csv module expects). On an exception nothing is left behind. A full disk, a read-only file
    system, a folder without write permission or one that cannot hold a new file (``/proc``), and a
    ``path`` that is a folder, raise OutputError naming ``path`` and the fix.
    """
    path = Path(path)
    _refuse_folder(path)
    tmp = temp_path(path)
    text = {} if "b" in mode else {"encoding": "utf-8", "newline": ""}
    try:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fh = open(tmp, mode, **text)
        except OSError as exc:
            cause = find_write_error(exc, access=True)
            if cause is None and exc.filename != str(tmp):
                raise  # mkdir met a file in the way of the folder: the CLI names that folder
            raise output_error(path, cause or exc) from None
        try:
            with fh:
                yield fh
                fh.flush()
                os.fsync(fh.fileno())
        except Exception as exc:
            cause = find_write_error(exc)
            if cause is None:
                raise
            raise output_error(path, cause) from None
        try:
            os.replace(tmp, path)
        except OSError as exc:  # e.g. a folder made at ``path`` meanwhile: name the path, not the temporary
            raise output_error(path, exc) from None
    finally:
        remove_quietly(tmp)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path."""
    with atomic_open(path, "wb") as fh:
        fh.write(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` as UTF-8 to ``path`` atomically; returns the path. A file name that is no UTF-8 in it (a
    surrogate escape) is written escaped, ``\\udce9`` (review EY: a status CSV naming such a slide ended the batch
    in a UnicodeEncodeError traceback)."""
    return atomic_write_bytes(path, text.encode("utf-8", errors="backslashreplace"))


def atomic_write_json(path: str | os.PathLike, data: Any, *, sort_keys: bool = False) -> Path:
    """Write ``data`` as indented JSON (NaN is not allowed: use None)."""
    return atomic_write_text(path, json.dumps(data, indent=2, allow_nan=False, sort_keys=sort_keys) + "\n")


def atomic_write_csv(path: str | os.PathLike, rows: Sequence[Mapping[str, Any]], *, columns: Sequence[str]) -> Path:
    """Write ``rows`` as a CSV with a header of ``columns`` (None becomes an empty cell)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow(["" if row.get(c) is None else row.get(c) for c in columns])
    return atomic_write_text(path, buf.getvalue())


def merge_csv_rows(path: str | os.PathLike, rows: Sequence[Mapping[str, Any]], *, columns: Sequence[str],
                   key: str = "slide") -> Path:
    """Add or replace ``rows`` (matched by their ``key`` column) in the CSV at ``path`` and rewrite it
    atomically with a header of ``columns`` and every row sorted by ``key``; rows of other keys (other
    shards of a run, earlier runs) are kept. None becomes an empty cell.

    The read-modify-write runs under :func:`wsi_milssl.locks.folder_mutex` of the CSV's folder, so runs
    that update one file at once (shards) lose no row, and one run or N shards leave the same file. A
    file that cannot be read as such a CSV is replaced, with a warning.
    """
    from wsi_milssl.locks import folder_mutex  # locks imports this module

    path = Path(path)
    with folder_mutex(path.parent):
        merged = _read_csv_rows(path, key)
        for row in rows:
            merged[str(row[key])] = {c: "" if row.get(c) is None else str(row.get(c)) for c in columns}
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n", extrasaction="ignore",
                                restval="")
        writer.writeheader()
        for k in sorted(merged):
            writer.writerow(merged[k])
        return atomic_write_text(path, buf.getvalue())


def _read_csv_rows(path: Path, key: str) -> dict[str, dict[str, str]]:
    if not path.is_file():
        return {}
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            if key not in (reader.fieldnames or ()):
                raise ValueError(f"no {key!r} column")
            return {row[key]: row for row in reader if row.get(key)}
    except (OSError, ValueError, UnicodeDecodeError, csv.Error) as exc:
        log.warning("%s: cannot read its rows (%s); the file is written anew", path, exc)
        return {}
