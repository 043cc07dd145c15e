"""A `features` run killed with SIGKILL leaves no reader process, fork server, resource tracker or
shared buffer behind (they used to stay for minutes: the readers wait for tasks forever and keep the fork
server alive). Processes are read from /proc (Linux)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state letter, command line) of every process."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2:].split()
        out[int(d.name)] = (int(rest[1]), rest[0], cmd)
    return out


def _children(pid: int, table) -> list[int]:
    return [p for p, (parent, _, _) in table.items() if parent == pid]


def _alive(pids, table) -> list[int]:
    return [p for p in pids if p in table and table[p][1] != "Z"]


def test_a_killed_features_run_leaves_no_reader_or_shared_memory(tmp_path, synth_dir):
    cmd = [sys.executable, "-m", "wsi_milssl", "features", str(synth_dir / "synth_000.tif"),
           str(synth_dir / "synth_001.tif"), "--out", str(tmp_path / "feats"), "--encoder", "resnet18",
           "--weights", "random", "--workers", "2", "--mpp", "0.25", "--patch-size", "64", "--device", "cpu",
           "--threads", "1", "--batch-size", "16"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    helpers: list[int] = []
    readers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            table = _processes()
            helpers = _children(proc.pid, table)  # the fork server and the resource tracker
            servers = [p for p in helpers if "forkserver" in table[p][2]]
            readers = _children(servers[0], table) if servers else []
            if len(readers) >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None and len(readers) >= 2, "the run ended before its readers were seen"
        buffers: set[str] = set()
        while not buffers and time.monotonic() < deadline and proc.poll() is None:  # a busy machine: the
            for pid in readers:                                                    # readers map them soon after
                try:
                    maps = Path(f"/proc/{pid}/maps").read_text()
                except OSError:
                    continue
                buffers |= {line.split()[-1] for line in maps.splitlines() if "/dev/shm/psm_" in line}
            time.sleep(0.05)
        assert buffers, "the readers mapped no shared buffer"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            left = _alive(readers + helpers, _processes()) + [b for b in buffers if os.path.exists(b)]
            if not left:
                break
            time.sleep(0.1)
        table = _processes()
        assert not _alive(readers, table), "reader processes outlived the killed run"
        assert not _alive(helpers, table), "the fork server or resource tracker outlived the killed run"
        assert not [b for b in buffers if os.path.exists(b)], "the shared buffer outlived the killed run"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _alive(readers + helpers, _processes()):  # what an old version leaves: end it here
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
