"""``wsi-milssl run`` after a kill: it goes on from what is finished and ends with the files of an
uninterrupted run (issue 15, deliverable 2: tile, train and heatmap).

A child process runs the pipeline and kills itself with SIGKILL at a chosen progress event (inside
a slide being tiled; inside the second epoch of the second grid point; after the first test slide's
heatmap is recorded, the second in flight), so the interruption lands
at the same place every time. The run is then started again, in a fresh process as every run here, up
to the stage that was killed (to the end for heatmap), and its outputs compared with those of a run that
was never interrupted; given equal stores and models, the later stages are the heatmap test's.
"""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tinypipeline import GENERATED_SLIDES
from wsi_milssl.inference.stage import STATUS_FILENAME
from wsi_milssl.store import find_stores, open_store

# GENERATED_SLIDES ends in its [tile] table: "workers = 1" is one more key of it
PIPELINE = """
[pipeline]
name = "resume"
""" + GENERATED_SLIDES + """workers = 1
[train]
mode = "images"
model = "resnet18"
epochs = 2
batch_size = 32
mu_ramp_epochs = 1
num_workers = 0
plots = false
[train.grid]
mu = [0.1, 0.2]
[heatmap]
num_workers = 0
thumbnail_px = 128
[evaluate]
thumbnail_px = 64
"""

# Runs the pipeline in a fresh process (every run of a test starts alike: torch's thread settings
# left by other tests in the pytest process would change the floating-point sums), prints each
# progress event and the outcomes as JSON lines, and with a rule SIGKILLs itself at that event.
RUNNER = r"""
import json, os, signal, sys
from wsi_milssl.pipeline import load_pipeline, run_pipeline

toml, out, where, until = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
state = {"tiled": 0, "epochs": 0}

def progress(event):
    print(json.dumps({"stage": event.stage, "done": event.done, "item": event.item, "message": event.message}),
          flush=True)
    if where == "tile":      # inside the third slide of the training set, its store half written
        if event.stage == "tile" and event.done > 0:
            state["tiled"] += 1
        elif event.stage == "tile-patches" and event.done > 0 and state["tiled"] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    elif where == "train":   # inside the 2nd epoch of the 2nd grid point (the 1st point is finished)
        if event.stage == "train" and event.done > 0:
            state["epochs"] += 1
        elif event.stage == "train-epoch" and event.done > 0 and state["epochs"] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
    elif where == "heatmap":  # the first test slide's files are written, the second slide is in flight
        if event.stage == "heatmap" and event.done == 1 and event.item:
            os.kill(os.getpid(), signal.SIGKILL)

outcomes = run_pipeline(load_pipeline(toml, out_dir=out), progress=progress, until=None if until == "-" else until)
print(json.dumps({"outcomes": [[o.stage, o.status] for o in outcomes]}), flush=True)
"""


def _run(toml: Path, out: Path, kill_at: str = "", until: str = "") -> tuple[list[dict], list[list[str]]]:
    """Run the pipeline in a child process (killed at ``kill_at`` when given; up to ``until`` when given):
    its events and outcomes."""
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(toml), str(out), kill_at or "-", until or "-"],
                          capture_output=True, text=True, timeout=900)
    if kill_at:
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    outcomes = [line["outcomes"] for line in lines if "outcomes" in line]
    return [line for line in lines if "stage" in line], (outcomes[0] if outcomes else [])


def _seed(reference: Path, out: Path, stages: tuple[str, ...]) -> None:
    """Start ``out`` with the finished stages of the uninterrupted run (their folders and stamps, the
    stamps' paths moved to ``out``), so a test only repeats the stages it interrupts."""
    import shutil

    folders = {"synth": "slides", "tile": "stores", "label": "labels", "train": "model"}
    (out / ".pipeline").mkdir(parents=True)
    for stage in stages:
        shutil.copytree(reference / folders[stage], out / folders[stage], symlinks=True)
        stamp = (reference / ".pipeline" / f"{stage}.json").read_text()
        (out / ".pipeline" / f"{stage}.json").write_text(stamp.replace(str(reference), str(out)))


def _stores(out: Path) -> dict[str, dict[str, np.ndarray]]:
    found = {}
    for path in find_stores([out / "stores" / "train", out / "stores" / "test"]):
        with open_store(path) as store:
            found[f"{path.parent.name}/{path.name}"] = {
                "coords": store.coords, "patches": np.asarray(store.read_patches(list(range(len(store))))),
                **{name: store.read_array(name) for name in ("entropy_bits", "tumor_fraction", "instance_label")
                   if store.has(name)}}
    return found


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


def _assert_same_stores(a: Path, b: Path) -> None:
    sa, sb = _stores(a), _stores(b)
    assert sorted(sa) == sorted(sb) and len(sa) == 6
    for name in sa:
        for key in sa[name]:
            np.testing.assert_array_equal(sa[name][key], sb[name][key], err_msg=f"{name} {key}")
    assert not list((b / "stores").rglob("*.partial")), "a killed store was left behind"


def _assert_same_model(a: Path, b: Path) -> None:
    for ckpt in ("model/last.pt", "model/best.pt", "model/grid/mu-0.1/last.pt", "model/grid/mu-0.2/last.pt"):
        wa, wb = _weights(a / ckpt), _weights(b / ckpt)
        assert wa.keys() == wb.keys()
        for k in wa:
            assert torch.equal(wa[k], wb[k]), f"{ckpt}: {k}"
    assert json.loads((a / "model" / "grid.json").read_text()) == json.loads((b / "model" / "grid.json").read_text())


def _assert_same_outputs(a: Path, b: Path) -> None:
    _assert_same_stores(a, b)
    _assert_same_model(a, b)
    heat_a, heat_b = a / "heatmaps" / "test", b / "heatmaps" / "test"
    for path in sorted(heat_a.glob("*_probs.npy")):
        np.testing.assert_array_equal(np.load(path), np.load(heat_b / path.name))
    for pattern in ("*_detections.csv", "*_patches.csv", "scores.csv"):
        files = sorted(heat_a.glob(pattern))
        assert files
        for path in files:
            assert path.read_bytes() == (heat_b / path.name).read_bytes(), path.name
    assert json.loads((a / "evaluation" / "metrics.json").read_text()) == \
        json.loads((b / "evaluation" / "metrics.json").read_text())


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> tuple[Path, Path]:
    """The pipeline file and an uninterrupted run of it up to train (the heatmap test runs the rest)."""
    folder = tmp_path_factory.mktemp("resume")
    toml = folder / "resume.toml"
    toml.write_text(PIPELINE)
    reference = folder / "uninterrupted"
    _run(toml, reference, until="train")
    return toml, reference


@pytest.mark.slow  # the default run kills tile mid-slide and compares with an uninterrupted run
# (tests/tiling/test_tiling_cli.py::test_sigkill_mid_slide_then_rerun_equals_uninterrupted)
def test_run_killed_inside_tile_goes_on_and_matches_an_uninterrupted_run(pipeline, tmp_path):
    toml, reference = pipeline
    out = tmp_path / "killed"
    _seed(reference, out, ("synth",))
    _run(toml, out, "tile")
    done = sorted(p.name for p in (out / "stores" / "train").glob("*.h5"))
    assert len(done) == 2  # two stores finished, the third was being written
    events, outcomes = _run(toml, out, until="label")
    assert outcomes == [["synth", "skipped"], ["tile", "ran"], ["label", "ran"]]  # synth was finished before the kill
    tiled = [(e["item"], e["message"]) for e in events if e["stage"] == "tile" and e["done"] > 0]
    # the finished stores were kept, not tiled again: only the other two training slides and the test set
    assert tiled[:4] == [("synth_000", "skipped"), ("synth_001", "skipped"), ("synth_002", "ok"), ("synth_003", "ok")]
    status = (out / "stores" / "train" / "tile_status.csv").read_text()
    assert status.count(",skipped,") == 2 and status.count(",ok,") == 2
    _assert_same_stores(reference, out)  # patches, coordinates and the label stage's arrays


def test_run_killed_inside_training_resumes_and_skips_finished_grid_points(pipeline, tmp_path):
    toml, reference = pipeline
    out = tmp_path / "killed"
    _seed(reference, out, ("synth", "tile", "label"))
    _run(toml, out, "train")
    model = out / "model"
    first = model / "grid" / "mu-0.1" / "last.pt"
    assert torch.load(first, weights_only=False)["epoch"] == 2  # the first grid point had finished
    assert torch.load(model / "grid" / "mu-0.2" / "last.pt", weights_only=False)["epoch"] == 1
    first_mtime = first.stat().st_mtime_ns
    events, outcomes = _run(toml, out, until="train")
    assert outcomes == [["synth", "skipped"], ["tile", "skipped"], ["label", "skipped"], ["train", "ran"]]
    epochs_trained = [e["done"] for e in events if e["stage"] == "train" and e["item"].startswith("epoch")]
    assert epochs_trained == [2]            # only the second point's last epoch was trained again
    assert first.stat().st_mtime_ns == first_mtime
    assert not list(out.glob("model.replaced-*"))  # nothing was moved aside, nothing deleted
    _assert_same_stores(reference, out)
    _assert_same_model(reference, out)  # every checkpoint and grid.json


@pytest.mark.slow  # the default run has heatmap re-runs that skip finished slides
# (tests/inference/test_inference_shards.py::test_a_rerun_skips_finished_slides_and_other_settings_redo_them)
def test_run_killed_inside_heatmap_skips_finished_slides_and_matches_an_uninterrupted_run(pipeline, tmp_path):
    toml, reference = pipeline
    _run(toml, reference)  # the uninterrupted run's heatmap and evaluate stages
    out = tmp_path / "killed"
    _seed(reference, out, ("synth", "tile", "label", "train"))
    _run(toml, out, "heatmap")
    heat = out / "heatmaps" / "test"
    with open(heat / STATUS_FILENAME, newline="") as fh:  # what the killed run recorded as finished
        rows = [r for r in csv.DictReader(fh) if r["status"] == "ok"]
    assert len(rows) == 1  # one slide finished before the kill
    finished = rows[0]["slide"]
    first = heat / f"{finished}_probs.npy"
    stamp = first.stat().st_mtime_ns
    events, outcomes = _run(toml, out)
    assert outcomes[:5] == [["synth", "skipped"], ["tile", "skipped"], ["label", "skipped"], ["train", "skipped"],
                            ["heatmap", "ran"]]
    read = {e["item"] for e in events if e["stage"] == "heatmap-patches" and e["item"]}
    stems = {p.stem for p in (out / "stores" / "test").glob("*.h5")}
    assert len(stems) == 2 and read == stems - {finished}  # only the unfinished slide was read again
    assert first.stat().st_mtime_ns == stamp  # the finished slide was not predicted again
    _assert_same_outputs(reference, out)


def test_changed_training_settings_keep_the_old_run_folder(tmp_path):
    """Another learning rate: the old run is renamed aside (never deleted) and a new run starts."""
    from wsi_milssl.pipeline.run_folders import RUN_MARKER, prepare_run_dir

    run = tmp_path / "model"
    assert prepare_run_dir(run, {"settings": {"lr": 0.1}}) is False
    (run / "last.pt").write_bytes(b"x")
    assert prepare_run_dir(run, {"settings": {"lr": 0.1}}) is True      # same settings: continue
    assert prepare_run_dir(run, {"settings": {"lr": 0.01}}) is False    # other settings: a new run
    aside = list(tmp_path.glob("model.replaced-*"))
    assert len(aside) == 1 and (aside[0] / "last.pt").read_bytes() == b"x"
    assert json.loads((run / RUN_MARKER).read_text()) == {"settings": {"lr": 0.01}}
    assert not (run / "last.pt").exists()
