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

_LAUNCHER = """
import os, subprocess, sys, time
env = dict(os.environ, TORCHELASTIC_RUN_ID="test", LOCAL_RANK="0")
child = subprocess.Popen([sys.executable, "-m", "wsi_milssl", *sys.argv[1:]], env=env, stderr=open("rank.err", "w"))
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie, waiting for a parent that is gone to reap it, has stopped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill_launcher_and_wait(tmp_path: Path, *command: str) -> str:
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, *command], cwd=tmp_path, stdout=subprocess.PIPE,
                                text=True)
    rank = int(launcher.stdout.readline())
    try:
        time.sleep(3)  # the rank is set up and waits on the FIFO
        assert _alive(rank), (tmp_path / "rank.err").read_text()
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 15
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


def test_a_tile_rank_stops_when_its_launcher_is_killed(tmp_path, env_without_torchrun):
    os.mkfifo(tmp_path / "slide.tif")  # opening it waits for a writer that never comes
    err = _kill_launcher_and_wait(tmp_path, "tile", "slide.tif", "--out", "stores")
    assert "is gone" in err and "The same command again finishes the tiles" in err


def test_a_label_rank_stops_when_its_launcher_is_killed(tmp_path, env_without_torchrun):
    assert main(["-q", "synth", str(tmp_path / "slides"), "--slides", "1", "--seed", "1",
                 "--size-px", "2048", "2048"]) == 0
    assert main(["-q", "tile", str(tmp_path / "slides"), "--out", str(tmp_path / "stores")]) == 0
    (tmp_path / "annotations").mkdir()
    os.mkfifo(tmp_path / "labels.csv")
    err = _kill_launcher_and_wait(tmp_path, "label", "stores", "--annotations", "annotations", "--labels",
                                  "labels.csv")
    assert "is gone" in err and "The same command again finishes the labels" in err
