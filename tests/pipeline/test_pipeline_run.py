"""``wsi-milssl run``: pipeline files, validation, stage order, skipping up-to-date stages."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from wsi_milssl.cli import main
from wsi_milssl.errors import CheckpointError, ConfigError
from wsi_milssl.pipeline import load_pipeline, run_pipeline, split_train_val


def _write_bags(folder, *, n_bags: int, seed: int) -> dict[str, int]:
    """One HDF5 file per bag: 20 instances of 8 features; positive bags hold 4 shifted instances."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    labels = {}
    for b in range(n_bags):
        label = b % 2
        x = rng.normal(size=(20, 8)).astype(np.float32)
        inst = np.zeros(20, np.uint8)
        if label:
            x[:4] += 3.0
            inst[:4] = 1
        with h5py.File(folder / f"bag_{b:02d}.h5", "w") as fh:
            fh["features"] = x
            fh["instance_label"] = inst
        labels[f"bag_{b:02d}"] = label
    with open(folder / "labels.csv", "w") as fh:
        fh.write("slide,label\n" + "".join(f"{k},{v}\n" for k, v in labels.items()))
    return labels


@pytest.fixture()
def feature_pipeline(tmp_path):
    _write_bags(tmp_path / "train", n_bags=16, seed=0)
    _write_bags(tmp_path / "test", n_bags=8, seed=1)
    toml = tmp_path / "features.toml"
    toml.write_text(
        """
[pipeline]
name = "t"
[data]
mode = "features"
train_features = "train"
train_labels = "train/labels.csv"
test_features = "test"
test_labels = "test/labels.csv"
val_fraction = 0.25
[train]
mode = "features"
model = "linear"
epochs = 30
batch_size = 32
mu = 0.2
mu_ramp_epochs = 2
plots = false
"""
    )
    return toml


def test_feature_pipeline_runs_then_skips_then_forces(feature_pipeline, tmp_path):
    spec = load_pipeline(feature_pipeline, out_dir=tmp_path / "out")
    first = run_pipeline(spec)
    assert [(o.stage, o.status) for o in first] == [("train", "ran"), ("evaluate", "ran")]
    metrics = json.loads((tmp_path / "out" / "evaluation" / "metrics.json").read_text())
    assert metrics["n_bags"] == 8 and metrics["bag_auc"] > 0.9  # shifted instances are easy
    second = run_pipeline(spec)
    assert [o.status for o in second] == ["skipped", "skipped"]
    forced = run_pipeline(spec, force=["evaluate"])
    assert [o.status for o in forced] == ["skipped", "ran"]
    # best.pt went missing: the run cannot make it again, and last.pt is not the epoch validation chose
    (tmp_path / "out" / "model" / "best.pt").unlink()
    with pytest.raises(CheckpointError, match=r"best.pt \(the epoch the validation slides chose\) is missing"):
        run_pipeline(spec)
    third = run_pipeline(spec, force=["train"])
    assert [o.status for o in third] == ["ran", "ran"] and (tmp_path / "out" / "model" / "best.pt").is_file()


def test_changed_settings_rerun_the_stage(feature_pipeline, tmp_path):
    run_pipeline(load_pipeline(feature_pipeline, out_dir=tmp_path / "out"))
    feature_pipeline.write_text(feature_pipeline.read_text().replace("epochs = 30", "epochs = 31"))
    outcomes = run_pipeline(load_pipeline(feature_pipeline, out_dir=tmp_path / "out"))
    assert [o.status for o in outcomes] == ["ran", "ran"]


def test_image_tables_of_a_feature_pipeline_are_named_as_unused(feature_pipeline, tmp_path, caplog):
    """Review BR, B5: [tile], [label], [heatmap] and [evaluate] settings of a pipeline of feature files were
    ignored without a word; one warning names them. A pipeline without them has none."""
    import logging

    with caplog.at_level(logging.WARNING, logger="wsi_milssl.pipeline.runner"):
        run_pipeline(load_pipeline(feature_pipeline, out_dir=tmp_path / "out"), until="train")
    assert "not used by a pipeline of feature files" not in caplog.text
    feature_pipeline.write_text(feature_pipeline.read_text() + "[tile]\npatch_size_px = 64\n[heatmap]\n"
                                "colormap = 'magma'\n[evaluate]\nmargin_um = 50.0\npositive_fraction = 0.5\n")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.pipeline.runner"):
        run_pipeline(load_pipeline(feature_pipeline, out_dir=tmp_path / "out"), until="train")
    assert ("[tile] and [heatmap] and [evaluate] margin_um, positive_fraction: not used by a pipeline of feature "
            "files") in caplog.text
    # review BT: the pipeline's own resolved_pipeline.toml spells every default of those tables: no warning
    feature_pipeline.write_text(feature_pipeline.read_text().split("[tile]")[0])
    run_pipeline(load_pipeline(feature_pipeline, out_dir=tmp_path / "out"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.pipeline.runner"):
        outcomes = run_pipeline(load_pipeline(tmp_path / "out" / "resolved_pipeline.toml"))
    assert [o.status for o in outcomes] == ["skipped", "skipped"]
    assert "not used by a pipeline of feature files" not in caplog.text


def test_cli_run_prints_each_stage(feature_pipeline, tmp_path, capsys):
    assert main(["run", str(feature_pipeline), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "[train]" in out and "[evaluate]" in out and "bag AUC" in out
    # review BS: a feature pipeline's run ended without naming its evaluation (it has no report.html)
    assert out.splitlines()[-1] == f"metrics: {tmp_path / 'o' / 'evaluation' / 'metrics.json'}"
    metrics = json.loads((tmp_path / "o" / "evaluation" / "metrics.json").read_text())
    assert metrics["bag_accuracy_threshold"] == 0.5
    assert metrics["instance_auc"] is not None and metrics["reasons"] == {}  # these bags hold instance labels


@pytest.mark.parametrize(
    "text, message",
    [
        ("[bogus]\n", r"unknown table\(s\) bogus"),
        ("[data]\nmode = 'pixels'\n", r"\[data\]\.mode must be 'images' or 'features'; got 'pixels'"),
        ("[data]\ntrain_slides = 's'\n", r"\[data\] is missing train_labels, train_annotations"),
        ("[synth.train]\nn_slides = 2\n[synth.test]\nn_slides = 0\n", r"SynthConfig\.n_slides must satisfy"),
        ("[synth.train]\n[synth.test]\n[tile]\npatch_size = 5\n", r"\[tile\]: unknown key\(s\) patch_size"),
        ("[synth.train]\n[synth.test]\n[train]\nmu = 2.0\n", r"TrainConfig\.mu must satisfy"),
        ("[synth.train]\n[synth.test]\n[train.grid]\nmu = [0.1, 1.5]\n", r"\[train.grid\].*TrainConfig\.mu"),
    ],
)
def test_bad_pipeline_files_name_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_pipeline(path)


def test_split_is_stratified_seeded_and_disjoint():
    stems = [f"s{i}" for i in range(10)]
    labels = {s: int(i < 4) for i, s in enumerate(stems)}
    train, val = split_train_val(stems, labels, val_fraction=0.25, seed=3)
    assert sorted(train + val) == sorted(stems) and not set(train) & set(val)
    assert {labels[s] for s in val} == {0, 1}  # both classes held out
    assert (train, val) == split_train_val(stems, labels, val_fraction=0.25, seed=3)
    assert split_train_val(stems, labels, val_fraction=0.0, seed=3) == (sorted(stems), [])


def test_packaged_pipelines_load():
    from importlib.resources import files

    for name in ("demo", "camelyon16", "tcga-features"):
        spec = load_pipeline(files("wsi_milssl") / "pipelines" / f"{name}.toml")
        assert set(spec.sets) == {"train", "test"}
    assert load_pipeline(files("wsi_milssl") / "pipelines" / "camelyon16.toml").section("train")["grid"] == {
        "mu": [0.1, 0.15, 0.2, 0.25], "mu_ramp_epochs": [5, 10, 20, 40]}


@pytest.mark.parametrize("command", [["demo"], ["run", "PIPELINE", "--out"]])
def test_a_pipeline_into_a_folder_another_run_holds_names_the_folder_as_the_command_takes_it(tmp_path, capsys,
                                                                                             command):
    """demo takes its folder as the argument OUT_DIR, run as --out: the refusal's fix names it so."""
    from importlib.resources import files

    from processes import hold_lock, release

    out = tmp_path / "out"
    holder = hold_lock(out)
    try:
        demo_toml = files("wsi_milssl") / "pipelines" / "demo.toml"
        args = [str(demo_toml) if a == "PIPELINE" else a for a in command] + [str(out)]
        assert main(args) == 1
    finally:
        release(holder)
    err = capsys.readouterr().err
    named = "OUT_DIR" if command == ["demo"] else "--out"
    assert f"another wsi-milssl run (pid {holder.pid}" in err and f"write to another folder ({named})." in err, err
