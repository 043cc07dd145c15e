"""Pipeline runner: [train.grid] in feature pipelines, the grid's validation score when metrics.jsonl
lacks the best epoch, --force redoing the work of train and tile, grid values checked at load time,
and feature runs that `wsi-milssl train --resume` can continue."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from tinypipeline import GENERATED_SLIDES
from wsi_milssl.errors import ConfigError, WsiMilsslError
from wsi_milssl.pipeline import load_pipeline, run_pipeline
from wsi_milssl.pipeline.training import validation_score

FEATURES = """
[pipeline]
name = "feat"

[data]
mode = "features"
train_features = "feats/train"
train_labels = "feats/train_labels.csv"
test_features = "feats/test"
test_labels = "feats/test_labels.csv"
val_fraction = 0.34

[train]
mode = "features"
model = "mlp"
epochs = 2
batch_size = 16
plots = false
"""

GRID = """
[train.grid]
mu = [0.1, 0.3]
"""


def _feature_files(folder: Path, labels: dict[str, int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for name, label in labels.items():
        n = 12
        inst = np.zeros(n, dtype=np.uint8)
        if label:
            inst[:4] = 1
        feats = rng.normal(size=(n, 8)).astype(np.float32) + inst[:, None] * 1.5
        with h5py.File(folder / f"{name}.h5", "w") as fh:
            fh["features"] = feats
            fh["instance_label"] = inst
    (folder.parent / f"{folder.name}_labels.csv").write_text(
        "slide,label\n" + "".join(f"{k},{v}\n" for k, v in labels.items()))


def _pipeline(tmp_path: Path, extra: str = "") -> Path:
    _feature_files(tmp_path / "feats" / "train", {f"tr{i}": i % 2 for i in range(6)}, 0)
    _feature_files(tmp_path / "feats" / "test", {f"te{i}": i % 2 for i in range(4)}, 1)
    toml = tmp_path / "feat.toml"
    toml.write_text(FEATURES + extra)
    return toml


def test_feature_pipeline_trains_its_grid_and_chooses_on_validation(tmp_path):
    spec = load_pipeline(_pipeline(tmp_path, GRID), out_dir=tmp_path / "out")
    run_pipeline(spec)
    model = tmp_path / "out" / "model"
    assert sorted(p.name for p in (model / "grid").iterdir()) == ["mu-0.1", "mu-0.3"]
    grid = json.loads((model / "grid.json").read_text())
    assert sorted(g["run"] for g in grid) == ["mu-0.1", "mu-0.3"]
    chosen = json.loads((model / "pipeline_run.json").read_text())["chosen"]
    assert chosen == grid[0]["run"]
    assert json.loads((model / "config.json").read_text())["mu"] == float(chosen.split("-")[1])
    assert (model / "best.pt").is_file() and (tmp_path / "out" / "evaluation" / "metrics.json").is_file()
    assert [o.status for o in run_pipeline(spec)] == ["skipped", "skipped"]


def test_feature_grid_without_validation_bags_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"with --set data.val_fraction=0.0: a \[train.grid\] of 2 points needs "
                                          r"validation bags to choose one on, but \[data\].val_fraction is 0"):
        load_pipeline(_pipeline(tmp_path, GRID), out_dir=tmp_path / "out", overrides=["data.val_fraction=0.0"])


def test_grid_score_comes_from_the_checkpoint_when_metrics_lack_the_best_epoch(tmp_path):
    spec = load_pipeline(_pipeline(tmp_path, GRID), out_dir=tmp_path / "out")
    run_pipeline(spec)
    model = tmp_path / "out" / "model"
    scores = {g["run"]: g["validation_score"] for g in json.loads((model / "grid.json").read_text())}
    for point in ("mu-0.1", "mu-0.3"):
        best = json.loads((model / "grid" / point / "config.json").read_text())["select_metric"]
        result = SimpleNamespace(best_epoch=json.loads(
            (model / "grid" / point / "metrics.jsonl").read_text().splitlines()[-1])["best_epoch"],
            history=[], out_dir=model / "grid" / point)
        assert list(validation_score(result, best, model / "grid" / point)) == pytest.approx(scores[point])
        # a killed run: metrics.jsonl lost its records; the pipeline runs the stage again without a traceback
        (model / "grid" / point / "metrics.jsonl").write_text("")
    (tmp_path / "out" / ".pipeline" / "train.json").unlink()
    outcomes = run_pipeline(spec)
    assert [o.status for o in outcomes] == ["ran", "ran"]
    again = {g["run"]: g["validation_score"] for g in json.loads((model / "grid.json").read_text())}
    assert again.keys() == scores.keys()
    assert all(again[k] == pytest.approx(scores[k]) for k in scores)


def test_validation_score_without_any_record_is_one_clear_error(tmp_path):
    result = SimpleNamespace(best_epoch=2, history=[{"epoch": 1}], out_dir=tmp_path)
    with pytest.raises(WsiMilsslError, match=r"no record of the best epoch \(2\).*--force train"):
        validation_score(result, "bag_auc", tmp_path)
    assert validation_score(SimpleNamespace(best_epoch=None, history=[]), "bag_auc") is None


def test_force_train_trains_again_and_keeps_the_old_run(tmp_path):
    spec = load_pipeline(_pipeline(tmp_path), out_dir=tmp_path / "out")
    run_pipeline(spec)
    model = tmp_path / "out" / "model"
    before = (model / "last.pt").read_bytes()
    outcomes = run_pipeline(spec, force=["train"])
    assert [o.status for o in outcomes] == ["ran", "ran"]
    aside = [p for p in (tmp_path / "out").iterdir() if p.name.startswith("model.replaced-")]
    assert len(aside) == 1 and (aside[0] / "last.pt").read_bytes() == before
    lines = (model / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2]  # trained from epoch 0, not "resumed"
    # a grid is moved aside as a whole too
    grid_spec = load_pipeline(tmp_path / "feat.toml", out_dir=tmp_path / "out", overrides=["train.grid.mu=[0.1, 0.3]"])
    run_pipeline(grid_spec)
    run_pipeline(grid_spec, force=["train"])
    aside = sorted(p for p in (tmp_path / "out").iterdir() if p.name.startswith("model.replaced-"))
    assert len(aside) == 3 and (aside[-1] / "grid" / "mu-0.1" / "last.pt").is_file()
    assert (model / "grid" / "mu-0.1" / "last.pt").is_file()


def test_refused_forced_train_leaves_the_model_in_place(tmp_path):
    spec = load_pipeline(_pipeline(tmp_path), out_dir=tmp_path / "out")
    run_pipeline(spec)
    model = tmp_path / "out" / "model"
    before = (model / "last.pt").read_bytes()
    # a grid without validation bags is refused: the forced run must not have moved the model aside first
    with pytest.raises(ConfigError, match="needs validation bags"):
        refused = load_pipeline(tmp_path / "feat.toml", out_dir=tmp_path / "out",
                                overrides=["train.grid.mu=[0.1, 0.3]", "data.val_fraction=0"])
        run_pipeline(refused, force=["train"])
    assert (model / "last.pt").read_bytes() == before
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith("model.replaced-")]


def test_feature_run_records_its_inputs_so_train_resume_continues_it(tmp_path):
    from wsi_milssl.cli import main

    spec = load_pipeline(_pipeline(tmp_path), out_dir=tmp_path / "out")
    run_pipeline(spec)
    model = tmp_path / "out" / "model"
    data = json.loads((model / "config.json").read_text())["data"]
    assert data["input_mode"] == "features" and Path(data["labels"]).is_absolute()
    assert all(Path(p).is_absolute() and Path(p).is_file() for p in data["inputs"] + data["val_inputs"])
    stems = sorted(Path(p).stem for p in data["inputs"] + data["val_inputs"])
    assert stems == [f"tr{i}" for i in range(6)] and len(data["val_inputs"]) == 2
    assert sorted(Path(p).stem for p in data["val_inputs"]) == sorted(data["bags"]["val"])
    assert main(["train", "--resume", str(model), "--epochs", "3"]) == 0
    lines = (model / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2, 3]


@pytest.mark.parametrize("value", ["0.1", "[]", '"x"'])
def test_grid_values_must_be_a_non_empty_list_at_load_time(tmp_path, value):
    toml = _pipeline(tmp_path)
    with pytest.raises(ConfigError, match=r"\[train.grid\].mu must be a non-empty list of values"):
        load_pipeline(toml, overrides=[f"train.grid.mu={value}"])


TILE_ONLY = """
[pipeline]
name = "tiny-tile"
""" + GENERATED_SLIDES


def test_force_tile_tiles_again(tmp_path):
    toml = tmp_path / "tiny.toml"
    toml.write_text(TILE_ONLY)
    spec = load_pipeline(toml, out_dir=tmp_path / "out")
    run_pipeline(spec, until="tile")
    stores = sorted((tmp_path / "out" / "stores" / "train").glob("*.h5"))
    assert stores
    before = {p.name: p.stat().st_mtime_ns for p in stores}
    outcomes = run_pipeline(spec, until="tile", force=["tile"])
    assert [(o.stage, o.status) for o in outcomes] == [("synth", "skipped"), ("tile", "ran")]
    after = {p.name: p.stat().st_mtime_ns for p in sorted((tmp_path / "out" / "stores" / "train").glob("*.h5"))}
    assert after.keys() == before.keys() and all(after[k] != before[k] for k in before)


def test_feature_grid_trains_points_in_worker_processes_like_one_at_a_time(tmp_path):
    toml = _pipeline(tmp_path, GRID)
    one = load_pipeline(toml, out_dir=tmp_path / "one", overrides=["pipeline.grid_workers=1"])
    two = load_pipeline(toml, out_dir=tmp_path / "two", overrides=["pipeline.grid_workers=2", "train.threads=1"])
    run_pipeline(one, until="train")
    run_pipeline(two, until="train")
    a = json.loads((tmp_path / "one" / "model" / "grid.json").read_text())
    b = json.loads((tmp_path / "two" / "model" / "grid.json").read_text())
    assert [g["run"] for g in a] == [g["run"] for g in b]
    assert all(x["validation_score"] == pytest.approx(y["validation_score"]) for x, y in zip(a, b))


def test_a_run_refused_before_training_leaves_no_run_to_move_aside(tmp_path, caplog):
    """Training refused before its first epoch (validation bags of one class, for a metric that needs two)
    leaves only the run's record in OUT/model; the run with the suggested fix uses the folder without saying
    that it holds a run started with other settings, and moves nothing aside."""
    _feature_files(tmp_path / "feats" / "train", {f"tr{i}": int(i == 0) for i in range(6)}, 0)  # one tumour bag
    _feature_files(tmp_path / "feats" / "test", {f"te{i}": i % 2 for i in range(4)}, 1)
    toml = tmp_path / "feat.toml"
    toml.write_text(FEATURES)
    with pytest.raises(ConfigError, match="no epoch could be chosen") as caught:
        run_pipeline(load_pipeline(toml, out_dir=tmp_path / "out"))
    # the fix for a bag AUC of one class (review BF: feature files without instance labels were told to label)
    assert "or validate on slides of both classes" in str(caught.value)
    assert "label the validation slides" not in str(caught.value)
    model = tmp_path / "out" / "model"
    assert [p.name for p in model.iterdir()] == ["pipeline_run.json"]
    caplog.clear()
    fixed = load_pipeline(toml, out_dir=tmp_path / "out", overrides=["train.select_metric=\"bag_nll\""])
    assert [o.status for o in run_pipeline(fixed)] == ["ran", "ran"]
    assert "started with other settings" not in caplog.text
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith("model.replaced-")]
    assert (model / "best.pt").is_file()
