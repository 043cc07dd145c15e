"""Worker processes that end when the process that started them is gone.

A main process killed (SIGKILL, or SIGTERM, which ends Python without cleanup) cannot shut its
process pool down, and a pool worker waiting for a task never notices (it holds the task queue's
write end itself): the workers are re-parented to pid 1 and run on, holding what they inherited (the
output folder's lock of :mod:`wsi_milssl.locks`, a shared buffer). Give a pool
:func:`watch_parent` as its initializer (``initializer=watch_parent, initargs=(os.getpid(),)``), or
call it from one, and every worker ends itself once the main process is gone.

Imports nothing beyond the standard library, so that small worker processes stay small.
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["watch_parent"]


def watch_parent(main_pid: int) -> None:
    """Start a daemon thread that ends this process (exit code 1, no cleanup) as soon as the process
    ``main_pid`` is gone. The thread waits on multiprocessing's sentinel of the parent (a pipe the
    main process holds open while it has this worker) when ``main_pid`` is that parent, else polls the
    pid twice a second."""
    threading.Thread(target=_end_with_main, args=(main_pid,), name="wsi-parent-watch", daemon=True).start()


def _end_with_main(main_pid: int) -> None:
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid == main_pid:
        parent.join()  # returns once the main process is gone (or has let this worker go)
    else:
        while True:
            time.sleep(0.5)
            try:
                os.kill(main_pid, 0)
            except ProcessLookupError:
                break
            except PermissionError:
                pass
    os._exit(1)
