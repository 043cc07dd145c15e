"""``benchmark bags --workers N`` killed: its spawned workers end instead of training on under pid 1."""

from __future__ import annotations

import sys

import pytest
from processes import workers_left_after_kill


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_of_a_killed_bags_benchmark_end(tmp_path):
    left = workers_left_after_kill(
        [sys.executable, "-m", "wsi_milssl", "benchmark", "bags", "--protocol", "normal", "--ratios", "0.1",
         "--encoders", "mlp", "--epochs", "400", "--seeds", "0", "1", "--workers", "2", "--threads", "1",
         "--json", str(tmp_path / "bags.json")],
        n_workers=2, start_s=180, settle_s=2)  # settled: the workers have run their initializer and train
    assert left == [], "the pool workers outlived the killed benchmark"
    assert not (tmp_path / "bags.json").exists()
