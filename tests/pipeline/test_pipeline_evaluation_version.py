"""``run`` evaluates again where the evaluation is an earlier version's: one made before metrics.json recorded
the FROC's settings (froc_mpp, froc_protocol) kept its report calling the FROC "CAMELYON16" whatever the µm/px it
was measured at, and `run` said it was up to date, since the new settings at their defaults leave the stamp as it
was (review AJ). metrics.json's froc_protocol, which this version's evaluation writes from its settings, tells:
only the evaluate stage runs again (it is cheap), every other stage is skipped."""

from __future__ import annotations

import json

from tinypipeline import GENERATED_SLIDES
from wsi_milssl.pipeline import load_pipeline, run_pipeline
from wsi_milssl.pipeline.stamps import OUTPUT_IDS, _file_identity

PIPELINE = """
[pipeline]
name = "evaluation_version"
""" + GENERATED_SLIDES + """[train]
mode = "images"
model = "resnet18"
epochs = 1
batch_size = 32
mu = 0.2
mu_ramp_epochs = 1
num_workers = 0
plots = false
[heatmap]
num_workers = 0
thumbnail_px = 128
[evaluate]
thumbnail_px = 64
"""


def _written_by_the_stage(out, metrics_path, text: str) -> None:
    """``text`` into metrics.json as the evaluate stage of an earlier version wrote it: its stamp records the file
    as it is (else the file "changed outside the pipeline", as a hand-run evaluate's does)."""
    metrics_path.write_text(text)
    stamp_path = out / ".pipeline" / "evaluate.json"
    stamp = json.loads(stamp_path.read_text())
    stamp[OUTPUT_IDS]["evaluation/metrics.json"] = _file_identity(metrics_path, with_sha256=True)
    stamp_path.write_text(json.dumps(stamp))


def test_an_evaluation_of_an_earlier_version_runs_again_alone(tmp_path):
    toml = tmp_path / "p.toml"
    toml.write_text(PIPELINE)
    out = tmp_path / "out"

    def run() -> dict[str, tuple[str, str]]:
        return {o.stage: (o.status, o.reason) for o in run_pipeline(load_pipeline(toml, out_dir=out))}

    assert {s: status for s, (status, _) in run().items()} == dict.fromkeys(
        ("synth", "tile", "label", "train", "heatmap", "evaluate"), "ran")
    metrics_path = out / "evaluation" / "metrics.json"
    metrics = json.loads(metrics_path.read_text())
    assert metrics["froc_protocol"] == "75 µm margin, 275 µm ITC limit, at each slide's own µm/px"
    assert {s: status for s, (status, _) in run().items()} == dict.fromkeys(
        ("synth", "tile", "label", "train", "heatmap", "evaluate"), "skipped")

    # the evaluation as the code before 5d7262f wrote it (its stamp is this version's: the same settings)
    old = {k: v for k, v in metrics.items() if k not in ("margin_um", "itc_major_axis_um", "froc_mpp", "froc_protocol")}
    _written_by_the_stage(out, metrics_path, json.dumps(old))
    outcomes = run()
    assert {s: status for s, (status, _) in outcomes.items()} == {
        "synth": "skipped", "tile": "skipped", "label": "skipped", "train": "skipped", "heatmap": "skipped",
        "evaluate": "ran"}
    assert outcomes["evaluate"][1] == (f"output of an earlier version: {metrics_path} records no froc_protocol")
    assert json.loads(metrics_path.read_text())["froc_protocol"] == metrics["froc_protocol"]

    # one that called the FROC otherwise than this version does for these settings (before f91030f, "CAMELYON16"
    # whatever the annotation groups)
    _written_by_the_stage(out, metrics_path, json.dumps({**metrics, "froc_protocol": "CAMELYON16"}))
    outcomes = run()
    assert [s for s, (status, _) in outcomes.items() if status == "ran"] == ["evaluate"]
    assert outcomes["evaluate"][1] == (
        f"output of an earlier version: {metrics_path} records froc_protocol 'CAMELYON16', not \"75 µm margin, 275 µm "
        "ITC limit, at each slide's own µm/px\"")
    assert {status for status, _ in run().values()} == {"skipped"}

    # review DD: written by a hand-run `evaluate --out OUT/evaluation` with other FROC settings, it is said so, not
    # called an earlier version's
    metrics_path.write_text(json.dumps({**metrics, "froc_protocol": "100 µm margin, 275 µm ITC limit, at each "
                                                                    "slide's own µm/px"}))
    outcomes = run()
    assert outcomes["evaluate"] == ("ran", "output changed outside the pipeline: evaluation/metrics.json "
                                           "(evaluate run by hand?)")
