"""A pipeline whose test set holds training slides or bags is refused before any stage runs (review BE): generated
sets with one seed, feature files shared by both sets, and a copy of a training slide among the test slides were
all run and scored as unseen."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from tinypipeline import FEATURE_BAGS, GENERATED_SLIDES, LISTED_COHORT, feature_bags
from wsi_milssl.config import SynthConfig
from wsi_milssl.errors import ConfigError
from wsi_milssl.pipeline import load_pipeline, run_pipeline
from wsi_milssl.pipeline.overlap import refuse_test_in_training
from wsi_milssl.synth import generate_slides


def _write(path: Path, text: str) -> Path:
    path.write_text('[pipeline]\nname = "overlap"\n' + text)
    return path


def test_generated_sets_with_one_seed_are_refused(tmp_path):
    """Slide i of a generated set is drawn from (seed, i): with no seed in either table (both 0) the test slides
    were byte-identical to the training slides."""
    unseeded = GENERATED_SLIDES.replace("seed = 0\n", "").replace("seed = 1000\n", "")
    path = _write(tmp_path / "p.toml", unseeded)
    with pytest.raises(ConfigError) as caught:
        load_pipeline(path)
    assert str(caught.value) == (
        f"{path}: [synth.train] and [synth.test] have the same seed, 0 (a seed not given is 0), so the test slides "
        "would be copies of the training slides and the model would be scored on slides it trained on. Fix: give "
        "[synth.test] another seed (pipelines/demo.toml uses seed = 1000).")
    seeded = _write(tmp_path / "seeded.toml", GENERATED_SLIDES)
    assert load_pipeline(seeded).sets["test"].synth.seed == 1000
    with pytest.raises(ConfigError, match=re.escape("with --set synth.test.seed=0: [synth.train] and [synth.test] "
                                                    "have the same seed, 0")):
        load_pipeline(seeded, overrides=["synth.test.seed=0"])


def test_feature_files_of_both_sets_are_refused_before_any_stage(tmp_path):
    """test_features = train_features trained on the bags and then scored them as test bags, without a word."""
    feature_bags(tmp_path / "bags" / "train", 8, 0)
    shared = FEATURE_BAGS.replace('"bags/test', '"bags/train')
    with pytest.raises(ConfigError) as caught:
        run_pipeline(load_pipeline(_write(tmp_path / "p.toml", shared), out_dir=tmp_path / "out"))
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'p.toml'}: 8 bag(s) are in both the training and the test set (bag_00 "
                              f"in {tmp_path / 'bags' / 'train' / 'bag_00.h5'}, bag_01 in")
    assert message.endswith("the model would be scored on bags it trained or validated on. Fix: point "
                            "[data].test_features at feature files of other slides, or take the bags off one of "
                            "the two labels files.")
    assert not (tmp_path / "out" / "model").exists()


def test_a_copied_feature_file_counts_and_other_bags_do_not(tmp_path):
    """A test folder holding a copy of one training bag's file is refused for that bag alone; test bags that only
    share the training bags' names, in files of other bytes, are other slides."""
    feature_bags(tmp_path / "bags" / "train", 6, 0)
    feature_bags(tmp_path / "bags" / "test", 4, 1)  # bag_00..bag_03: the same names, other features
    spec = load_pipeline(_write(tmp_path / "p.toml", FEATURE_BAGS), out_dir=tmp_path / "out")
    refuse_test_in_training(spec)
    shutil.copy(tmp_path / "bags" / "train" / "bag_05.h5", tmp_path / "bags" / "test" / "copied.h5")
    with open(tmp_path / "bags" / "test" / "labels.csv", "a") as fh:
        fh.write("copied,1\n")  # a feature file of one slide is its bag under the labels file's name
    with pytest.raises(ConfigError, match=re.escape(
            f"1 bag(s) are in both the training and the test set (copied in {tmp_path / 'bags' / 'test' / 'copied.h5'}"
            f" holds the same bytes as {tmp_path / 'bags' / 'train' / 'bag_05.h5'})")):
        refuse_test_in_training(spec)


def test_features_of_a_training_slide_made_again_are_refused(tmp_path):
    """Review DB: the training slides' features extracted a second time (float16, another folder: other bytes) were
    taken as the test set and scored bag AUC 1.0; train --val refuses them by the slide each file records."""
    feature_bags(tmp_path / "bags" / "train", 6, 0)
    feature_bags(tmp_path / "bags" / "test", 4, 1)
    for folder, count in (("train", 6), ("test", 4)):
        for i in range(count):
            with h5py.File(tmp_path / "bags" / folder / f"bag_{i:02d}.h5", "a") as fh:
                fh.attrs["slide_path"] = str(tmp_path / "slides" / folder / f"s{i}.svs")
    spec = load_pipeline(_write(tmp_path / "p.toml", FEATURE_BAGS), out_dir=tmp_path / "out")
    refuse_test_in_training(spec)  # other slides
    again = tmp_path / "bags" / "test" / "bag_03.h5"
    with h5py.File(again, "a") as fh:
        rows = np.asarray(fh["features"][()], dtype=np.float16)
        del fh["features"]
        fh["features"] = rows
        fh.attrs["slide_path"] = str(tmp_path / "slides" / "train" / "s5.svs")
    with pytest.raises(ConfigError, match=re.escape(
            f"1 bag(s) are in both the training and the test set (bag_03 in {again} (of the slide "
            f"{tmp_path / 'slides' / 'train' / 's5.svs'}, as {tmp_path / 'bags' / 'train' / 'bag_05.h5'})): the model "
            "would be scored on bags it trained or validated on.")):
        refuse_test_in_training(spec)


def test_a_copied_feature_file_saved_as_a_batch_of_one_slide_counts_too(tmp_path):
    """Review CA: (1, N, D) files are read as their (N, D) rows (aa3efee), but the pipeline's count of a file's bags
    was not guarded: such a file counted as no bag, and its copy in the test set went through."""
    feature_bags(tmp_path / "bags" / "train", 6, 0)
    feature_bags(tmp_path / "bags" / "test", 4, 1)
    trained = tmp_path / "bags" / "train" / "bag_05.h5"
    with h5py.File(trained, "a") as fh:
        rows = np.asarray(fh["features"][()])
        del fh["features"]
        fh["features"] = rows[None]  # (1, N, D)
    spec = load_pipeline(_write(tmp_path / "p.toml", FEATURE_BAGS), out_dir=tmp_path / "out")
    shutil.copy(trained, tmp_path / "bags" / "test" / "copied.h5")
    with open(tmp_path / "bags" / "test" / "labels.csv", "a") as fh:
        fh.write("copied,1\n")
    with pytest.raises(ConfigError, match=re.escape("1 bag(s) are in both the training and the test set (copied in ")):
        refuse_test_in_training(spec)


def test_a_copied_or_unlabelled_test_feature_file_is_refused_before_training(tmp_path):
    """Review BZ: a copy of a training bag's file that the test labels did not name, and a test bag without a label
    row, were found only by evaluate, after the whole train stage (the copy as a missing label row)."""
    feature_bags(tmp_path / "bags" / "train", 6, 0)
    feature_bags(tmp_path / "bags" / "test", 4, 1)
    toml = _write(tmp_path / "p.toml", FEATURE_BAGS)
    copied = tmp_path / "bags" / "test" / "other.h5"
    shutil.copy(tmp_path / "bags" / "train" / "bag_05.h5", copied)  # no row for it in the test labels
    with pytest.raises(ConfigError, match=re.escape(f"1 bag(s) are in both the training and the test set (other in "
                                                    f"{copied} holds the same bytes as ")):
        run_pipeline(load_pipeline(toml, out_dir=tmp_path / "out"))
    copied.unlink()
    labels = tmp_path / "bags" / "test" / "labels.csv"
    labels.write_text("".join(labels.read_text().splitlines(keepends=True)[:-1]))  # bag_03's row gone
    with pytest.raises(ConfigError, match=re.escape(
            f"1 test bag(s) have no row in {labels} (bag_03 in {tmp_path / 'bags' / 'test' / 'bag_03.h5'}), so "
            "evaluate would stop after training. Fix: add a 'name,<0|1>' row for each")):
        run_pipeline(load_pipeline(toml, out_dir=tmp_path / "out"))
    assert not (tmp_path / "out" / "model").exists()
    run_pipeline(load_pipeline(toml, out_dir=tmp_path / "out"), until="train")  # a run that does not evaluate


def test_one_file_of_every_bag_split_by_the_labels_files_is_accepted(tmp_path):
    """A file of several bags (bag_ids, the MIL CSV layout) may serve both sets: its labels files choose the bags.
    A bag that both labels files list is refused."""
    folder = tmp_path / "bags"
    folder.mkdir()
    names = [f"b{i}" for i in range(6)]
    with h5py.File(folder / "all.h5", "w") as fh:
        fh["features"] = np.random.default_rng(0).normal(size=(60, 4)).astype(np.float32)
        fh.create_dataset("bag_ids", data=np.repeat(names, 10).astype(object), dtype=h5py.string_dtype())
    (folder / "train.csv").write_text("slide,label\nb0,0\nb1,1\nb2,0\nb3,1\n")
    (folder / "test.csv").write_text("slide,label\nb4,0\nb5,1\n")
    text = (FEATURE_BAGS.replace('"bags/train"', '"bags/all.h5"').replace('"bags/test"', '"bags/all.h5"')
            .replace('"bags/train/labels.csv"', '"bags/train.csv"').replace('"bags/test/labels.csv"', '"bags/test.csv"'))
    spec = load_pipeline(_write(tmp_path / "p.toml", text), out_dir=tmp_path / "out")
    refuse_test_in_training(spec)
    (folder / "test.csv").write_text("slide,label\nb4,0\nb5,1\nB1,1\n")  # labels are matched without case
    with pytest.raises(ConfigError, match=re.escape(f"1 bag(s) are in both the training and the test set (b1 in "
                                                    f"{folder / 'all.h5'})")):
        refuse_test_in_training(spec)


def test_a_copy_of_a_training_slide_among_the_test_slides_is_refused(tmp_path):
    """run compared slides by device and inode only: a plain copy under another name (prepare catches it by its
    bytes) was tiled, tested and scored as unseen."""
    slides = tmp_path / "slides"
    generate_slides(SynthConfig(n_slides=3, seed=0, width_px=1024, height_px=1024), slides)
    shutil.copy(slides / "synth_001.tif", slides / "copy.tif")
    (tmp_path / "train_slides.csv").write_text(f"path\n{slides / 'synth_000.tif'}\n{slides / 'synth_001.tif'}\n")
    (tmp_path / "test_slides.csv").write_text(f"path\n{slides / 'synth_002.tif'}\n")
    for name in ("train", "test"):
        (tmp_path / f"{name}_labels.csv").write_text("slide,label\nsynth_000,0\nsynth_001,1\nsynth_002,0\ncopy,1\n")
    spec = load_pipeline(_write(tmp_path / "p.toml", LISTED_COHORT.format(root=tmp_path)), out_dir=tmp_path / "out")
    refuse_test_in_training(spec)  # another slide of the same sizes: its bytes differ
    (tmp_path / "test_slides.csv").write_text(f"path\n{slides / 'synth_002.tif'}\n{slides / 'copy.tif'}\n")
    with pytest.raises(ConfigError, match=re.escape(
            f"1 slide(s) are in both the training and the test set ({slides / 'copy.tif'} holds the same bytes as "
            f"{slides / 'synth_001.tif'}): the model would be scored on slides it trained or validated on. Fix: "
            "remove them from the test set or from the training set (the folder or slide list it reads).")):
        run_pipeline(spec)
    assert not (tmp_path / "out" / "stores").exists()
    # a link is named as the copy is, the test file first (review BI: a link's pair was given the other way round)
    (tmp_path / "link.tif").symlink_to(slides / "synth_000.tif")
    with open(tmp_path / "test_slides.csv", "a") as fh:
        fh.write(f"{tmp_path / 'link.tif'}\n")
    with pytest.raises(ConfigError, match=re.escape(
            f"2 slide(s) are in both the training and the test set ({tmp_path / 'link.tif'} = "
            f"{slides / 'synth_000.tif'}, {slides / 'copy.tif'} holds the same bytes as {slides / 'synth_001.tif'})")):
        refuse_test_in_training(spec)
