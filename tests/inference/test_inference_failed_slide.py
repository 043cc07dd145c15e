"""A slide the heatmap stage fails on keeps no files of an earlier run (they were left beside its 'failed'
status row, with its scores.csv row, and evaluate scored them); evaluate takes the folder of one run
(resumed or not) and refuses one where slides of two checkpoints lie side by side."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from wsi_milssl.config import EvaluateConfig, HeatmapConfig
from wsi_milssl.errors import EvaluationError
from wsi_milssl.evaluation import evaluate_predictions
from wsi_milssl.inference import make_heatmaps

FAST = dict(thumbnail_px=128, batch_size=32, num_workers=0)


@pytest.fixture(scope="module")
def two_slides(tmp_path_factory, slide_writer) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("two")
    a = slide_writer(folder / "a.tif", width=2048, height=2048, tissue_box=(256, 256, 1792, 1792),
                     tumour=lambda xs, ys: (xs // 300 + ys // 300) % 4 == 0)
    b = slide_writer(folder / "b.tif", width=2048, height=2048, tissue_box=(0, 512, 2048, 1536),
                     tumour=lambda xs, ys: (xs // 300 + ys // 300 + 1) % 4 == 0)
    return a, b


def _rows(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    with open(path, newline="") as fh:
        return {r["slide"]: r for r in csv.DictReader(fh)}


def _files(folder: Path, stem: str) -> list[str]:
    return sorted(p.name for p in folder.glob(f"{stem}_*"))


def test_a_failed_slide_loses_the_files_and_score_of_an_earlier_run(tmp_path, two_slides, checkpoint_factory):
    a, b = two_slides
    out = tmp_path / "hm"
    assert make_heatmaps([a, b], checkpoint_factory(), out, HeatmapConfig(**FAST)).ok
    assert _files(out, "a") and "a" in _rows(out / "scores.csv")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "a.tif").write_bytes(a.read_bytes()[:5000])  # truncated
    run = make_heatmaps([broken / "a.tif", b], checkpoint_factory(model_kwargs={"gain": 20.0}), out,
                        HeatmapConfig(**FAST))
    assert {r.slide: r.status for r in run.results} == {"a": "failed", "b": "ok"}
    assert _rows(out / "heatmap_status.csv")["a"]["status"] == "failed"
    assert _files(out, "a") == []
    assert set(_rows(out / "scores.csv")) == {"b"}
    assert _files(out, "b")


def _evaluate(folder: Path, tmp_path: Path, name: str):
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\na,0\nb,0\n")  # normal slides: no annotation needed
    return evaluate_predictions(folder, labels_csv=labels, out_dir=tmp_path / name, config=EvaluateConfig())


def test_evaluate_takes_one_run_resumed_and_refuses_two_checkpoints(tmp_path, two_slides, checkpoint_factory):
    a, b = two_slides
    first = checkpoint_factory()
    out = tmp_path / "hm"
    assert make_heatmaps([a], first, out, HeatmapConfig(**FAST)).ok
    # resumed with other runtime settings: b is predicted, a kept; one run
    assert make_heatmaps([a, b], first, out, HeatmapConfig(**{**FAST, "batch_size": 16})).ok
    assert _evaluate(out, tmp_path, "one").metrics["n_slides"] == 2
    # a partial re-run with another checkpoint leaves slides of two checkpoints side by side
    mixed = tmp_path / "mixed"
    shutil.copytree(out, mixed)
    second = checkpoint_factory(model_kwargs={"gain": 20.0})
    assert make_heatmaps([b], second, mixed, HeatmapConfig(**FAST)).ok
    with pytest.raises(EvaluationError) as exc:
        _evaluate(mixed, tmp_path, "two")
    message = str(exc.value)
    assert "its slides were predicted by 2 different heatmap runs" in message
    assert f"slides a by checkpoint {first}" in message and f"slides b by checkpoint {second}" in message
    assert "Fix: run the heatmap stage again with --overwrite on the whole set of slides" in message


def test_a_failed_slides_row_that_cannot_be_written_now_is_written_at_the_end(tmp_path, two_slides,
                                                                              checkpoint_factory, monkeypatch):
    """On a full disk a writer thread may fill the disk with one slide's files while the main thread adds
    a failed slide's status row: that OutputError stopped the whole run (the race CI met in the features
    stage). The row is written with the others at the end and the other slides go on."""
    from wsi_milssl.errors import OutputError
    from wsi_milssl.inference import stage

    a, b = two_slides
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "a.tif").write_bytes(a.read_bytes()[:5000])  # truncated: fails before any file is written
    real, calls = stage._merge_status, []

    def failed_row_fails(path, results):
        results = list(results)
        calls.append([(r.slide, r.status) for r in results])
        if len(calls) == 1:
            raise OutputError(f"{path}: cannot write this file (No space left on device: the disk is full). Fix: x")
        return real(path, results)

    monkeypatch.setattr(stage, "_merge_status", failed_row_fails)
    out = tmp_path / "hm"
    run = make_heatmaps([broken / "a.tif", b], checkpoint_factory(), out, HeatmapConfig(**FAST))
    assert {r.slide: r.status for r in run.results} == {"a": "failed", "b": "ok"}
    assert calls[0] == [("a", "failed")] and calls[-1] == [("a", "failed"), ("b", "ok")]
    assert {k: r["status"] for k, r in _rows(out / "heatmap_status.csv").items()} == {"a": "failed", "b": "ok"}
    assert _files(out, "b")
