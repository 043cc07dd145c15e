"""Real write failures for the reliability tests (issue 14): a full disk and a read-only folder.

Each helper picks, at run time, the most real method this machine allows, and never skips:

- **Full disk.** A small ``tmpfs`` mounted on the test folder (``mount`` needs root with mount
  permission: the development machine has it, a CI container usually not) gives a real ENOSPC.
  Otherwise ``RLIMIT_FSIZE``: the kernel refuses any write past N bytes of a file with EFBIG (Python
  ignores SIGXFSZ), a real failed ``write(2)`` for Python and for C libraries such as HDF5 alike.
- **Read-only folder.** A read-only ``tmpfs`` mount gives a real EROFS. ``chmod 555`` is no
  substitute: the tests run as root, who ignores permission bits. Otherwise the opening calls
  (``os.open``, ``open``, ``os.mkdir``) raise ``OSError(EROFS)`` for paths under the folder, which is
  where the kernel reports EROFS too.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import resource
import subprocess
import tempfile
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

import pytest

__all__ = ["can_mount", "full_disk", "file_size_limit", "read_only_folder"]


def _mount(target: Path, options: str) -> bool:
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
                            capture_output=True, text=True)
    return result.returncode == 0


def _bind_read_only(target: Path) -> bool:
    """Mount ``target`` read-only over itself (its files stay visible); False where the machine refuses."""
    if subprocess.run(["mount", "--bind", str(target), str(target)], capture_output=True).returncode != 0:
        return False
    if subprocess.run(["mount", "-o", "remount,ro,bind", str(target)], capture_output=True).returncode != 0:
        _umount(target)
        return False
    return True


def _umount(target: Path) -> None:
    subprocess.run(["umount", "-l", str(target)], capture_output=True)


@lru_cache(maxsize=1)
def can_mount() -> bool:
    """Whether this process may mount a tmpfs (root with CAP_SYS_ADMIN, no seccomp veto).

    ``WSI_MILSSL_TEST_NO_MOUNT=1`` answers no, to run the fallbacks that CI containers use."""
    if os.environ.get("WSI_MILSSL_TEST_NO_MOUNT") == "1":
        return False
    try:
        with tempfile.TemporaryDirectory() as d:
            if not _mount(Path(d), "size=64k"):
                return False
            _umount(Path(d))
            return True
    except OSError:  # no mount binary
        return False


@contextmanager
def file_size_limit(n_bytes: int) -> Iterator[None]:
    """Within the block, this process cannot grow any file past ``n_bytes`` (EFBIG)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _limit_child(n_bytes: int) -> Callable[[], None]:
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, n_bytes))

    return preexec


@contextmanager
def full_disk(folder: Path, *, n_bytes: int) -> Iterator[tuple[str, Callable[[], None] | None]]:
    """Make ``folder`` a place where writes fail after about ``n_bytes``.

    Yields ``(method, preexec)``: method 'tmpfs' (a tmpfs of ``n_bytes`` is mounted on ``folder``;
    writes fail with ENOSPC) or 'rlimit' (``preexec`` limits a child process's files to ``n_bytes``
    (EFBIG); use it as ``subprocess.run(..., preexec_fn=preexec)``, or wrap in-process work in
    :func:`file_size_limit`). ``preexec`` is None for 'tmpfs'.
    """
    folder.mkdir(parents=True, exist_ok=True)
    if can_mount() and _mount(folder, f"size={max(n_bytes // 1024, 64)}k"):
        try:
            yield "tmpfs", None
        finally:
            _umount(folder)
    else:
        yield "rlimit", _limit_child(n_bytes)


@contextmanager
def read_only_folder(folder: Path) -> Iterator[str]:
    """Make ``folder`` read-only for this process: yields 'mount' or 'injected'. A folder that is missing or empty
    becomes an empty read-only tmpfs; one with files a read-only bind mount of itself, its files kept."""
    folder.mkdir(parents=True, exist_ok=True)
    if can_mount() and any(folder.iterdir()) and _bind_read_only(folder):
        try:
            yield "mount"
        finally:
            _umount(folder)
        return
    if can_mount() and not any(folder.iterdir()) and _mount(folder, "ro,size=64k"):
        try:
            yield "mount"
        finally:
            _umount(folder)
        return
    root = os.path.realpath(folder)

    def inside(path) -> bool:
        try:
            p = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return p == root or p.startswith(root + os.sep)

    def erofs(path):
        return OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))

    real_os_open, real_open, real_mkdir = os.open, builtins.open, os.mkdir
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def os_open(path, flags, *args, **kwargs):
        if flags & writing and inside(path):
            raise erofs(path)
        return real_os_open(path, flags, *args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+") and inside(file):
            raise erofs(file)
        return real_open(file, mode, *args, **kwargs)

    def mkdir(path, *args, **kwargs):
        if inside(path) and not os.path.isdir(path):
            raise erofs(path)
        return real_mkdir(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "open", os_open)
        mp.setattr(builtins, "open", open_)
        mp.setattr(io, "open", open_)
        mp.setattr(os, "mkdir", mkdir)
        yield "injected"
