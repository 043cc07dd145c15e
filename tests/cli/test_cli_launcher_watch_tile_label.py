"""Review AM, finding 2 (tile and label): a rank of a torchrun that is killed (kill -9, the OOM killer) went on as
an orphan, holding its shard's lock of --out; train and heatmap ranks already stopped (6be769f). Each test starts
the command as torchrun would (``TORCHELASTIC_RUN_ID`` set) from a stand-in launcher, holds it on a FIFO that
nothing writes (a slide, a labels file), kills the launcher and checks that the command stops and says why."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wsi_milssl.cli import main

# the rank: `python -m wsi_milssl ARGS` that says when the package is imported (before the seconds of torch imports)
_RANK = "import sys, wsi_milssl; print('imported', flush=True); from wsi_milssl.cli import main; sys.exit(main())"
_LAUNCHER = """
import os, subprocess, sys, time
env = dict(os.environ, TORCHELASTIC_RUN_ID="test", LOCAL_RANK="0")
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], env=env, stderr=open("rank.err", "w"),
                         stdout=subprocess.PIPE, text=True)
print(child.pid, flush=True)
print(child.stdout.readline().strip(), flush=True)
time.sleep(120)
"""
#: how long a rank may take to stop after its launcher is killed: it may still be importing torch (seconds on a
#: loaded machine) before it polls its parent every 0.5 s
STOP_S = 60


def _alive(pid: int) -> bool:
    """Running (a zombie, waiting for a parent that is gone to reap it, has stopped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill_launcher_and_wait(tmp_path: Path, *command: str, after_s: float) -> str:
    """Start ``command`` as a rank of a stand-in launcher, kill the launcher ``after_s`` seconds after the rank has
    imported ``wsi_milssl`` (0: while it still imports the rest, before its command runs) and return the rank's
    stderr once it has stopped."""
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _RANK, *command], cwd=tmp_path,
                                stdout=subprocess.PIPE, text=True)
    rank = int(launcher.stdout.readline())
    try:
        assert launcher.stdout.readline().strip() == "imported", (tmp_path / "rank.err").read_text()
        time.sleep(after_s)
        assert _alive(rank), (tmp_path / "rank.err").read_text()
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + STOP_S
        while _alive(rank) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(rank), "the rank went on after its launcher was killed"
    finally:
        if _alive(rank):
            os.kill(rank, signal.SIGKILL)
    return (tmp_path / "rank.err").read_text()


@pytest.fixture()
def env_without_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                      os.environ.get("PYTHONPATH", "")]))


@pytest.mark.parametrize("after_s", [0.0, 3.0], ids=["while-starting", "while-waiting"])
def test_a_tile_rank_stops_when_its_launcher_is_killed(tmp_path, env_without_torchrun, after_s):
    """Killed while the rank still imports torch (it used to read its launcher's pid only afterwards, found init
    instead and went on unwatched) or once it waits on its input."""
    os.mkfifo(tmp_path / "slide.tif")  # opening it waits for a writer that never comes
    err = _kill_launcher_and_wait(tmp_path, "tile", "slide.tif", "--out", "stores", after_s=after_s)
    assert "is gone" in err and "The same command again finishes the tiles" in err


def test_a_label_rank_stops_when_its_launcher_is_killed(tmp_path, env_without_torchrun):
    assert main(["-q", "synth", str(tmp_path / "slides"), "--slides", "1", "--seed", "1",
                 "--size-px", "2048", "2048"]) == 0
    assert main(["-q", "tile", str(tmp_path / "slides"), "--out", str(tmp_path / "stores")]) == 0
    (tmp_path / "annotations").mkdir()
    os.mkfifo(tmp_path / "labels.csv")
    err = _kill_launcher_and_wait(tmp_path, "label", "stores", "--annotations", "annotations", "--labels",
                                  "labels.csv", after_s=3.0)
    assert "is gone" in err and "The same command again finishes the labels" in err


def test_a_process_forked_from_a_rank_watches_its_own_parent(monkeypatch):
    """Review BA, B1: the launcher's pid is recorded when wsi_milssl is imported; a child forked later (torch's
    elastic_launch with start_method="fork" runs the CLI in such a child) inherited its parent's record, found
    that process was not its parent and stopped at once as if torchrun were gone."""
    import multiprocessing

    from wsi_milssl import parent_watch

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    ctx = multiprocessing.get_context("fork")
    queue = ctx.SimpleQueue()

    def child():
        watching = parent_watch.watch_launcher(message="")
        time.sleep(1.5)  # the watcher polls every 0.5 s: it would have interrupted this process by now
        queue.put((parent_watch.STARTED_BY_PID == os.getppid(), watching))

    proc = ctx.Process(target=child)
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0 and queue.get() == (True, True)
