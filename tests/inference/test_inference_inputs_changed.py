"""``heatmap`` resumes only slides whose slide and store files are the ones their outputs were made
from, and a checkpoint that gives NaN fails each slide cleanly, before any of its files is written."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from wsi_milssl.config import HeatmapConfig, TileConfig
from wsi_milssl.inference import make_heatmaps

FAST = dict(thumbnail_px=128, batch_size=32, num_workers=0)
# the checkpoints' tiling (conftest.make_checkpoint defaults), for stores the heatmap may read
TILE = dict(target_mpp=1.0, patch_size_px=32, entropy_threshold_bits=3.0, mask_mpp=8.0, pixels="raw")


@pytest.fixture(scope="module")
def two_slides(tmp_path_factory, slide_writer) -> tuple[Path, Path]:
    """Two different 2048-px slides (other tissue and tumour layouts)."""
    folder = tmp_path_factory.mktemp("two")
    a = slide_writer(folder / "a.tif", width=2048, height=2048, tissue_box=(256, 256, 1792, 1792),
                     tumour=lambda xs, ys: (xs // 300 + ys // 300) % 4 == 0)
    b = slide_writer(folder / "b.tif", width=2048, height=2048, tissue_box=(0, 512, 2048, 1536),
                     tumour=lambda xs, ys: (xs // 300 + ys // 300 + 1) % 4 == 0)
    return a, b


def _status(folder: Path) -> dict[str, dict]:
    with open(folder / "heatmap_status.csv", newline="") as fh:
        return {r["slide"]: r for r in csv.DictReader(fh)}


def _scores(folder: Path) -> dict[str, str]:
    path = folder / "scores.csv"
    if not path.exists():
        return {}
    with open(path, newline="") as fh:
        return {r["slide"]: r["score"] for r in csv.DictReader(fh)}


def test_a_slide_rewritten_at_the_same_path_is_predicted_again(tmp_path, two_slides, checkpoint_factory):
    a, b = two_slides
    ckpt = checkpoint_factory()
    slide = tmp_path / "slides" / "case.tif"
    slide.parent.mkdir()
    shutil.copyfile(a, slide)
    out = tmp_path / "hm"
    assert make_heatmaps([slide], ckpt, out, HeatmapConfig(**FAST)).ok
    stamp = (out / "case_probs.npy").stat().st_mtime_ns
    recorded = json.loads((out / "case_probs.json").read_text())["input_files"]
    assert recorded["slide"]["path"] == str(slide.resolve()) and recorded["store"] is None
    assert recorded["slide"]["size_bytes"] == slide.stat().st_size
    # unchanged: skipped
    events = []
    make_heatmaps([slide], ckpt, out, HeatmapConfig(**FAST), progress=events.append)
    assert not [e for e in events if e.stage == "heatmap-patches" and e.item]
    assert (out / "case_probs.npy").stat().st_mtime_ns == stamp

    shutil.copyfile(b, slide)  # another slide under the same name and path
    events = []
    run = make_heatmaps([slide], ckpt, out, HeatmapConfig(**FAST), progress=events.append)
    assert run.ok and {e.item for e in events if e.stage == "heatmap-patches" and e.item} == {"case"}
    alone = make_heatmaps([b], ckpt, tmp_path / "b_alone", HeatmapConfig(**FAST))
    np.testing.assert_array_equal(np.load(out / "case_probs.npy"), np.load(tmp_path / "b_alone" / "b_probs.npy"))
    assert _scores(out)["case"] == _scores(tmp_path / "b_alone")["b"]
    assert _status(out)["case"]["n_patches"] == str(alone.results[0].n_patches)


def test_another_slide_file_with_the_same_name_is_predicted_again(tmp_path, two_slides, checkpoint_factory):
    a, b = two_slides
    ckpt = checkpoint_factory()
    first, second = tmp_path / "x" / "case.tif", tmp_path / "y" / "case.tif"
    for path, source in ((first, a), (second, b)):
        path.parent.mkdir()
        shutil.copyfile(source, path)
    out = tmp_path / "hm"
    make_heatmaps([first], ckpt, out, HeatmapConfig(**FAST))
    events = []
    make_heatmaps([second], ckpt, out, HeatmapConfig(**FAST), progress=events.append)
    assert {e.item for e in events if e.stage == "heatmap-patches" and e.item} == {"case"}
    sidecar = json.loads((out / "case_probs.json").read_text())
    assert sidecar["slide_path"] == str(second.resolve())
    assert sidecar["input_files"]["slide"]["path"] == str(second.resolve())


def test_a_store_tiled_again_is_predicted_again(tmp_path, two_slides, checkpoint_factory):
    from wsi_milssl.tiling import tile_slide

    a, b = two_slides
    ckpt = checkpoint_factory()
    slide = tmp_path / "slides" / "case.tif"
    slide.parent.mkdir()
    shutil.copyfile(a, slide)
    stores = tmp_path / "stores"
    tile_slide(slide, stores, TileConfig(**TILE))
    out = tmp_path / "hm"
    assert make_heatmaps([], ckpt, out, HeatmapConfig(**FAST), stores=[stores]).ok
    recorded = json.loads((out / "case_probs.json").read_text())["input_files"]
    assert recorded["store"]["path"] == str((stores / "case.h5").resolve())
    n_a = _status(out)["case"]["n_patches"]

    shutil.copyfile(b, slide)
    assert tile_slide(slide, stores, TileConfig(**TILE)).status == "ok"  # the slide changed: re-tiled
    events = []
    assert make_heatmaps([], ckpt, out, HeatmapConfig(**FAST), stores=[stores], progress=events.append).ok
    assert {e.item for e in events if e.stage == "heatmap-patches" and e.item} == {"case"}
    n_b = _status(out)["case"]["n_patches"]
    assert n_b != n_a
    alone = make_heatmaps([b], ckpt, tmp_path / "b_alone", HeatmapConfig(**FAST))
    assert n_b == str(alone.results[0].n_patches)


def test_outputs_without_recorded_inputs_are_predicted_again(tmp_path, two_slides, checkpoint_factory):
    """A folder written before ``input_files`` existed cannot be checked: its slides are predicted again."""
    a, _ = two_slides
    ckpt = checkpoint_factory()
    out = tmp_path / "hm"
    make_heatmaps([a], ckpt, out, HeatmapConfig(**FAST))
    sidecar = json.loads((out / "a_probs.json").read_text())
    del sidecar["input_files"]
    (out / "a_probs.json").write_text(json.dumps(sidecar))
    events = []
    make_heatmaps([a], ckpt, out, HeatmapConfig(**FAST), progress=events.append)
    assert {e.item for e in events if e.stage == "heatmap-patches" and e.item} == {"a"}
    assert "input_files" in json.loads((out / "a_probs.json").read_text())


def test_a_nan_checkpoint_fails_every_slide_cleanly_and_writes_no_files(tmp_path, two_slides, checkpoint_writer):
    from wsi_milssl.mil.models import create_model

    torch.manual_seed(0)
    model = create_model("resnet18")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    ckpt = checkpoint_writer(tmp_path / "diverged" / "best.pt", model_name="resnet18", model=model)
    out = tmp_path / "hm"
    run = make_heatmaps(list(two_slides), ckpt, out, HeatmapConfig(**FAST))
    assert [r.status for r in run.results] == ["failed", "failed"]  # the second slide was still tried
    status = _status(out)
    assert sorted(status) == ["a", "b"]
    for stem, row in status.items():
        assert row["status"] == "failed" and row["score"] == ""
        assert row["error"].startswith(f"{ckpt}: the model gives non-finite probabilities (NaN or infinity) for ")
        assert f"patches of slide '{stem}'" in row["error"]
        assert "diverged run" in row["error"] and "Fix: retrain with a lower learning rate (--lr)" in row["error"]
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "heatmap_config.json", "heatmap_status.csv"]
    assert _scores(out) == {}


def test_heatmap_command_with_a_nan_checkpoint_reports_the_failed_slides(tmp_path, two_slides, capsys,
                                                                       checkpoint_writer):
    from wsi_milssl.cli import main
    from wsi_milssl.mil.models import create_model

    model = create_model("resnet18")
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    ckpt = checkpoint_writer(tmp_path / "diverged" / "best.pt", model_name="resnet18", model=model)
    code = main(["heatmap", str(two_slides[0]), "--model", str(ckpt), "--out", str(tmp_path / "hm"),
                 "--workers", "0", "--thumbnail-px", "128"])
    captured = capsys.readouterr()
    assert code != 0
    assert "Traceback" not in captured.err and "ValueError" not in captured.err
    assert "non-finite probabilities" in captured.out + captured.err
    assert _status(tmp_path / "hm")["a"]["status"] == "failed"


def _blank(path: Path) -> Path:
    from wsi_milssl.synth.pyramid import write_pyramidal_tiff

    return write_pyramidal_tiff(path, lambda x0, y0, x1, y1: np.full((y1 - y0, x1 - x0, 3), 245, np.uint8),
                                width=2048, height=2048, mpp=0.25)


def test_a_slide_found_empty_loses_its_earlier_files_under_any_spelling_of_its_name(tmp_path, two_slides,
                                                                                       checkpoint_factory):
    """Its earlier predictions (also those of a name that differs only in case, which evaluate takes for the
    same slide) would be evaluated as its current ones; other slides' files stay."""
    a, b = two_slides
    ckpt = checkpoint_factory()
    slides = tmp_path / "slides"
    slides.mkdir()
    shutil.copyfile(a, slides / "case.tif")
    shutil.copyfile(b, slides / "case_2.tif")
    out = tmp_path / "hm"
    assert make_heatmaps([slides / "case.tif", slides / "case_2.tif"], ckpt, out, HeatmapConfig(**FAST)).ok
    (slides / "case.tif").unlink()
    _blank(slides / "Case.tif")  # renamed in letter case, and no tissue now
    run = make_heatmaps([slides / "Case.tif"], ckpt, out, HeatmapConfig(**FAST))
    assert [r.status for r in run.results] == ["empty"]
    assert sorted(p.name for p in out.glob("case*")) == sorted(p.name for p in out.glob("case_2*")) != []
    assert [p.name for p in out.glob("Case_*")] == ["Case_detections.csv"]  # empty: the empty slide's own
    assert (out / "Case_detections.csv").read_bytes() == b"" and set(_scores(out)) == {"case_2"}


def test_an_unreadable_scores_file_fails_an_empty_slide_alone(tmp_path, two_slides, checkpoint_factory):
    a, _ = two_slides
    ckpt = checkpoint_factory()
    out = tmp_path / "hm"
    out.mkdir()
    (out / "scores.csv").write_bytes(b"\xff\xfe not a csv")
    run = make_heatmaps([_blank(tmp_path / "blank.tif"), a], ckpt, out, HeatmapConfig(**FAST))
    assert [r.status for r in run.results] == ["failed", "failed"]  # each slide alone, and a status row each
    assert set(_status(out)) == {"blank", "a"}


def test_evaluate_of_a_folder_whose_slides_are_all_empty_says_so(tmp_path, checkpoint_factory):
    """No slide has a score, so the heatmap writes no scores.csv: the bag AUC's reason says every slide was
    empty, not that the folder lacks a file (and evaluate used to refuse the folder altogether)."""
    from wsi_milssl.evaluation import evaluate_predictions

    out = tmp_path / "hm"
    blank = _blank(tmp_path / "blank.tif")
    assert [r.status for r in make_heatmaps([blank], checkpoint_factory(), out, HeatmapConfig(**FAST)).results] == [
        "empty"]
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\nblank,0\n")
    result = evaluate_predictions(out, labels_csv=labels, out_dir=tmp_path / "ev", slides=tmp_path)
    assert result.metrics["n_slides"] == 1
    assert json.loads((tmp_path / "ev" / "metrics.json").read_text())["reasons"]["bag_auc"] == (
        "every slide was empty (no tissue patch), so no slide has a score")
    # review CX: with a scores.csv holding their 0 scores (two labels), the bag AUC was 0.500 of no patch at all
    _blank(tmp_path / "blank2.tif")
    assert [r.status for r in make_heatmaps([tmp_path / "blank2.tif"], checkpoint_factory(), out,
                                            HeatmapConfig(**FAST)).results] == ["empty"]
    (out / "scores.csv").write_text("slide,score\nblank,0.0\nblank2,0.0\n")
    labels.write_text("slide,label\nblank,0\nblank2,1\n")
    import numpy as np

    from wsi_milssl.annotations.asap import PolygonAnnotation, write_asap_xml

    (tmp_path / "ann").mkdir()
    square = np.array([[10, 10], [60, 10], [60, 60], [10, 60]], float)
    write_asap_xml([PolygonAnnotation("Annotation 0", "_0", square, "#F4FA58")], tmp_path / "ann" / "blank2.xml",
                   groups=["_0"])
    result = evaluate_predictions(out, labels_csv=labels, out_dir=tmp_path / "ev2", slides=tmp_path,
                                  annotations_dir=tmp_path / "ann")
    assert result.metrics["bag_auc"] is None and result.metrics["n_slides"] == 2
    assert json.loads((tmp_path / "ev2" / "metrics.json").read_text())["reasons"]["bag_auc"] == (
        "every slide was empty (no tissue patch), so no slide has a score")


def test_a_finite_checkpoint_that_overflows_is_not_called_diverged(tmp_path, two_slides, checkpoint_writer):
    """Weights that are finite but extreme overflow the network: the message says the weights are finite and
    names the first patch, instead of claiming they hold NaN or infinity."""
    from wsi_milssl.mil.models import create_model

    torch.manual_seed(0)
    model = create_model("resnet18")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1e30)
    ckpt = checkpoint_writer(tmp_path / "extreme" / "best.pt", model_name="resnet18", model=model)
    out = tmp_path / "hm"
    run = make_heatmaps([two_slides[0]], ckpt, out, HeatmapConfig(**FAST))
    assert [r.status for r in run.results] == ["failed"]
    error = _status(out)["a"]["error"]
    assert error.startswith(f"{ckpt}: the model gives non-finite probabilities (NaN or infinity) for ")
    assert "its weights hold NaN" not in error and "its weights are finite, so its computation overflows" in error
    assert "(first: row 0, level-0 (" in error and "retrain with a lower learning rate (--lr)" in error


def test_a_store_of_a_slide_without_a_resolution_is_predicted_at_the_store_s(tmp_path, checkpoint_factory):
    """Review BO, C2: `heatmap --store` failed a slide without µm/px in its metadata (tiled with --slide-mpp)
    while the store records the µm/px it was cut at: the check of the slide's size and the overlay opened it
    without one."""
    from wsi_milssl.synth.pyramid import write_pyramidal_tiff
    from wsi_milssl.tiling import tile_slide

    def render(x0: int, y0: int, x1: int, y1: int) -> np.ndarray:  # textured tissue in a glass frame
        ys, xs = np.mgrid[y0:y1, x0:x1]
        noise = ((xs * 7919 + ys * 104729) % 61).astype(np.float32)
        tissue = (xs >= 256) & (xs < 1792) & (ys >= 256) & (ys < 1792)
        rgb = np.where(tissue[..., None], np.stack([180 + noise, 90 + noise, 150 + noise], -1), 245.0)
        return np.clip(rgb, 0, 255).astype(np.uint8)

    (tmp_path / "slides").mkdir()
    slide = write_pyramidal_tiff(tmp_path / "slides" / "bare.tif", render, width=2048, height=2048, mpp=None)
    stores = tmp_path / "stores"
    assert tile_slide(slide, stores, TileConfig(**TILE, slide_mpp=0.25)).status == "ok"
    run = make_heatmaps([slide], checkpoint_factory(), tmp_path / "hm", HeatmapConfig(**FAST), stores=[stores])
    assert run.ok and run.results[0].status == "ok"
    assert json.loads((tmp_path / "hm" / "bare_probs.json").read_text())["mpp"] == 0.25
