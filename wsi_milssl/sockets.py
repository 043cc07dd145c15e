"""Where multiprocessing puts its sockets: below a short folder when the temporary folder's path is too long.

multiprocessing makes its fork server's socket, and the socket through which a process hands a file descriptor to
another (torch's DataLoader workers send their batches so), in a folder below TMPDIR
(``TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX``), and a socket path takes at most 107 bytes: a scheduler's per-job
TMPDIR of more than about 73 characters stopped heatmap and features with ``OSError: AF_UNIX path too long``, and
hung training with DataLoader workers, on Python 3.11 (review DC, DT; newer Pythons fall back themselves).
"""

from __future__ import annotations

import os
import tempfile

__all__ = ["fit_socket_paths"]

#: the longest socket path Linux takes (``sun_path``: 108 bytes with its terminating NUL)
SOCKET_PATH_MAX_BYTES = 107
#: what multiprocessing adds to its temporary folder's parent for a socket (``/pymp-XXXXXXXX/listener-XXXXXXXX``)
SOCKET_NAME_BYTES = 34


def fit_socket_paths() -> None:
    """Have multiprocessing put its sockets below /tmp (or /var/tmp) when the temporary folder's path is too long
    for one; nothing otherwise. Its folder is made once per process (and removed at exit) by multiprocessing, and
    processes started later inherit it; call this before starting any."""
    from multiprocessing import util

    if len(os.fsencode(tempfile.gettempdir())) + SOCKET_NAME_BYTES <= SOCKET_PATH_MAX_BYTES:
        return
    for base in ("/tmp", "/var/tmp"):
        if os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            before, tempfile.tempdir = tempfile.tempdir, base
            try:
                util.get_temp_dir()  # made once per process, then kept: every later socket goes below it
            finally:
                tempfile.tempdir = before
            return
