"""[train.grid] points trained at once ([pipeline].grid_workers): the same runs, scores and choice as one
point at a time (issue 13 item 3; on a GPU machine "auto" puts one point on each GPU)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from processes import workers_left_after_kill
from tinypipeline import FEATURE_BAGS, GENERATED_SLIDES, feature_bags
from wsi_milssl.errors import ConfigError
from wsi_milssl.pipeline import load_pipeline
from wsi_milssl.pipeline.training import grid_worker_count

# tiled at 5x, not the shared tables' 10x: a quarter of the patches, the same claim
PIPELINE = """
[pipeline]
name = "grid"
grid_workers = {workers}
""" + GENERATED_SLIDES.replace("magnification = 10.0", "magnification = 5.0") + """[train]
mode = "images"
model = "resnet18"
epochs = 2
batch_size = 32
mu_ramp_epochs = 1
num_workers = 0
threads = 1
plots = false
[train.grid]
mu = [0.1, 0.2]
"""

# every run in a fresh process, so torch's thread settings are the same for both
RUNNER = """
import sys
from wsi_milssl.pipeline import load_pipeline, run_pipeline
outcomes = run_pipeline(load_pipeline(sys.argv[1], out_dir=sys.argv[2]), until="train")
print([o.summary for o in outcomes if o.stage == "train"][0])
print([(o.stage, o.status) for o in outcomes])
"""


def _run(tmp_path: Path, workers: int, out: Path | None = None) -> tuple[Path, str]:
    toml = tmp_path / f"grid{workers}.toml"
    toml.write_text(PIPELINE.format(workers=workers))
    out = out or tmp_path / f"out{workers}"
    done = subprocess.run([sys.executable, "-c", RUNNER, str(toml), str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return out, done.stdout


def _seed(reference: Path, out: Path) -> None:
    """Start ``out`` with the slides, stores and labels of ``reference`` (their folders and stamps, the stamps'
    paths moved to ``out``): a run into ``out`` then only trains (the stages before are the same either way)."""
    (out / ".pipeline").mkdir(parents=True)
    for stage, folder in (("synth", "slides"), ("tile", "stores"), ("label", "labels")):
        shutil.copytree(reference / folder, out / folder, symlinks=True)
        stamp = (reference / ".pipeline" / f"{stage}.json").read_text()
        (out / ".pipeline" / f"{stage}.json").write_text(stamp.replace(str(reference), str(out)))


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory) -> tuple[Path, str]:
    """A run of the grid one point at a time (every stage up to train), and its output."""
    return _run(tmp_path_factory.mktemp("grid"), 1)


@pytest.mark.slow  # image mode; the default run trains a feature grid in worker processes
# (test_pipeline_runner_fixes::test_feature_grid_trains_points_in_worker_processes_like_one_at_a_time)
def test_grid_points_at_once_give_the_runs_of_one_at_a_time(one_at_a_time, tmp_path):
    one, summary_one = one_at_a_time
    _seed(one, tmp_path / "out2")
    two, summary_two = _run(tmp_path, 2, tmp_path / "out2")
    assert "grid of 2 in" in summary_two and "chose" in summary_two
    assert "('synth', 'skipped'), ('tile', 'skipped'), ('label', 'skipped'), ('train', 'ran')" in summary_two
    assert json.loads((one / "model" / "grid.json").read_text()) == json.loads((two / "model" / "grid.json").read_text())
    for ckpt in ("model/best.pt", "model/grid/mu-0.1/last.pt", "model/grid/mu-0.2/last.pt"):
        a = torch.load(one / ckpt, map_location="cpu", weights_only=True)["model"]
        b = torch.load(two / ckpt, map_location="cpu", weights_only=True)["model"]
        assert all(torch.equal(a[k], b[k]) for k in a), ckpt


def test_grid_workers_setting(tmp_path):
    assert grid_worker_count(3, 2) == 2 and grid_worker_count(1, 5) == 1
    assert grid_worker_count("auto", 4) == (max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1)
    bad = tmp_path / "bad.toml"
    bad.write_text(PIPELINE.format(workers=0))
    with pytest.raises(ConfigError, match=r"\[pipeline\].grid_workers must be"):
        load_pipeline(bad)
    ok = tmp_path / "ok.toml"
    ok.write_text(PIPELINE.format(workers='"auto"'))
    assert load_pipeline(ok).grid_workers == "auto"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_grid_trainers_of_a_killed_run_end(tmp_path):
    """A `run` killed while its grid points train at once: the trainers used to run on under pid 1, writing
    checkpoints into the run folders that the next `run` resumes; now they end within seconds. (A feature grid:
    the trainers are the same pool as an image grid's, and it reaches training at once.)"""
    feature_bags(tmp_path / "bags" / "train", 8, 0)
    feature_bags(tmp_path / "bags" / "test", 4, 1)
    toml = tmp_path / "grid.toml"
    toml.write_text('[pipeline]\nname = "grid"\ngrid_workers = 2\n' + FEATURE_BAGS.replace("epochs = 3", "epochs = 100000")
                    + "threads = 1\n[train.grid]\nmu = [0.1, 0.2]\n")
    left = workers_left_after_kill([sys.executable, "-c", RUNNER, str(toml), str(tmp_path / "out")],
                                   n_workers=2, start_s=120, settle_s=3)  # settled: initializers have run
    assert left == [], "the grid's trainers outlived the killed run"
