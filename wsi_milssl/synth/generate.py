"""``wsi-milssl synth``: write synthetic slides, their ASAP XML annotations and ``labels.csv``.

Output folder::

    synth_000.tif   pyramidal tiled JPEG TIFF, MPP in the resolution tags
    synth_000.xml   ASAP XML beside each tumour slide (groups _0/_1 tumour, _2 holes)
    labels.csv      slide,label (1 = tumour)
    manifest.json   per-slide lesions (kind, area in µm²) and the settings used

The same seed gives byte-identical output.
"""

from __future__ import annotations

import csv
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from wsi_milssl.annotations.asap import PolygonAnnotation, write_asap_xml
from wsi_milssl.atomic import atomic_open, atomic_write_text
from wsi_milssl.config import SynthConfig, config_to_dict
from wsi_milssl.events import ProgressCallback, ProgressEvent, emit
from wsi_milssl.locks import folder_lock
from wsi_milssl.synth.layout import Lesion, SlideLayout, make_layout
from wsi_milssl.synth.pyramid import write_pyramidal_tiff
from wsi_milssl.synth.render import make_textures, render_block

__all__ = ["SynthSlide", "generate_slides", "write_slide", "lesion_annotations", "tumour_flags"]


@dataclass(frozen=True)
class SynthSlide:
    """One generated slide: its files and truth."""

    stem: str
    slide_path: Path
    annotation_path: Path | None
    label: int
    lesions: tuple[Lesion, ...]


def lesion_annotations(lesions: list[Lesion]) -> list[PolygonAnnotation]:
    """CAMELYON16-style annotations: obvious lesions in ``_0``, subtle ones in ``_1``, holes in ``_2``."""
    anns: list[PolygonAnnotation] = []
    for lesion in lesions:
        group = "_0" if lesion.kind == "macro" else "_1"
        anns.append(PolygonAnnotation(f"Annotation {len(anns)}", group, lesion.exterior_lv0, "#F4FA58"))
    for lesion in lesions:
        for hole in lesion.holes_lv0:
            anns.append(PolygonAnnotation(f"Annotation {len(anns)}", "_2", hole, "#64FE2E"))
    return anns


def write_slide(
    path: str | os.PathLike,
    layout: SlideLayout,
    *,
    seed: tuple[int, ...],
    config: SynthConfig,
    write_mpp: bool = True,
    progress: ProgressCallback | None = None,
) -> Path:
    """Render ``layout`` into a pyramidal TIFF at ``path``."""
    rng = np.random.default_rng((*seed, 1))
    textures = make_textures(rng, layout)
    done = [0]

    def render(x0: int, y0: int, x1: int, y1: int) -> np.ndarray:
        return render_block(layout, textures, x0, y0, x1, y1, noise_seed=(*seed, 2, y0, x0))

    def on_rows(n: int) -> None:
        done[0] += n
        emit(progress, ProgressEvent("synth-rows", done[0], layout.height_px, unit="row", item=Path(path).stem))

    return write_pyramidal_tiff(
        path, render, width=layout.width_px, height=layout.height_px,
        mpp=layout.mpp if write_mpp else None, tile_px=config.tile_size_px,
        jpeg_quality=config.jpeg_quality, level_factor=config.level_downsample,
        min_level_size_px=config.min_level_size_px, on_rows=on_rows,
    )


def tumour_flags(config: SynthConfig) -> np.ndarray:
    """Which of ``config``'s slides (synth_000, synth_001, ...) will hold tumour: bool (n_slides,), fixed by
    the seed (a pipeline reads the split of generated slides from it before they exist)."""
    n_tumor = int(round(config.n_slides * config.tumor_slide_fraction))
    flags = np.zeros(config.n_slides, bool)
    flags[:n_tumor] = True
    return np.random.default_rng((config.seed, 0)).permutation(flags)


def generate_slides(
    config: SynthConfig, out_dir: str | os.PathLike, *, progress: ProgressCallback | None = None
) -> list[SynthSlide]:
    """Generate ``config.n_slides`` slides into ``out_dir`` and return what was written. The files of an
    earlier run in ``out_dir`` (``synth_NNN.tif`` / ``.xml``, ``labels.csv``, ``manifest.json``) are removed
    first (the slides its manifest lists, and annotations of the names this run writes); other files are
    left alone.

    Holds the lock of ``out_dir`` while writing (a second run into it raises FolderLockedError).
    """
    with folder_lock(out_dir, named_by="OUT_DIR"):
        return _generate_slides(config, Path(out_dir), progress=progress)


def _clear_previous_run(out: Path, n_slides: int) -> None:
    """Remove what an earlier run wrote into ``out`` and this run would not overwrite: the slides and
    annotations its ``manifest.json`` lists (slides beyond the new count must go) and the annotation of
    every slide name this run writes (a slide made normal must not keep its old tumour XML); then the
    old manifest and labels, so an interrupted run never leaves a labels.csv that lists another run's
    slides. No other file is touched."""
    own = {f"synth_{i:03d}" for i in range(n_slides)}
    earlier: set[str] = set()
    try:
        listed = json.loads((out / "manifest.json").read_text(encoding="utf-8")).get("slides", [])
        earlier = {s["slide"] for s in listed if isinstance(s, dict) and isinstance(s.get("slide"), str)}
    except (OSError, ValueError, AttributeError, TypeError):
        pass  # no (readable) manifest: only this run's own names
    for stem in own | {s for s in earlier if re.fullmatch(r"synth_\d{3,}", s)}:  # names synth writes, no paths
        (out / f"{stem}.xml").unlink(missing_ok=True)
        if stem not in own:  # this run overwrites its own slides
            (out / f"{stem}.tif").unlink(missing_ok=True)
    for name in ("manifest.json", "labels.csv"):
        (out / name).unlink(missing_ok=True)


def _generate_slides(config: SynthConfig, out: Path, *, progress: ProgressCallback | None) -> list[SynthSlide]:
    _clear_previous_run(out, config.n_slides)
    flags = tumour_flags(config)
    slides: list[SynthSlide] = []
    um2_per_px2 = config.mpp**2
    emit(progress, ProgressEvent("synth", 0, config.n_slides, unit="slide"))
    for index in range(config.n_slides):
        stem = f"synth_{index:03d}"
        seed = (config.seed, 1, index)
        layout = make_layout(
            np.random.default_rng(seed), width_px=config.width_px, height_px=config.height_px,
            mpp=config.mpp, is_tumor=bool(flags[index]),
        )
        slide_path = write_slide(out / f"{stem}.tif", layout, seed=seed, config=config, progress=progress)
        ann_path = None
        if layout.is_tumor:
            ann_path = write_asap_xml(lesion_annotations(layout.lesions), out / f"{stem}.xml",
                                      groups=["_0", "_1", "_2"])
        slides.append(SynthSlide(stem, slide_path, ann_path, int(layout.is_tumor), tuple(layout.lesions)))
        emit(progress, ProgressEvent("synth", index + 1, config.n_slides, unit="slide", item=stem))

    with atomic_open(out / "labels.csv", "w") as fh:
        writer = csv.writer(fh)
        writer.writerow(["slide", "label"])
        for s in slides:
            writer.writerow([s.stem, s.label])

    manifest = {
        "config": config_to_dict(config),
        "slides": [
            {
                "slide": s.stem,
                "label": s.label,
                "lesions": [
                    {"kind": l.kind, "subtlety": round(l.subtlety, 3),
                     "area_um2": round(_polygon_area(l.exterior_lv0) * um2_per_px2
                                       - sum(_polygon_area(h) for h in l.holes_lv0) * um2_per_px2, 1)}
                    for l in s.lesions
                ],
            }
            for s in slides
        ],
    }
    atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    return slides


def _polygon_area(coords: np.ndarray) -> float:
    x, y = coords[:, 0], coords[:, 1]
    return float(abs(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))) / 2)
