"""``wsi-milssl run`` after the slides moved to another folder with their modification times (``mv``, ``cp -a``,
``rsync -a``: a cohort moved to another disk) and the pipeline pointed at them: slides, labels and annotations are
the same files (same name, size and time or content), so nothing is tiled, trained or predicted again; a slide
copied without its time is cut again (and, by the stamps' chain, everything after tile runs again)."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

from tinypipeline import LISTED_COHORT
from wsi_milssl.config import SynthConfig
from wsi_milssl.pipeline import load_pipeline, run_pipeline
from wsi_milssl.synth import generate_slides

PIPELINE = """
[pipeline]
name = "slides-moved"
""" + LISTED_COHORT + """[train]
epochs = 1
batch_size = 32
mu_ramp_epochs = 1
num_workers = 0
plots = false
[heatmap]
num_workers = 0
thumbnail_px = 64
[evaluate]
thumbnail_px = 64
"""


def _cohort(root: Path, labels: dict[str, str], *, absolute: bool) -> None:
    """Slide lists (paths relative to them, or absolute as `prepare` writes them) and label files of the slides
    in ``root/slides``."""
    for set_name, stems in (("train", ["synth_000", "synth_001", "synth_002"]), ("test", ["synth_003"])):
        paths = "".join(f"{(root if absolute else Path()) / 'slides' / stem}.tif\n" for stem in stems)
        (root / f"{set_name}_slides.csv").write_text("path\n" + paths)
        (root / f"{set_name}_labels.csv").write_text("slide,label\n" + "".join(f"{s},{labels[s]}\n" for s in stems))


def _mtimes(folder: Path) -> dict[Path, int]:
    return {p.relative_to(folder): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_slides_moved_with_their_times_are_not_tiled_trained_or_predicted_again(tmp_path):
    first, moved = tmp_path / "disk1" / "cohort", tmp_path / "disk2" / "cohort"
    generate_slides(SynthConfig(n_slides=4, seed=0, width_px=2048, height_px=2048), first / "slides")
    with open(first / "slides" / "labels.csv", newline="") as fh:
        labels = {row["slide"]: row["label"] for row in csv.DictReader(fh)}
    out = tmp_path / "out"

    def run(root: Path, absolute: bool = False, **kwargs):
        _cohort(root, labels, absolute=absolute)
        (tmp_path / "p.toml").write_text(PIPELINE.format(root=root))
        return run_pipeline(load_pipeline(tmp_path / "p.toml", out_dir=out), **kwargs)

    assert [o.status for o in run(first)] == ["ran"] * 5
    before = _mtimes(out)
    moved.parent.mkdir()
    first.rename(moved)  # `mv`: the files keep their modification times
    outcomes = run(moved)
    assert [(o.stage, o.status) for o in outcomes] == [
        (s, "skipped") for s in ("tile", "label", "train", "heatmap", "evaluate")]
    after = _mtimes(out)
    assert [p for p in before if after[p] != before[p]] == [Path("resolved_pipeline.toml")]  # it names them now

    # moved back, with lists of absolute paths (a cohort prepared again where it is now): tile runs and keeps
    # the stores (same slide files), label runs, training keeps its run and heatmap its maps
    before = _mtimes(out)
    moved.rename(first)
    outcomes = run(first, absolute=True)
    assert [(o.stage, o.status) for o in outcomes] == [
        (s, "ran") for s in ("tile", "label", "train", "heatmap", "evaluate")]
    lists = [first / f"{set_name}_slides.csv" for set_name in ("train", "test")]
    assert outcomes[0].reason == f"input changed: {lists[0]}, {lists[1]}"  # the slides are not listed as new
    after = _mtimes(out)
    assert [p for p in before if p.suffix in (".pt", ".npy") and after[p] != before[p]] == []
    assert not list(out.glob("model.replaced-*"))
    assert "(1 kept)" in outcomes[3].summary
    moved = first

    # a slide copied without its modification time is another file: cut again
    slide = moved / "slides" / "synth_001.tif"
    shutil.copyfile(slide, slide.with_suffix(".copy"))
    slide.with_suffix(".copy").replace(slide)
    outcomes = run(moved, absolute=True, until="tile")
    assert [(o.stage, o.status, o.reason) for o in outcomes] == [("tile", "ran", f"input changed: {slide}")]
    changed = _mtimes(out)
    assert [p.name for p in before if p.parent.name == "train" and p.suffix == ".h5"
            and changed[p] != after[p]] == ["synth_001.h5"]
