"""``evaluate --froc-mpp``: the µm/px at which the FROC's 75 µm margin and 275 µm ITC limit are measured.

The CAMELYON16 script (Evaluation_FROC.py) converts both at 0.243 µm/px for every slide; evaluate uses each
slide's own µm/px unless ``--froc-mpp`` is given. A reviewer's case, checked against the challenge's
script: slides written at 0.226 µm/px (as CAMELYON16's Utrecht slides), a tumour slide with two annotated
rectangles (level-0 px):

- R0, 768 x 128 at (640, 1280): at 0.226 µm/px an isolated tumour cell region (its grown major axis is
  under 275 µm = 38.0 level-5 px); at 0.243 (275 µm = 35.4 px) a lesion.
- R1, 1600 x 1600 at (3200, 3200): a lesion at both. Its last tumour column at level 5 is 149; the
  detection at x = 4933 is on column 154, 5 px away: inside the margin at 0.226 (37.5 µm = 5.19 px),
  outside at 0.243 (4.82 px).

Detections: 0.9 on R0, 0.8 beside R1, 0.3 elsewhere; 0.7 and 0.6 on the normal slide.
Own µm/px: one lesion (R1) hit at 0.8, 0.9 on the ITC ignored, FPs 0.7, 0.6, 0.3: (0, 1) at t=0.8,
FROC 1. At 0.243: two lesions, R0 hit at 0.9, R1 missed, FPs 0.8, 0.7, 0.6, 0.3: sensitivity 1/2 from
t=0.9 on, FROC 0.5 (what the challenge's script gives on these files).
"""

from __future__ import annotations

import json

import pytest

from wsi_milssl.cli import main
from wsi_milssl.config import EvaluateConfig, SynthConfig
from wsi_milssl.errors import ConfigError
from wsi_milssl.synth import generate_slides


def _rectangle(x0: int, y0: int, x1: int, y1: int, k: int) -> str:
    pts = [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]
    coords = "".join(f'<Coordinate Order="{i}" X="{x}" Y="{y}" />' for i, (x, y) in enumerate(pts))
    return (f'<Annotation Name="A{k}" Type="Polygon" PartOfGroup="_0"><Coordinates>{coords}</Coordinates>'
            "</Annotation>")


@pytest.fixture(scope="module")
def utrecht_case(tmp_path_factory):
    """(folder with slides/ at 0.226 µm/px, ann/, pred/ (plain CAMELYON16 CSVs) and labels.csv)."""
    root = tmp_path_factory.mktemp("froc_mpp")
    generate_slides(SynthConfig(n_slides=2, seed=0, width_px=6144, height_px=6144, mpp=0.226), root / "slides")
    labels = (root / "slides" / "labels.csv").read_text()
    assert "synth_000,1" in labels and "synth_001,0" in labels
    (root / "labels.csv").write_text(labels)
    (root / "ann").mkdir()
    (root / "ann" / "synth_000.xml").write_text(
        '<?xml version="1.0"?><ASAP_Annotations><Annotations>' + _rectangle(640, 1280, 1408, 1408, 0)
        + _rectangle(3200, 3200, 4800, 4800, 1) + "</Annotations></ASAP_Annotations>")
    (root / "pred").mkdir()
    (root / "pred" / "synth_000.csv").write_text("0.9,1000,1300\n0.8,4933,4000\n0.3,6000,6000\n")
    (root / "pred" / "synth_001.csv").write_text("0.7,100,100\n0.6,200,200\n")
    return root


def _evaluate(root, out, *extra) -> dict:
    rc = main(["evaluate", "--predictions", str(root / "pred"), "--annotations", str(root / "ann"),
               "--slides", str(root / "slides"), "--labels", str(root / "labels.csv"), "--out", str(out), *extra])
    assert rc == 0
    return json.loads((out / "metrics.json").read_text())


def test_froc_mpp_gives_the_challenge_scripts_number(utrecht_case, tmp_path):
    own = _evaluate(utrecht_case, tmp_path / "own")
    assert (own["n_lesions"], own["n_itc"], own["froc"]) == (1, 1, 1.0)
    c16 = _evaluate(utrecht_case, tmp_path / "c16", "--froc-mpp", "0.243")
    assert (c16["n_lesions"], c16["n_itc"], c16["froc"]) == (2, 0, 0.5)
    # the detections and annotations stay where they are: the slide is still evaluated at its own 0.226
    rows = (tmp_path / "c16" / "per_slide.csv").read_text().splitlines()
    assert rows[1].startswith("synth_000,1,") and rows[1].endswith(",0.226,0")  # mpp, then lesion_excluded
    outcomes = (tmp_path / "c16" / "detection_outcomes.csv").read_text().splitlines()
    assert outcomes[1:3] == ["synth_000,0.9,1000.0,1300.0,tp,1", "synth_000,0.8,4933.0,4000.0,fp,0"]


def test_froc_mpp_is_accepted_for_a_heatmap_folder(evaluated, synth_dir, annotations_dir, predictions, tmp_path):
    """A heatmap folder's sidecars record the µm/px its slides were predicted at (0.25 here), and
    --slide-mpp 0.243 is refused there; --froc-mpp 0.243 changes only the margin and ITC limit (the
    fixture's lesion and ITC stay what they are at 0.25, so the FROC is the same)."""
    from wsi_milssl.evaluation import evaluate_predictions

    pred_dir, _ = predictions
    result = evaluate_predictions(pred_dir, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "out",
                                  annotations_dir=annotations_dir, slides=synth_dir,
                                  config=EvaluateConfig(froc_mpp=0.243))
    assert result.metrics["froc"] == pytest.approx(evaluated[0].metrics["froc"], abs=1e-12)
    assert result.metrics["n_lesions"] == 1 and result.metrics["n_itc"] == 1
    tumour = next(r for r in result.slides if r.label == 1)
    assert tumour.mpp == pytest.approx(0.25) and tumour.match.mask.mpp == pytest.approx(0.243)


def test_froc_mpp_range(capsys, tmp_path):
    for bad in (0.0, -1.0, float("nan"), 1000.0):
        with pytest.raises(ConfigError, match="froc_mpp"):
            EvaluateConfig(froc_mpp=bad)
    rc = main(["evaluate", "--predictions", str(tmp_path), "--annotations", str(tmp_path), "--slides",
               str(tmp_path), "--labels", str(tmp_path / "l.csv"), "--out", str(tmp_path / "o"), "--froc-mpp", "0"])
    assert rc == 2 and "--froc-mpp" in capsys.readouterr().err


def test_froc_mpp_needs_no_slide_mpp(utrecht_case, tmp_path, capsys):
    """The tumour slide's file records no µm/px: without --froc-mpp evaluate needs one (--slide-mpp) to measure
    the margin and ITC limit; with --froc-mpp they are measured at it and the slide's own was still asked for
    (review AJ). The lesion mask needs only the slide's level-0 size: the challenge script's number."""
    import shutil

    import numpy as np

    from wsi_milssl.synth.pyramid import write_pyramidal_tiff

    root = tmp_path / "case"
    shutil.copytree(utrecht_case, root, ignore=shutil.ignore_patterns("synth_000.tif"))
    write_pyramidal_tiff(root / "slides" / "synth_000.tif", lambda x0, y0, x1, y1: np.full(
        (y1 - y0, x1 - x0, 3), 200, np.uint8), width=6144, height=6144, mpp=None)
    rc = main(["evaluate", "--predictions", str(root / "pred"), "--annotations", str(root / "ann"), "--slides",
               str(root / "slides"), "--labels", str(root / "labels.csv"), "--out", str(tmp_path / "own")])
    assert rc == 1 and "--slide-mpp" in capsys.readouterr().err
    c16 = _evaluate(root, tmp_path / "c16", "--froc-mpp", "0.243")
    assert (c16["n_lesions"], c16["n_itc"], c16["froc"], c16["froc_protocol"]) == (2, 0, 0.5, "CAMELYON16")
    rows = (tmp_path / "c16" / "per_slide.csv").read_text().splitlines()
    assert rows[1].startswith("synth_000,1,") and rows[1].endswith(",,0")  # no µm/px to report


def test_froc_mpp_accepts_a_slide_whose_objective_power_gives_no_resolution(tmp_path, monkeypatch):
    """Review EU, C2: with the FROC measured at --froc-mpp a slide that records no µm/px was accepted, but one whose
    objective power gives no microscope's resolution (an Aperio "AppMag = 400000000") was refused."""
    import numpy as np
    import openslide

    from wsi_milssl.errors import MissingResolutionError
    from wsi_milssl.evaluation.stage import _slide_geometry
    from wsi_milssl.slide import reader
    from wsi_milssl.synth.pyramid import write_pyramidal_tiff

    path = tmp_path / "s.tif"
    write_pyramidal_tiff(path, lambda x0, y0, x1, y1: np.full((y1 - y0, x1 - x0, 3), 200, np.uint8), width=1024,
                         height=768, mpp=None)
    real = reader._float_property
    monkeypatch.setattr(reader, "_float_property", lambda props, key: 4e8 if key ==
                        openslide.PROPERTY_NAME_OBJECTIVE_POWER else real(props, key))
    assert _slide_geometry("s", path, None, need_mpp=False) == ((1024, 768), None)
    with pytest.raises(MissingResolutionError, match="its objective power 4e\\+08x gives"):
        _slide_geometry("s", path, None, need_mpp=True)
