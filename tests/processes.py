"""Processes seen through /proc (Linux): the pool workers of a run, and whether they are still alive.
For the tests that kill a run, or one of its workers, and check what happens."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def children(pid: int, *, cmdline_has: bytes = b"") -> list[int]:
    """Live (not zombie) processes whose parent is ``pid`` (and whose command line holds ``cmdline_has``)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = open(f"/proc/{name}/stat").read()
            cmdline = open(f"/proc/{name}/cmdline", "rb").read()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z" and cmdline_has in cmdline:
            found.append(int(name))
    return found


def spawned_children(pid: int) -> list[int]:
    """Live (not zombie) pool workers (multiprocessing's spawn_main) whose parent is ``pid``."""
    return children(pid, cmdline_has=b"spawn_main")


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie not yet reaped does not)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def workers_left_after_kill(argv: list[str], *, n_workers: int, start_s: float, settle_s: float,
                            end_s: float = 20.0) -> list[int]:
    """Start ``argv``, wait (up to ``start_s``) until it has ``n_workers`` spawned pool workers, give them
    ``settle_s`` to run their initializer, kill -9 the main process and return the workers still alive
    ``end_s`` later (none once they end with their parent). Kills whatever is left either way."""
    import signal
    import subprocess
    import time

    run = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + start_s
        while len(workers) < n_workers:
            assert run.poll() is None and time.monotonic() < deadline, "the run never started its workers"
            workers = spawned_children(run.pid)
            time.sleep(0.05)
        time.sleep(settle_s)
        os.kill(run.pid, signal.SIGKILL)
        run.wait(timeout=30)
        deadline = time.monotonic() + end_s
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [w for w in workers if alive(w)]
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        for w in workers:  # the old behaviour: leave no orphans behind
            if alive(w):
                os.kill(w, signal.SIGKILL)


def hold_lock(folder: str | Path, *, seconds: float = 60, shard: tuple[int, int] | None = None) -> subprocess.Popen:
    """Another process that takes ``folder``'s lock (as ``shard``), as a running wsi-milssl run holds its
    folder, and keeps it for ``seconds``; returned once it holds the lock. End it with :func:`release`."""
    proc = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "from wsi_milssl.locks import folder_lock\n"
        f"with folder_lock({str(folder)!r}, shard={shard!r}):\n"
        "    print('locked', flush=True)\n"
        f"    time.sleep({seconds})\n"
    )], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def release(proc: subprocess.Popen) -> None:
    """End a :func:`hold_lock` process (its lock is free again)."""
    proc.kill()
    proc.wait()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for ranks started by hand (MASTER_PORT). Drawn below the
    kernel's ephemeral range (``ip_local_port_range``, 32768-60999 by default), from which every port-0 bind and
    outgoing connection of the other tests takes its port, so that none of them takes it before rank 0 binds it."""
    import random
    import socket

    low = 20000
    try:
        low_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low_ephemeral = 32768
    high = max(low + 1000, low_ephemeral - 1)
    for _ in range(200):
        port = random.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise AssertionError(f"no free port in {low}-{high}")
