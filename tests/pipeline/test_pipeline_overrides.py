"""``run --set TABLE.KEY=VALUE`` and the resolved pipeline written beside the outputs (issue 15, D5)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from wsi_milssl import __version__
from wsi_milssl.cli import main
from wsi_milssl.config import load_toml
from wsi_milssl.errors import ConfigError
from wsi_milssl.pipeline import RESOLVED_FILENAME, load_pipeline, resolved_pipeline, run_pipeline
from wsi_milssl.pipeline.spec import parse_override
from tinypipeline import feature_bags

PIPELINE = """
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
epochs = 3
batch_size = 32
mu = 0.2
mu_ramp_epochs = 2
plots = false
"""


@pytest.fixture()
def toml(tmp_path):
    feature_bags(tmp_path / "train", 8, 0)
    feature_bags(tmp_path / "test", 4, 1)
    path = tmp_path / "p.toml"
    path.write_text(PIPELINE)
    return path


def test_parse_override_values_and_errors():
    assert parse_override("train.epochs=3") == (("train", "epochs"), 3)
    assert parse_override("train.grid.mu=[0.1, 0.2]") == (("train", "grid", "mu"), [0.1, 0.2])
    assert parse_override("heatmap.colormap=magma") == (("heatmap", "colormap"), "magma")
    assert parse_override('heatmap.colormap="magma"') == (("heatmap", "colormap"), "magma")
    assert parse_override("train.plots=false") == (("train", "plots"), False)
    for bad in ("epochs=3", "train.epochs", "train.epochs=", ".x=1"):
        with pytest.raises(ConfigError, match="expected TABLE.KEY=VALUE"):
            parse_override(bad)


def test_set_overrides_and_the_resolved_pipeline_reloads_to_the_same_run(toml, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", str(toml), "--out", str(out), "--set", "train.epochs=2", "--set", "data.val_fraction=0.5"]) == 0
    assert "with --set train.epochs=2 --set data.val_fraction=0.5" in capsys.readouterr().out
    resolved = out / RESOLVED_FILENAME
    text = resolved.read_text()
    assert "# with --set train.epochs=2 --set data.val_fraction=0.5" in text
    raw = load_toml(resolved)
    assert raw["train"]["epochs"] == 2 and raw["data"]["val_fraction"] == 0.5
    assert raw["train"]["optimizer"]  # every setting, defaults included
    assert raw["data"]["train_features"] == str((tmp_path / "train").resolve())
    assert raw["pipeline"]["out_dir"] == str(out.resolve())
    spec = load_pipeline(toml, out_dir=out, overrides=["train.epochs=2", "data.val_fraction=0.5"])
    again = load_pipeline(resolved)
    assert resolved_pipeline(again) == resolved_pipeline(spec)
    assert (again.val_fraction, again.section("train")["epochs"]) == (0.5, 2)
    config = load_toml(toml)
    assert config["train"]["epochs"] == 3  # the source file is not touched
    # the resolved file spells out every default; run as it is, it finds every stage up to date
    statuses = [o.status for o in run_pipeline(again)]
    assert statuses and set(statuses) == {"skipped"}
    # run from the resolved file, it keeps saying where the run came from (it said "ran it: <itself>" before)
    header = [f"# The pipeline as `wsi-milssl run` ran it (wsi-milssl {__version__}): {toml.resolve()}",
              "# with --set train.epochs=2 --set data.val_fraction=0.5"]
    assert text.splitlines()[:2] == header
    assert main(["run", str(resolved)]) == 0
    assert resolved.read_text().splitlines()[:3] == header + [text.splitlines()[2]]
    assert main(["run", str(resolved), "--set", "train.lr=0.01"]) == 0
    assert resolved.read_text().splitlines()[:3] == header + ["# then --set train.lr=0.01"]


def test_resolved_pipeline_of_a_feature_pipeline_trains_on_features(toml, tmp_path):
    # [train] without mode: the head trains on features in a features pipeline, and the resolved file says so
    toml.write_text(PIPELINE.replace('mode = "features"\nmodel = "linear"', 'model = "linear"'))
    spec = load_pipeline(toml, out_dir=tmp_path / "out")
    assert "mode" not in spec.section("train")
    table = resolved_pipeline(spec)["train"]
    assert (table["mode"], table["model"], table["optimizer"]) == ("features", "linear", "adam")


def test_stage_digests_cover_settings_not_their_spelling(tmp_path):
    from wsi_milssl.pipeline.digests import stage_settings

    base = load_pipeline(_write(tmp_path / "a.toml", PIPELINE))
    explicit = load_pipeline(_write(tmp_path / "b.toml", PIPELINE.replace("epochs = 3", "epochs = 3\nlam = 25.0")))
    changed = load_pipeline(_write(tmp_path / "c.toml", PIPELINE.replace("epochs = 3", "epochs = 3\nlam = 10.0")))
    assert stage_settings(explicit, "train") == stage_settings(base, "train")  # a default spelled out
    assert stage_settings(changed, "train") != stage_settings(base, "train")
    assert stage_settings(explicit, "train", form="legacy") != stage_settings(base, "train", form="legacy")
    for form in ("all", "changed"):
        assert stage_settings(explicit, "train", form=form) == stage_settings(base, "train", form=form)


def _write(path, text):
    path.write_text(text)
    return path


def test_bad_overrides_name_the_problem(toml, tmp_path, capsys):
    assert main(["run", str(toml), "--out", str(tmp_path / "o"), "--set", "trian.epochs=2"]) == 2  # a usage error
    assert "unknown table [trian]" in capsys.readouterr().err
    assert main(["run", str(toml), "--out", str(tmp_path / "o"), "--set", "train.epoch=2"]) == 2
    # an error a --set caused names it, not only the file (whose [train] has no such key)
    assert (f"error: {toml} [train] with --set train.epoch=2: unknown key(s) epoch for TrainConfig"
            in capsys.readouterr().err)
    assert main(["run", str(toml), "--out", str(tmp_path / "o"), "--set", "train.epochs=2",
                 "--set", "data.val_fraction=2"]) == 2
    assert (f"error: {toml} with --set data.val_fraction=2: [data].val_fraction must satisfy"
            in capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


REAL_SLIDES = """
[pipeline]
name = "real"
[data]
train_slides = "train"
train_labels = "train/labels.csv"
train_annotations = "train"
test_slides = "test"
test_labels = "test/labels.csv"
test_annotations = "test"
"""


def test_a_set_that_turns_on_generated_data_says_so(tmp_path):
    """--set synth.train.n_slides=2 on a pipeline of existing slides makes it a generated one: the error says
    that the --set did it."""
    path = _write(tmp_path / "real.toml", REAL_SLIDES)
    assert load_pipeline(path).sets["train"].synth is None
    with pytest.raises(ConfigError) as caught:
        load_pipeline(path, overrides=["synth.train.n_slides=2"])
    assert str(caught.value) == (
        f"{path} with --set synth.train.n_slides=2: a generated pipeline needs a [synth.test] table (the --set makes "
        "it one: a [synth] table or data.generate = true means generated slides in place of [data]'s). Fix: drop "
        "that --set to run on the slides of [data].")
    with pytest.raises(ConfigError, match=re.escape(f"{path} with --set data.generate=true: a generated pipeline "
                                                    "needs a [synth.train] table (the --set makes it one")):
        load_pipeline(path, overrides=["data.generate=true"])
    with pytest.raises(ConfigError, match=re.escape("are not used with generated data (the --set makes it one")):
        load_pipeline(path, overrides=["synth.train.n_slides=2", "synth.test.n_slides=2"])


def test_a_grid_without_validation_slides_is_refused_before_any_stage(tmp_path):
    """It was refused only when train ran, after tile and label (hours on CAMELYON16). Now before any stage
    runs, from the split of the slides (so that the message names every fix needed; test_pipeline_grid_split)."""
    path = _write(tmp_path / "demo.toml", (Path(__file__).resolve().parents[2] / "pipelines" / "demo.toml").read_text())
    with pytest.raises(ConfigError) as caught:  # by load_pipeline, as run loads it (review AO, finding 3)
        load_pipeline(path, out_dir=tmp_path / "out", overrides=["train.grid.epochs=[1, 2]", "data.val_fraction=0"])
    assert str(caught.value) == (
        f"{path} [train] with --set train.grid.epochs=[1, 2] --set data.val_fraction=0: a [train.grid] of 2 points "
        "needs validation slides to choose one on, but [data].val_fraction is 0. Fix: set [data].val_fraction > 0 "
        "(e.g. 0.25: training slides held out, never the test set), or drop [train.grid].")
    assert not (tmp_path / "out" / "slides").exists()  # synth never ran
    load_pipeline(path, out_dir=tmp_path / "out", overrides=["train.grid.epochs=[2]", "data.val_fraction=0"])  # one point


@pytest.mark.parametrize("text, said", [
    ("train.grid.optimizer=[sgd,adam]", "[sgd,adam] is not a TOML value. Fix: quote each word inside the brackets, "
                                        "--set 'train.grid.optimizer=[\"a\", \"b\"]'"),
    ("evaluate.lesion_exclude=[Test_114]", "[Test_114] is not a TOML value"),
    ("train.mu=.5", ".5 is not a TOML number. Fix: write it in full (e.g. 0.5, not .5")])
def test_a_value_that_is_almost_toml_says_how_to_write_it(text, said):
    """Review CX, B7: these fell back to strings, and the type error's fix then repeated the mistake."""
    with pytest.raises(ConfigError) as err:
        parse_override(text)
    assert said in str(err.value)
    assert parse_override("heatmap.colormap=magma")[1] == "magma"  # a bare word is still a string
    for text in ("2024-11", "1.2.3", "1-2"):  # review CZ: texts of digits are no would-be numbers
        assert parse_override(f"pipeline.name={text}")[1] == text
