"""Worker processes that end when the process that started them is gone.

A main process killed (SIGKILL, or SIGTERM, which ends Python without cleanup) cannot shut its
process pool down, and a pool worker waiting for a task never notices (it holds the task queue's
write end itself): the workers are re-parented to pid 1 and run on, holding what they inherited (the
output folder's lock of :mod:`wsi_milssl.locks`, a shared buffer). Give a pool
:func:`watch_parent` as its initializer (``initializer=watch_parent, initargs=(os.getpid(),)``), or
call it from one, and every worker ends itself once the main process is gone.

The ranks that torchrun starts have the same problem one level up: torchrun killed (kill -9, the OOM
killer) cannot end them, and they train on as orphans holding the run folder's lock. A rank calls
:func:`watch_launcher` and stops as Ctrl-C would stop it once torchrun is gone.

Imports nothing beyond the standard library, so that small worker processes stay small.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

__all__ = ["watch_parent", "watch_launcher", "LAUNCHER_GRACE_S"]

#: This process's parent when ``wsi_milssl`` was imported (``wsi_milssl/__init__.py`` imports this module first
#: thing): torchrun, for a rank it started. Read later, after the seconds a rank spends importing torch, a launcher
#: killed in between would already have been replaced by init and the rank would never be watched.
STARTED_BY_PID = os.getppid()


def _forked() -> None:
    """A forked child's parent is the process it was forked from, not the one that started that process."""
    global STARTED_BY_PID
    STARTED_BY_PID = os.getppid()


os.register_at_fork(after_in_child=_forked)

#: How long a rank whose launcher is gone gives its interrupted main thread to end the process (its
#: KeyboardInterrupt may wait for a collective until the other ranks have stopped too) before it ends itself.
LAUNCHER_GRACE_S = 10.0


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


def watch_launcher(launcher_pid: int | None = None, *, message: str) -> bool:
    """Under torchrun (``TORCHELASTIC_RUN_ID`` in the environment), start a daemon thread that stops this
    process once torchrun, ``launcher_pid`` (default :data:`STARTED_BY_PID`, this process's parent when it
    started), is gone (at once when it is gone already): it logs ``message`` (an ERROR naming what to do: resume, run
    again; on the first rank of each machine, ``LOCAL_RANK`` 0, which shares the launcher with the others),
    then interrupts this process as Ctrl-C would (SIGINT: KeyboardInterrupt in the main thread, so the run
    ends as an interrupted one, exit code 130), and if it still runs :data:`LAUNCHER_GRACE_S` later (or
    SIGINT is ignored), ends it with exit code 130. Returns whether it watches: not without torchrun, so a
    plain single-process run is unaffected."""
    launcher_pid = STARTED_BY_PID if launcher_pid is None else launcher_pid
    if not os.environ.get("TORCHELASTIC_RUN_ID") or launcher_pid <= 1:
        return False
    threading.Thread(target=_stop_without_launcher, args=(launcher_pid, message), name="wsi-launcher-watch",
                     daemon=True).start()
    return True


def _stop_without_launcher(launcher_pid: int, message: str) -> None:
    while os.getppid() == launcher_pid:  # an orphan is given another parent (init, a subreaper)
        time.sleep(0.5)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        logging.getLogger(__name__).error("torchrun (pid %d), which started this rank, is gone (killed?): stopping "
                                          "as if interrupted. %s", launcher_pid, message)
    if callable(signal.getsignal(signal.SIGINT)):  # Python's handler: KeyboardInterrupt, as Ctrl-C
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(LAUNCHER_GRACE_S)
    logging.shutdown()  # flushes the console and --log-file
    os._exit(130)
