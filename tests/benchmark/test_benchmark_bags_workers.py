"""``benchmark bags --workers N`` killed: its spawned workers end instead of training on under pid 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from processes import alive, spawned_children


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_of_a_killed_bags_benchmark_end(tmp_path):
    run = subprocess.Popen(
        [sys.executable, "-m", "wsi_milssl", "benchmark", "bags", "--protocol", "normal", "--ratios", "0.1",
         "--encoders", "mlp", "--epochs", "400", "--seeds", "0", "1", "--workers", "2", "--threads", "1",
         "--json", str(tmp_path / "bags.json")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while len(workers) < 2:
            assert run.poll() is None and time.monotonic() < deadline, "the run never started its two workers"
            workers = spawned_children(run.pid)
            time.sleep(0.05)
        time.sleep(2)  # the workers have run their initializer and are training
        os.kill(run.pid, signal.SIGKILL)
        run.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [w for w in workers if alive(w)]
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        for w in workers:  # the old behaviour: leave no orphans behind
            if alive(w):
                os.kill(w, signal.SIGKILL)
    assert left == [], "the pool workers outlived the killed benchmark"
    assert not (tmp_path / "bags.json").exists()
