"""Processes seen through /proc (Linux): the pool workers of a run, and whether they are still alive.
For the tests that kill a run and check that its workers end with it."""

from __future__ import annotations

import os


def spawned_children(pid: int) -> list[int]:
    """Live (not zombie) pool workers (multiprocessing's spawn_main) whose parent is ``pid``."""
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
        if int(ppid) == pid and state != "Z" and b"spawn_main" in cmdline:
            found.append(int(name))
    return found


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie not yet reaped does not)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
