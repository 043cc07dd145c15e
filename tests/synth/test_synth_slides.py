"""Synthetic slides: pyramidal TIFFs OpenSlide opens, ASAP XML inside the slide, determinism."""

from __future__ import annotations

import csv
import hashlib
import json

import defusedxml.ElementTree as DET
import numpy as np
import pytest

from wsi_milssl.config import SynthConfig
from wsi_milssl.errors import ConfigError
from wsi_milssl.slide import open_slide
from wsi_milssl.synth import generate_slides


def test_slides_open_with_levels_and_mpp(synth_dir):
    for name in ("synth_000.tif", "synth_001.tif"):
        with open_slide(synth_dir / name) as slide:
            assert slide.dimensions == (4096, 4096)
            assert slide.level_count >= 3
            assert slide.level_downsamples[:3] == (1.0, 2.0, 4.0)
            assert slide.mpp == pytest.approx(0.25)
            assert slide.mpp_source == "metadata"


def test_labels_csv_and_annotations(synth_dir):
    with open(synth_dir / "labels.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["slide"] for r in rows] == ["synth_000", "synth_001"]
    assert sorted(r["label"] for r in rows) == ["0", "1"]
    for row in rows:
        xml = synth_dir / f"{row['slide']}.xml"
        assert xml.exists() == (row["label"] == "1")


def test_asap_xml_layout_and_polygons_inside_slide(synth_slides):
    xml = synth_slides["tumor"].with_suffix(".xml")
    root = DET.parse(xml).getroot()
    assert root.tag == "ASAP_Annotations"
    annotations = root.find("Annotations").findall("Annotation")
    groups = [a.get("PartOfGroup") for a in annotations]
    assert groups.count("_0") == 1  # exactly one large obvious lesion
    assert set(groups) <= {"_0", "_1", "_2"}
    for ann in annotations:
        assert ann.get("Type") == "Polygon" and ann.get("Name") and ann.get("Color", "").startswith("#")
        coords = ann.find("Coordinates").findall("Coordinate")
        assert [int(c.get("Order")) for c in coords] == list(range(len(coords)))
        xy = np.array([[float(c.get("X")), float(c.get("Y"))] for c in coords])
        assert len(xy) >= 20
        assert (xy >= 0).all() and (xy[:, 0] < 4096).all() and (xy[:, 1] < 4096).all()
    group_names = [g.get("Name") for g in root.find("AnnotationGroups").findall("Group")]
    assert group_names == ["_0", "_1", "_2"]


def test_tumour_lesions_are_darker_structured_tissue(synth_slides):
    """The obvious lesion differs from surrounding tissue, and is tissue (not background)."""
    xml = synth_slides["tumor"].with_suffix(".xml")
    root = DET.parse(xml).getroot()
    macro = next(a for a in root.iter("Annotation") if a.get("PartOfGroup") == "_0")
    xy = np.array([[float(c.get("X")), float(c.get("Y"))] for c in macro.iter("Coordinate")])
    cx, cy = xy.mean(axis=0)
    with open_slide(synth_slides["tumor"]) as slide:
        patch = slide.read_region(int(cx) - 64, int(cy) - 64, 32, target_mpp=1.0)
    assert patch.mean() < 215  # stained tissue, not the ~240 white background


def test_same_seed_gives_identical_files_and_other_seed_differs(tmp_path):
    def digest(folder):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}

    cfg = dict(n_slides=2, width_px=2048, height_px=2048, tumor_slide_fraction=1.0)
    generate_slides(SynthConfig(seed=7, **cfg), tmp_path / "a")
    generate_slides(SynthConfig(seed=7, **cfg), tmp_path / "b")
    generate_slides(SynthConfig(seed=8, **cfg), tmp_path / "c")
    a, b, c = digest(tmp_path / "a"), digest(tmp_path / "b"), digest(tmp_path / "c")
    assert a == b
    assert a["synth_000.tif"] != c["synth_000.tif"]
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert all(s["label"] == 1 and s["lesions"] for s in manifest["slides"])


def test_no_temporary_files_left(synth_dir):
    leftovers = [p.name for p in synth_dir.iterdir() if p.name.startswith(".") or p.suffix == ".tmp"]
    assert leftovers == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_slides": 0}, r"SynthConfig\.n_slides must satisfy 1 <= value <= 100000; got 0"),
        ({"mpp": -1.0}, r"SynthConfig\.mpp must satisfy"),
        ({"tumor_slide_fraction": 1.5}, r"SynthConfig\.tumor_slide_fraction"),
        ({"level_downsample": 3}, r"SynthConfig\.level_downsample must be one of 2, 4; got 3"),
        ({"n_slides": True}, r"SynthConfig\.n_slides must be int; got True"),
    ],
)
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SynthConfig(**kwargs)
