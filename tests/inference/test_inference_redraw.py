"""``heatmap`` run again with other drawing settings draws a slide's files again from its saved probabilities,
without the model; a setting that changes the probabilities predicts it again (review Z, finding 3: a new
``--colormap`` or ``[heatmap] colormap`` predicted every test slide again, hours of GPU on CAMELYON16).

The rule: :data:`wsi_milssl.inference.stage.DRAWING_FIELDS` only change what is drawn and exported from the
probabilities (the overlay, the viewer files, the detections); the runtime fields change only the speed; every
other field (how a slide is cut on the fly) changes the probabilities, as do the checkpoint and its tiling.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from pathlib import Path

import pytest

from wsi_milssl.config import HeatmapConfig, TileConfig
from wsi_milssl.inference import make_heatmaps

FAST = dict(thumbnail_px=128, batch_size=32, num_workers=0)
#: a change of every kind of drawing setting: the overlay, the viewer files, the OME-TIFF and the detections
#: (the oracle model's probabilities are near 0 or 1: 1e-9 classifies some patches otherwise than 0.5)
DRAWING = dict(colormap="magma", thumbnail_px=96, title=False, alpha=0.8, overlay_threshold=0.2,
               tumor_threshold=1e-9, ome_downsample=4, detection_threshold=0.3, nms_radius_um=100.0)
# the checkpoints' tiling (conftest.make_checkpoint defaults), for stores the heatmap may read
TILE = dict(target_mpp=1.0, patch_size_px=32, entropy_threshold_bits=3.0, mask_mpp=8.0, pixels="raw")


@pytest.fixture(scope="module")
def two_slides(tmp_path_factory, slide_writer) -> list[Path]:
    """Two different 2048-px slides (other tissue and tumour layouts)."""
    folder = tmp_path_factory.mktemp("redraw")
    a = slide_writer(folder / "a.tif", width=2048, height=2048, tissue_box=(256, 256, 1792, 1792),
                     tumour=lambda xs, ys: (xs // 300 + ys // 300) % 4 == 0)
    b = slide_writer(folder / "b.tif", width=2048, height=2048, tissue_box=(0, 512, 2048, 1536),
                     tumour=lambda xs, ys: (xs // 300 + ys // 300 + 1) % 4 == 0)
    return [a, b]



def _slide_files(folder: Path) -> dict[str, bytes]:
    """Every per-slide file of ``folder`` by name (``<stem>_*``), as bytes."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name.startswith(("a_", "b_"))}


def _status(folder: Path) -> dict[str, tuple]:
    """Status rows without the seconds (slide -> status, n_patches, score, error)."""
    with open(folder / "heatmap_status.csv", newline="") as fh:
        return {r["slide"]: (r["status"], r["n_patches"], r["score"], r["error"]) for r in csv.DictReader(fh)}


def _assert_same_files(out: Path, fresh: Path) -> None:
    """``out`` holds the files a run straight into ``fresh`` wrote, byte for byte (scores and status too)."""
    got, want = _slide_files(out), _slide_files(fresh)
    assert sorted(got) == sorted(want)
    assert [name for name in want if got[name] != want[name]] == []
    assert (out / "scores.csv").read_bytes() == (fresh / "scores.csv").read_bytes()
    assert _status(out) == _status(fresh)


def test_a_drawing_only_change_draws_again_from_the_saved_probabilities(tmp_path, two_slides, checkpoint_factory,
                                                                      predicted):
    ckpt = checkpoint_factory()
    out = tmp_path / "hm"
    assert make_heatmaps(two_slides, ckpt, out, HeatmapConfig(**FAST)).ok
    assert predicted == ["a", "b"]
    before = _slide_files(out)
    drawing = HeatmapConfig(**{**FAST, **DRAWING})

    predicted.clear()
    run = make_heatmaps(two_slides, ckpt, out, drawing)
    assert run.ok
    assert predicted == []  # the model did not run
    assert run.redrawn == ("a", "b") and run.skipped == ()
    after = _slide_files(out)
    for stem in ("a", "b"):
        assert after[f"{stem}_probs.npy"] == before[f"{stem}_probs.npy"]  # the same probabilities
        for kind in ("heatmap.png", "detections.csv", "patches.geojson", "probs.ome.tif"):
            assert after[f"{stem}_{kind}"] != before[f"{stem}_{kind}"], kind  # drawn with the new settings
        sidecar = json.loads(after[f"{stem}_probs.json"])
        assert sidecar["fingerprint"] == json.loads((out / "heatmap_config.json").read_text())["fingerprint"]
        assert sidecar["drawing_settings"]["colormap"] == "magma"
        assert sidecar["detection_threshold"] == 0.3 and sidecar["tumor_threshold"] == 1e-9

    # every file is the one a run with these settings into an empty folder writes (it runs the model)
    fresh = tmp_path / "fresh"
    predicted.clear()
    assert make_heatmaps(two_slides, ckpt, fresh, drawing).ok
    assert predicted == ["a", "b"]
    _assert_same_files(out, fresh)

    # run again with the same settings: nothing to predict or draw
    predicted.clear()
    run = make_heatmaps(two_slides, ckpt, out, dataclasses.replace(drawing, num_workers=1, batch_size=8))
    assert run.ok and predicted == [] and run.redrawn == () and run.skipped == ("a", "b")


def test_a_prediction_setting_change_predicts_again(tmp_path, two_slides, checkpoint_factory, predicted):
    ckpt = checkpoint_factory()
    out = tmp_path / "hm"
    assert make_heatmaps(two_slides, ckpt, out, HeatmapConfig(**FAST)).ok
    changed = HeatmapConfig(**{**FAST, **DRAWING, "min_tissue": 0.9})  # how the slides are cut on the fly

    predicted.clear()
    run = make_heatmaps(two_slides, ckpt, out, changed)
    assert run.ok and predicted == ["a", "b"] and run.redrawn == () and run.skipped == ()
    fresh = tmp_path / "fresh"
    assert make_heatmaps(two_slides, ckpt, fresh, changed).ok
    _assert_same_files(out, fresh)

    # another checkpoint (other weights) predicts again too
    other = checkpoint_factory(model_kwargs={"gain": 5.0, "min_fraction": 0.5})
    predicted.clear()
    run = make_heatmaps(two_slides, other, out, changed)
    assert run.ok and predicted == ["a", "b"] and run.redrawn == ()


def test_slides_read_from_stores_are_drawn_again_as_they_were_predicted(tmp_path, two_slides, checkpoint_factory,
                                                                         predicted):
    from wsi_milssl.tiling import tile_slides

    ckpt = checkpoint_factory()
    stores = tmp_path / "stores"
    tile_slides(two_slides, stores, TileConfig(**TILE))
    out = tmp_path / "hm"
    assert make_heatmaps(two_slides, ckpt, out, HeatmapConfig(**FAST), stores=[stores]).ok
    drawing = HeatmapConfig(**{**FAST, **DRAWING})
    predicted.clear()
    run = make_heatmaps(two_slides, ckpt, out, drawing, stores=[stores])
    assert run.ok and predicted == [] and run.redrawn == ("a", "b")
    fresh = tmp_path / "fresh"
    assert make_heatmaps(two_slides, ckpt, fresh, drawing, stores=[stores]).ok
    _assert_same_files(out, fresh)


def test_saved_probabilities_that_cannot_be_read_are_predicted_again(tmp_path, two_slides, checkpoint_factory,
                                                                     predicted):
    ckpt = checkpoint_factory()
    out = tmp_path / "hm"
    assert make_heatmaps(two_slides, ckpt, out, HeatmapConfig(**FAST)).ok
    (out / "a_probs.npy").write_bytes(b"not a map")  # damaged since
    drawing = HeatmapConfig(**{**FAST, **DRAWING})
    predicted.clear()
    run = make_heatmaps(two_slides, ckpt, out, drawing)
    assert run.ok and predicted == ["a"] and run.redrawn == ("b",)
    fresh = tmp_path / "fresh"
    assert make_heatmaps(two_slides, ckpt, fresh, drawing).ok
    _assert_same_files(out, fresh)


def test_every_setting_is_a_runtime_a_drawing_or_a_prediction_setting():
    """The rule, in one place: a field added to HeatmapConfig counts as changing the probabilities (the safe
    side: slides are predicted again) until it is listed as a drawing or runtime setting."""
    from wsi_milssl.inference.stage import _RUNTIME_FIELDS, DRAWING_FIELDS, _fingerprint_settings

    fields = {f.name for f in dataclasses.fields(HeatmapConfig)}
    assert set(DRAWING_FIELDS) <= fields and not set(DRAWING_FIELDS) & set(_RUNTIME_FIELDS)
    assert fields - set(DRAWING_FIELDS) - set(_RUNTIME_FIELDS) == {"tissue", "min_tissue", "mask_mpp", "slide_mpp"}
    assert {"colormap", "thumbnail_px", "title", "annotation_color", "detection_threshold"} <= set(DRAWING_FIELDS)
    # the folder's fingerprint (evaluate's run identity) still covers every drawing setting
    assert set(DRAWING_FIELDS) - {"tumor_groups", "non_tumor_groups"} <= set(_fingerprint_settings(HeatmapConfig()))


def test_the_cli_summary_names_redrawn_slides_without_a_patch_rate(tmp_path, two_slides, checkpoint_factory, capsys):
    """`heatmap` run again with only another --colormap used to print the redrawn slides' patches as 'new
    patches' with a patches/s rate, although the model did not run."""
    from wsi_milssl.cli import main

    ckpt, out = checkpoint_factory(), tmp_path / "hm"
    args = ["heatmap", *map(str, two_slides), "--model", str(ckpt), "--out", str(out), "--thumbnail-px", "128",
            "--batch-size", "32", "--workers", "0"]
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--colormap", "magma"]) == 0
    summary = capsys.readouterr().out.splitlines()[0]
    assert "0 new patches in" in summary and "patches/s" not in summary, summary
    assert "2 slide(s) drawn again from their saved probabilities (drawing settings or outlines changed, or files " \
           "were missing; nothing predicted)" in summary, summary


def test_a_slide_predicted_without_its_slide_file_leaves_no_earlier_overlay(tmp_path, two_slides, checkpoint_factory):
    """Review AC, 4: a store-based heatmap predicted again while the slide file was not available (moved)
    draws no overlay PNG, but the earlier run's PNG (another model) stayed beside the new files."""
    import shutil

    from wsi_milssl.tiling import tile_slides

    copies = tmp_path / "slides"
    copies.mkdir()
    slides = [Path(shutil.copy(s, copies / s.name)) for s in two_slides]
    stores = tmp_path / "stores"
    tile_slides(slides, stores, TileConfig(**TILE))
    out = tmp_path / "hm"
    assert make_heatmaps([], checkpoint_factory(), out, HeatmapConfig(**FAST), stores=[stores]).ok
    assert (out / "a_heatmap.png").is_file()
    copies.rename(tmp_path / "moved")
    assert make_heatmaps([], checkpoint_factory(), out, HeatmapConfig(**FAST), stores=[stores], overwrite=True).ok
    assert not (out / "a_heatmap.png").exists() and (out / "a_probs.npy").is_file()



def test_an_annotation_file_added_edited_or_removed_draws_the_overlay_again(tmp_path, two_slides,
                                                                          checkpoint_factory, predicted,
                                                                          outline_writer):
    """The outlines on the overlay come from the annotation folder, which no fingerprint covered: a run
    with --annotations on a finished folder kept the overlays without outlines, and an edited annotation
    kept the old outline. Such a slide is now drawn again from its saved probabilities (not predicted)."""
    ckpt = checkpoint_factory()
    out, fresh, ann = tmp_path / "hm", tmp_path / "fresh", tmp_path / "ann"
    config = HeatmapConfig(**FAST)
    assert make_heatmaps(two_slides, ckpt, out, config).ok
    before = _slide_files(out)

    outline_writer(ann, "a", (300, 300, 1500, 1500))  # a has an annotation now, b none
    predicted.clear()
    run = make_heatmaps(two_slides, ckpt, out, config, annotations_dir=ann)
    assert run.ok and predicted == [] and run.redrawn == ("a",) and run.skipped == ("b",)
    after = _slide_files(out)
    assert after["a_heatmap.png"] != before["a_heatmap.png"] and after["b_heatmap.png"] == before["b_heatmap.png"]
    assert make_heatmaps(two_slides, ckpt, fresh, config, annotations_dir=ann).ok
    assert after["a_heatmap.png"] == _slide_files(fresh)["a_heatmap.png"]  # as a fresh run draws it

    predicted.clear()  # the same annotations again: nothing to draw
    run = make_heatmaps(two_slides, ckpt, out, config, annotations_dir=ann)
    assert run.redrawn == () and run.skipped == ("a", "b")

    outline_writer(ann, "a", (900, 900, 1700, 1700))  # edited
    run = make_heatmaps(two_slides, ckpt, out, config, annotations_dir=ann)
    assert predicted == [] and run.redrawn == ("a",)
    edited = _slide_files(out)["a_heatmap.png"]
    assert edited != after["a_heatmap.png"]

    run = make_heatmaps(two_slides, ckpt, out, config)  # without annotations: no outline
    assert predicted == [] and run.redrawn == ("a",)
    assert _slide_files(out)["a_heatmap.png"] == before["a_heatmap.png"]


def test_an_annotation_edited_in_place_with_its_size_and_time_kept_draws_the_overlay_again(
        tmp_path, two_slides, checkpoint_factory, predicted, outline_writer):
    """Review EM, A1: an outline moved in an annotation file of the same size whose modification time was put
    back (`touch -r`) kept the old outline on the overlay, while label and evaluate read the new one: the
    overlay's annotation is compared by its bytes now. A file touched with the same bytes draws nothing."""
    ckpt = checkpoint_factory()
    out, ann = tmp_path / "hm", tmp_path / "ann"
    config = HeatmapConfig(**FAST)
    outline_writer(ann, "a", (300, 300, 1500, 1500))
    assert make_heatmaps(two_slides, ckpt, out, config, annotations_dir=ann).ok
    xml = next(ann.glob("a.*"))
    first, stat = _slide_files(out)["a_heatmap.png"], xml.stat()
    outline_writer(ann, "a", (900, 900, 1700, 1700))
    os.utime(xml, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (xml.stat().st_size, xml.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    predicted.clear()
    run = make_heatmaps(two_slides, ckpt, out, config, annotations_dir=ann)
    assert predicted == [] and run.redrawn == ("a",)
    assert _slide_files(out)["a_heatmap.png"] != first
    os.utime(xml)  # a new time, the same bytes
    run = make_heatmaps(two_slides, ckpt, out, config, annotations_dir=ann)
    assert run.redrawn == () and run.skipped == ("a", "b")
