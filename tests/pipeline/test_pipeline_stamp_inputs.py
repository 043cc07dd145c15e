"""What a stage's stamp covers: speed-only settings do not count, small input files count by content
(written again with the same bytes or touched: the same input), and the slides a slide list names count
(a slide replaced or renamed behind the list is a change)."""

from __future__ import annotations

import os

from wsi_milssl.pipeline import load_pipeline
from wsi_milssl.pipeline.digests import external_inputs, stage_settings

PIPELINE = """
[pipeline]
name = "stamps"
[data]
train_slides = "cohort/train_slides.csv"
train_labels = "cohort/train_labels.csv"
train_annotations = "cohort/annotations"
test_slides = "cohort/test_slides.csv"
test_labels = "cohort/test_labels.csv"
test_annotations = "cohort/annotations"
"""


def _cohort(root):
    (root / "slides").mkdir(parents=True)
    (root / "cohort" / "annotations").mkdir(parents=True)
    for name, size in (("a", 100), ("b", 200), ("c", 300)):
        (root / "slides" / f"{name}.tif").write_bytes(b"x" * size)
    (root / "cohort" / "train_slides.csv").write_text(f"path\n{root / 'slides' / 'a.tif'}\n{root / 'slides' / 'b.tif'}\n")
    (root / "cohort" / "test_slides.csv").write_text(f"path\n{root / 'slides' / 'c.tif'}\n")
    (root / "cohort" / "train_labels.csv").write_text("slide,label\na,1\nb,0\n")
    (root / "cohort" / "test_labels.csv").write_text("slide,label\nc,1\n")
    (root / "cohort" / "annotations" / "a.xml").write_text("<ASAP_Annotations/>")
    (root / "p.toml").write_text(PIPELINE)
    return load_pipeline(root / "p.toml", out_dir=root / "out")


def test_speed_only_settings_leave_the_digest_alone(tmp_path):
    spec = _cohort(tmp_path)
    faster = load_pipeline(tmp_path / "p.toml", out_dir=tmp_path / "out",
                           overrides=["tile.workers=4", "tile.threads=8", "heatmap.batch_size=512"])
    other = load_pipeline(tmp_path / "p.toml", out_dir=tmp_path / "out", overrides=["tile.patch_size_px=128"])
    for stage in ("tile", "heatmap"):
        assert stage_settings(faster, stage) == stage_settings(spec, stage)
    assert stage_settings(other, "tile") != stage_settings(spec, "tile")


def test_small_inputs_count_by_content(tmp_path):
    spec = _cohort(tmp_path)
    before = external_inputs(spec, "label")
    xml = tmp_path / "cohort" / "annotations" / "a.xml"
    xml.write_text(xml.read_text())  # written again, same bytes (prepare run again)
    os.utime(tmp_path / "cohort" / "test_labels.csv", ns=(1, 1))  # touched
    assert external_inputs(spec, "label") == before
    xml.write_text("<ASAP_Annotations><Annotations/></ASAP_Annotations>")
    assert external_inputs(spec, "label") != before


def test_the_slides_a_list_names_count(tmp_path):
    spec = _cohort(tmp_path)
    before = external_inputs(spec, "tile")
    (tmp_path / "slides" / "b.tif").write_bytes(b"y" * 250)  # another slide under the same name
    replaced = external_inputs(spec, "tile")
    assert replaced != before
    (tmp_path / "slides" / "b.tif").rename(tmp_path / "slides" / "b_renamed.tif")  # the list names it still
    assert external_inputs(spec, "tile") != replaced


def test_the_pipeline_and_the_heatmap_stage_agree_on_what_only_changes_speed(tmp_path):
    """A heatmap setting the stage keeps every slide for (left out of a slide's fingerprint) does not make `run`
    run the stage either: channels_last and fuse_batchnorm were speed-only in the stage and settings in the
    pipeline's digest, so `run --set heatmap.channels_last=false` ran heatmap and evaluate and predicted nothing."""
    from wsi_milssl.config import HeatmapConfig
    from wsi_milssl.inference.stage import _fingerprint_settings

    spec = _cohort(tmp_path)
    flipped = {"channels_last": ("false", False), "fuse_batchnorm": ("false", False), "batch_size": ("7", 7),
               "num_workers": ("0", 0), "threads": ("1", 1), "device": ('"cpu"', "cpu"), "decode": ('"device"', "device")}
    for field, (toml_value, value) in flipped.items():
        assert _fingerprint_settings(HeatmapConfig(**{field: value})) == _fingerprint_settings(HeatmapConfig()), field
        changed = load_pipeline(tmp_path / "p.toml", out_dir=tmp_path / "out", overrides=[f"heatmap.{field}={toml_value}"])
        assert stage_settings(changed, "heatmap") == stage_settings(spec, "heatmap"), field
    colored = load_pipeline(tmp_path / "p.toml", out_dir=tmp_path / "out", overrides=['heatmap.colormap="magma"'])
    assert stage_settings(colored, "heatmap") != stage_settings(spec, "heatmap")


def test_a_slide_moved_into_the_other_sets_folder_is_a_change_a_folder_moved_is_not(tmp_path):
    """The tile stage's stamp lists the training slides, then the test slides: by file name alone, a slide moved from
    the training folder into the test folder (`mv` keeps its time) left the list as it was, so every stage stayed
    up to date with a test slide trained on (review AW A1). Files count as moved only with their whole folder."""
    from wsi_milssl.pipeline.stamps import fingerprint_paths, recorded_digest, same_files_moved, write_stamp

    root = tmp_path / "c"
    for set_name, names in (("train", ("s0", "s1", "s2")), ("test", ("s3", "s4"))):
        (root / set_name).mkdir(parents=True)
        for name in names:
            (root / set_name / f"{name}.tif").write_bytes(name.encode() * 10)

    def rows(base):
        return {"external": fingerprint_paths(sorted((base / "train").iterdir()))
                + fingerprint_paths(sorted((base / "test").iterdir()))}

    before = rows(root)
    state = tmp_path / "out" / ".pipeline"
    write_stamp(state, "tile", digest="d0", outputs=[], settings={}, inputs=before)
    (root / "train" / "s2.tif").rename(root / "test" / "s2.tif")  # a training slide becomes a test slide
    assert not same_files_moved(before, rows(root))
    assert recorded_digest(state, "tile", "d1", {}, rows(root)) == "d1"  # runs again
    (root / "test" / "s2.tif").rename(root / "train" / "s2.tif")
    moved = tmp_path / "disk2" / "c"
    moved.parent.mkdir()
    root.rename(moved)  # the whole cohort moved: the same inputs
    assert same_files_moved(before, rows(moved))
    assert recorded_digest(state, "tile", "d2", {}, rows(moved)) == "d0"
    (moved / "test").rename(tmp_path / "disk2" / "test")  # one folder moved on its own: still the same files
    assert same_files_moved(before, {"external": fingerprint_paths(sorted((moved / "train").iterdir()))
                                     + fingerprint_paths(sorted((tmp_path / "disk2" / "test").iterdir()))})


def test_the_reason_names_a_slide_moved_into_the_other_sets_folder(tmp_path):
    from wsi_milssl.pipeline.stamps import fingerprint_paths, stale_reason, write_stamp

    for set_name, names in (("train", ("s0", "s1", "s2")), ("test", ("s3",))):
        (tmp_path / set_name).mkdir()
        for name in names:
            (tmp_path / set_name / f"{name}.tif").write_bytes(name.encode() * 10)

    def rows():
        return {"upstream": {}, "external": fingerprint_paths(sorted((tmp_path / "train").iterdir()))
                + fingerprint_paths(sorted((tmp_path / "test").iterdir()))}

    state = tmp_path / "out" / ".pipeline"
    write_stamp(state, "tile", digest="d0", outputs=[], settings={}, inputs=rows())
    (tmp_path / "train" / "s2.tif").rename(tmp_path / "test" / "s2.tif")
    assert stale_reason(state, "tile", ("d1",), settings={}, inputs=rows()) == (
        f"input changed: {tmp_path / 'test' / 's2.tif'} (moved from {tmp_path / 'train' / 's2.tif'})")
