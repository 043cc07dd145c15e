"""What ``load_pipeline`` refuses before any stage runs (review Z, 5-7): with ``check_paths=True``, a [data]
path that does not exist (named with the file, the key, the path it resolved to and how relative paths
resolve; a --set of one too), a [train.grid] value listed twice (also as equal numbers, 0.1 and 0.10), and
[synth] tables on a pipeline that trains on feature files, whose fix named [data].generate = true (already
set) instead of [data].mode."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from wsi_milssl.cli import main
from wsi_milssl.cohorts import prepare_folder
from wsi_milssl.config import SynthConfig
from wsi_milssl.errors import ConfigError
from wsi_milssl.pipeline import load_pipeline
from wsi_milssl.synth import generate_slides

DEMO = (Path(__file__).resolve().parents[2] / "pipelines" / "demo.toml").read_text()
#: the demo with four small slides per set (the old code ran it up to the train stage before failing)
TINY = DEMO.replace("8192", "2048").replace("n_slides = 8", "n_slides = 4")


def _replace(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new, 1)


@pytest.fixture(scope="module")
def cohort(tmp_path_factory) -> Path:
    """Eight generated slides (four tumour, their ASAP XML beside them) with labels.csv: prepared with
    test_fraction 0.5, two training slides of each class, so that the template's [train.grid] has validation
    slides (load_pipeline checks the split too)."""
    folder = tmp_path_factory.mktemp("cohort")
    generate_slides(SynthConfig(n_slides=8, seed=3, width_px=2048, height_px=2048, tumor_slide_fraction=0.5), folder)
    return folder


@pytest.fixture()
def prepared(cohort, tmp_path) -> Path:
    """``prepare folder`` on the generated cohort: the folder it wrote (pipeline.toml, cohort/)."""
    result = prepare_folder(cohort, cohort / "labels.csv", tmp_path / "m1", test_fraction=0.5)
    return result.pipeline_toml.parent


def _missing(key: str, value: str, resolved: Path) -> str:
    return f"[data].{key} = {value!r}: {resolved} does not exist"


def test_a_prepared_pipeline_loads_and_a_wrong_data_path_is_refused_at_load(prepared, tmp_path):
    toml = prepared / "pipeline.toml"
    spec = load_pipeline(toml, check_paths=True)  # prepare's pipeline: every path it names exists
    assert spec.sets["test"].annotations == prepared / "cohort" / "annotations" / "test"

    bad = tmp_path / "e1" / "pipeline.toml"
    shutil.copytree(prepared, bad.parent)
    bad.write_text(re.sub(r'(?m)^test_annotations = .*$', 'test_annotations = "cohort/annotations/tst"',
                          bad.read_text()))
    with pytest.raises(ConfigError) as err:
        load_pipeline(bad, check_paths=True)
    message = str(err.value)
    assert message.startswith(f"{bad}: ")
    assert _missing("test_annotations", "cohort/annotations/tst",
                    bad.parent / "cohort" / "annotations" / "tst") in message
    assert f"relative [data] paths are resolved against the pipeline file's folder, {bad.parent}" in message
    assert "--annotations" not in message

    # the pipeline file copied without its cohort/: every missing key in one error
    other = tmp_path / "other" / "pipeline.toml"
    other.parent.mkdir()
    shutil.copy(toml, other)
    with pytest.raises(ConfigError) as err:
        load_pipeline(other, check_paths=True)
    message = str(err.value)
    for set_name in ("train", "test"):
        assert _missing(f"{set_name}_slides", f"cohort/{set_name}_slides.csv",
                        other.parent / "cohort" / f"{set_name}_slides.csv") in message
        assert _missing(f"{set_name}_labels", f"cohort/{set_name}_labels.csv",
                        other.parent / "cohort" / f"{set_name}_labels.csv") in message


def test_a_data_path_of_the_wrong_kind_is_refused_at_load(prepared, tmp_path):
    """A labels CSV given as a folder, or annotations given as one file, passed the existence check and
    failed only at its stage (annotations: at label, after every slide was tiled)."""
    bad = tmp_path / "k1" / "pipeline.toml"
    shutil.copytree(prepared, bad.parent)
    one_xml = next((bad.parent / "cohort" / "annotations" / "test").iterdir())
    text = re.sub(r'(?m)^test_annotations = .*$', f'test_annotations = "{one_xml}"', bad.read_text())
    bad.write_text(re.sub(r'(?m)^train_labels = .*$', 'train_labels = "cohort"', text))
    with pytest.raises(ConfigError) as err:
        load_pipeline(bad, check_paths=True)
    message = str(err.value)
    assert f"[data].test_annotations = {str(one_xml)!r}: {one_xml} is a file, not a folder (of the slides' " \
           "annotation files)" in message
    assert f"[data].train_labels = 'cohort': {bad.parent / 'cohort'} is a folder, not a file (the slide labels " \
           "CSV)" in message
    assert "test_slides" not in message  # a slide list file is a slides path of the right kind


def test_a_set_of_a_data_path_is_checked_too(prepared):
    toml = prepared / "pipeline.toml"
    with pytest.raises(ConfigError) as err:
        load_pipeline(toml, overrides=["data.test_labels=cohort/test_labelz.csv"], check_paths=True)
    message = str(err.value)
    assert message.startswith(f"{toml} with --set data.test_labels=cohort/test_labelz.csv: ")
    assert _missing("test_labels", "cohort/test_labelz.csv", prepared / "cohort" / "test_labelz.csv") in message
    absolute = prepared / "cohort" / "train_labels.csv"
    # one that exists loads
    spec = load_pipeline(toml, overrides=[f"data.test_labels={str(absolute)!r}"], check_paths=True)
    assert spec.sets["test"].labels == absolute


def test_run_with_a_wrong_data_path_stops_before_any_stage(prepared, tmp_path, capsys):
    bad = prepared / "bad.toml"
    bad.write_text(re.sub(r'(?m)^train_slides = .*$', 'train_slides = "cohort/nothing.csv"',
                          (prepared / "pipeline.toml").read_text()))
    out = tmp_path / "run_out"
    assert main(["run", str(bad), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}: [data].train_slides = 'cohort/nothing.csv': {prepared / 'cohort' / 'nothing.csv'} does not " \
           "exist" in err
    assert not out.exists()  # no stage ran


@pytest.mark.parametrize("name, fix", [
    ("camelyon16", "Fix: `wsi-milssl prepare camelyon16 ROOT --out DIR` finds"),
    ("camelyon16-features", "Fix: `wsi-milssl prepare camelyon16 ROOT --out DIR --template {}` finds"),
    ("tcga-features", "Fix: copy it and point its [data] at your feature files and labels")])
def test_a_ready_made_pipeline_run_as_shipped_says_how_to_make_one_with_real_paths(tmp_path, capsys, name, fix):
    """Review CS: `run pipelines/camelyon16.toml --out RUN` (the README's table) failed on its placeholder paths with
    a fix to edit them by hand; the template itself says to let prepare write them. Review CT: known by its bytes
    (the image's /opt/wsi-milssl/pipelines is not the installed package's folder), with each one's own fix."""
    from importlib.resources import files

    shipped = Path(str(files("wsi_milssl") / "pipelines" / f"{name}.toml"))
    copy = tmp_path / "my pipelines" / f"{name}.toml"  # as a checkout's or the image's folder holds it
    copy.parent.mkdir()
    shutil.copy(shipped, copy)
    for template in (shipped, copy):
        assert main(["run", str(template), "--out", str(tmp_path / "run")]) == 1
        err = capsys.readouterr().err
        assert f"This is the ready-made pipeline {name!r} as shipped, whose [data] paths are placeholders. " \
               + fix.format(shlex.quote(str(template))) in err and "move them with it" not in err
    copy.write_text(copy.read_text().replace("[data]", "[data]  # mine", 1))  # the user's own now
    assert main(["run", str(copy), "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "ready-made" not in err and "move them with it" in err


def test_a_missing_feature_path_is_refused_at_load(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "labels.csv").write_text("slide,label\n")
    path = tmp_path / "f.toml"
    path.write_text('[data]\nmode = "features"\ntrain_features = "train"\ntrain_labels = "train/labels.csv"\n'
                    'test_features = "~/no-such-folder-of-features"\ntest_labels = "train/labels.csv"\n'
                    '[train]\nmode = "features"\nmodel = "linear"\n')
    with pytest.raises(ConfigError, match=re.escape(
            f"[data].test_features = '~/no-such-folder-of-features': "
            f"{Path('~/no-such-folder-of-features').expanduser()} does not exist")):
        load_pipeline(path, check_paths=True)
    assert load_pipeline(path).sets["test"].features == Path("~/no-such-folder-of-features").expanduser()


def test_the_demo_still_loads(tmp_path):
    path = tmp_path / "demo.toml"
    path.write_text(DEMO)  # generated sets: their paths are in OUT/slides, made by the synth stage
    spec = load_pipeline(path, out_dir=tmp_path / "nowhere", check_paths=True)
    assert spec.sets["train"].slides == tmp_path / "nowhere" / "slides" / "train"


@pytest.mark.parametrize("grid, value", [
    ("mu = [0.1, 0.2, 0.1]", "0.1"),
    ("mu = [0.1, 0.10]", "0.1"),
    ("lam = [25, 25.0]", "25"),
    ("hidden_dims = [[128], [64], [128]]", "[128]"),
])
def test_a_repeated_grid_value_is_refused_at_load(tmp_path, grid, value):
    path = tmp_path / "g.toml"
    path.write_text(_replace(DEMO, "[train]", f"[train.grid]\n{grid}\n\n[train]"))
    key = grid.split()[0]
    with pytest.raises(ConfigError, match=re.escape(f"{path}: [train.grid].{key} lists {value} twice")):
        load_pipeline(path)


def test_a_repeated_grid_value_of_a_set_is_refused_and_distinct_values_load(tmp_path):
    path = tmp_path / "g.toml"
    path.write_text(DEMO)
    with pytest.raises(ConfigError, match=re.escape(f"{path} with --set train.grid.mu=[0.2, 0.2]: [train.grid].mu "
                                                    "lists 0.2 twice")):
        load_pipeline(path, overrides=["train.grid.mu=[0.2, 0.2]"])
    spec = load_pipeline(path, overrides=["train.grid.mu=[0.2, 0.25]", "train.grid.lam=[25, 26]"])
    assert spec.section("train")["grid"] == {"mu": [0.2, 0.25], "lam": [25, 26]}


def test_run_with_a_repeated_grid_value_stops_before_any_stage(tmp_path, capsys):
    path = tmp_path / "g2.toml"
    path.write_text(_replace(_replace(TINY, "[train]", "[train.grid]\nmu = [0.1, 0.1]\n\n[train]"),
                             'name = "demo"', 'name = "demo"\ngrid_workers = 2'))
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out)]) == 1
    assert f"{path}: [train.grid].mu lists 0.1 twice" in capsys.readouterr().err
    assert not out.exists()


def test_synth_tables_with_features_mode_name_mode_as_the_conflict(tmp_path):
    path = tmp_path / "demo.toml"
    path.write_text(DEMO)  # generate = true already: setting it cannot help
    with pytest.raises(ConfigError) as err:
        load_pipeline(path, overrides=["data.mode=features"])
    message = str(err.value)
    assert message.startswith(f"{path} with --set data.mode=features: [synth.train] and [synth.test] describe "
                              "generated slides, but [data].mode = 'features'")
    fix = message.partition("Fix: ")[2]
    assert "[data].generate = true" not in fix
    assert "[data].mode = 'images'" in fix and "drop the [synth] tables" in fix


def test_a_grid_over_a_runtime_setting_is_refused(tmp_path):
    """Review AC, 6: [train.grid].threads = [1, 2] (or device, plots) trained the same run once per point: a
    runtime setting changes the speed, not the model."""
    toml = tmp_path / "g.toml"
    toml.write_text(TINY)
    for key, values in (("threads", "[1, 2]"), ("plots", "[true, false]"), ("device", '["cpu", "auto"]')):
        with pytest.raises(ConfigError, match=rf"\[train\.grid\]\.{key} is a runtime setting .* Fix: set it once as "
                                              rf"\[train\]\.{key}\."):
            load_pipeline(toml, overrides=[f"train.grid.{key}={values}"])


def test_a_missing_train_weights_file_is_refused_before_any_stage(prepared, tmp_path, capsys, monkeypatch):
    """Review AC, 2: a mistyped [train] weights_path was found only when train started, after the run folder
    of the finished training (other settings) had been set aside as model.replaced-*, so fixing the typo
    trained again from scratch."""
    monkeypatch.chdir(tmp_path)
    toml = prepared / "pipeline.toml"
    with pytest.raises(ConfigError, match=r": \[train\]\.weights_path 'nope\.pt': no such file .* Fix: give the "
                                          r"path of the weights file, or drop weights_path"):
        load_pipeline(toml, overrides=['train.weights_path="nope.pt"'], check_paths=True)
    out = tmp_path / "out"
    assert main(["run", str(toml), "--out", str(out), "--set", 'train.weights_path="nope.pt"']) != 0
    assert "[train].weights_path 'nope.pt': no such file" in capsys.readouterr().err
    assert not out.exists()  # no stage ran


def test_a_moved_or_copied_prepare_folder_runs_in_its_own_run_folder(prepared, tmp_path):
    """Review AC, 3: prepare writes an absolute out_dir (the folder's run); a copy of the folder ran into the
    original's run (replacing its model and heatmaps), a moved one started again at the old place. The
    pipeline of a moved or copied prepare folder runs in that folder's run; the original keeps its own."""
    assert load_pipeline(prepared / "pipeline.toml").out_dir == prepared / "run"
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    assert load_pipeline(copy / "pipeline.toml").out_dir == copy / "run"
    moved = tmp_path / "moved"
    prepared.rename(moved)
    assert load_pipeline(moved / "pipeline.toml").out_dir == moved / "run"
    elsewhere = tmp_path / "elsewhere" / "run"  # an out_dir edited by hand is the user's choice
    (moved / "pipeline.toml").write_text(re.sub(r'(?m)^out_dir = .*$', f'out_dir = "{elsewhere}"',
                                               (moved / "pipeline.toml").read_text()))
    assert load_pipeline(moved / "pipeline.toml").out_dir == elsewhere


@pytest.mark.parametrize("sets, message", [
    (["train.mode=features", "train.model=mlp"],
     r"\[train\]\.mode is 'features', but this pipeline gives the train stage patch images\. Fix: add a \[features\] "
     r"table"),
])
def test_a_train_mode_other_than_the_pipelines_inputs_is_refused_at_load(tmp_path, sets, message):
    """[train] mode = "features" in a pipeline of slides without a [features] table ran synth, tile and label,
    then stopped in train with an error that named neither the file nor [train].mode (review AR, finding 3)."""
    path = tmp_path / "demo.toml"
    path.write_text(TINY)
    load_pipeline(path)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))} with --set .*: {message}"):
        load_pipeline(path, overrides=sets)


def test_a_blank_out_dir_or_name_is_refused(tmp_path):
    """Review CX, B6: an out_dir of spaces made a folder named so (an empty one was already refused)."""
    path = tmp_path / "b.toml"
    path.write_text(_replace(DEMO, 'out_dir = "demo_out"', 'out_dir = "  "'))
    with pytest.raises(ConfigError, match=r"\[pipeline\]\.out_dir must not be empty \(or blank\)"):
        load_pipeline(path)
    path.write_text(_replace(DEMO, 'name = "demo"', 'name = " "'))
    with pytest.raises(ConfigError, match=r"\[pipeline\]\.name must not be empty \(or blank\)"):
        load_pipeline(path)


def test_heatmap_settings_of_cutting_slides_are_refused_in_an_image_pipeline(tmp_path):
    """Review CX, A2: [heatmap] tissue, min_tissue and mask_mpp choose the patches of a slide cut on the fly; a
    pipeline's heatmap reads the stores, so they changed nothing, yet were recorded and ran heatmap and evaluate
    again."""
    path = tmp_path / "h.toml"
    path.write_text(DEMO)
    with pytest.raises(ConfigError, match=r"\[heatmap\] mask_mpp, min_tissue choose the patches of a slide cut on the "
                                          r"fly.*Fix: set them in \[tile\] \(tile\.mask_mpp, tile\.min_tissue\)"):
        load_pipeline(path, overrides=["heatmap.min_tissue=1.0", "heatmap.mask_mpp=200"])
    load_pipeline(path, overrides=["tile.min_tissue=0.2"])  # in [tile] they apply


def test_a_key_above_every_table_is_named_as_such(tmp_path):
    """Review CX, C3: it was reported as an "unknown table"."""
    path = tmp_path / "t.toml"
    path.write_text("epochs = 3\n" + DEMO)
    with pytest.raises(ConfigError, match=r"t\.toml: epochs at the top level, outside any table; .*Fix: move it under "
                                          r"the table it belongs to \(e\.g\. epochs under \[train\]"):
        load_pipeline(path)


def test_a_config_file_s_top_level_keys_beside_its_table_are_refused(tmp_path, capsys, mil_csv):
    """Review CX, C8: `--config` with keys at the top level and a [train] table read the table and dropped them."""
    from wsi_milssl.cli import main

    config = tmp_path / "c.toml"
    config.write_text("epochs = 3\n\n[train]\nlr = 0.01\n")
    assert main(["train", str(mil_csv), "--config", str(config), "--out", str(tmp_path / "r")]) in (1, 2)
    assert "epochs at the top level beside a [train] table, which is the one read. Fix: move it into [train]" \
        in capsys.readouterr().err
