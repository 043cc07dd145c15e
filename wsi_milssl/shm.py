"""Shared memory (``/dev/shm``): what is free, and the error when too little is.

The patch readers of slide inference and features (:mod:`wsi_milssl.inference.predict`) and training's data
workers (:mod:`wsi_milssl.mil.loader`) pass patches to the main process through ``/dev/shm``. A container gets
64 MB there by default (Docker without ``--shm-size`` or ``--ipc=host``, Kubernetes pods): a run that needs
more must say so before it starts, not die of a SIGBUS or wait forever for a batch a worker could not send."""

from __future__ import annotations

import errno
import os

from wsi_milssl.errors import OutputError

__all__ = ["SHM_DIR", "free_bytes", "shm_error", "mib"]

SHM_DIR = "/dev/shm"


def free_bytes() -> int | None:
    """Bytes free in :data:`SHM_DIR`, or None where there is none (macOS)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def mib(n_bytes: int) -> str:
    return f"{n_bytes / (1 << 20):.1f} MiB"


def shm_error(problem: str, code: int | None, *, fewer: str) -> OutputError:
    """OutputError ``/dev/shm: problem. Fix: ...``; the fix depends on the cause (``code``, an errno); ``fewer``:
    how to need less (``or run with fewer --workers ...``)."""
    more = (f"give the container more shared memory (`docker run --shm-size=16g`, or `--ipc=host`) or free "
            f"{SHM_DIR} (`df -h {SHM_DIR}`)")
    if code == errno.EFBIG:
        fix = f"raise the file-size limit (`ulimit -f`: shared memory counts as a file), {fewer}"
    elif code in (errno.ENOSPC, errno.ENOMEM):
        fix = f"{more}, {fewer}"
    else:  # a semaphore's failure without its cause (errno 0): a full /dev/shm or a file-size limit
        fix = f"{more}, raise the file-size limit (`ulimit -f`), {fewer}"
    return OutputError(f"{SHM_DIR}: {problem}. Fix: {fix}.", errno=code or None)
