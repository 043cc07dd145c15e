"""pipelines/camelyon16.toml: settings that the CAMELYON16 protocol needs."""

from __future__ import annotations

from pathlib import Path

from wsi_milssl.config import HeatmapConfig, config_from_mapping, load_toml

ROOT = Path(__file__).resolve().parents[2]


def test_camelyon16_detection_threshold_keeps_the_froc_curve_whole():
    """FROC averages sensitivities up to 8 FP/slide; a threshold of 0.5 cut the curve short."""
    raw = load_toml(ROOT / "pipelines" / "camelyon16.toml")
    config = config_from_mapping(HeatmapConfig, raw["heatmap"])
    assert config.detection_threshold <= HeatmapConfig().detection_threshold <= 0.1


# ------------------------------------------------------------------------------------------------
# Acceptance (issue 15): a CAMELYON16-shaped folder of generated slides -> prepare -> run -> report,
# with no hand edit in between.

#: The stage settings of the run: pipelines/camelyon16.toml's tables at the scale of a test.
TINY_STAGES = """
[pipeline]
name = "ignored"
[data]
val_fraction = 0.34
[tile]
magnification = 10.0
patch_size_px = 32
entropy_threshold_bits = 4.0
min_tissue = 0.5
[train]
mode = "images"
model = "resnet18"
epochs = 2
batch_size = 32
mu = 0.2
mu_ramp_epochs = 1
num_workers = 0
[heatmap]
num_workers = 0
thumbnail_px = 256
detection_threshold = 0.05
[evaluate]
thumbnail_px = 128
"""


def _camelyon16_like(root: Path, work: Path) -> dict[str, int]:
    """Generated slides laid out as CAMELYON16 ships them: training/{normal,tumor}/ with names in
    mixed case, lesion_annotations/Tumor_NNN.xml (another case than the slide), testing/images/ and a
    header-less testing/reference.csv. Returns {test stem: label}."""
    import shutil

    from wsi_milssl.config import SynthConfig
    from wsi_milssl.synth import generate_slides

    train = generate_slides(SynthConfig(n_slides=4, seed=0, width_px=2048, height_px=2048), work / "train")
    test = generate_slides(SynthConfig(n_slides=2, seed=1000, width_px=2048, height_px=2048), work / "test")
    counts = {0: 0, 1: 0}
    for s in train:
        counts[s.label] += 1
        k = counts[s.label]
        if s.label:
            stem = f"tumor_{k:03d}" if k % 2 else f"Tumor_{k:03d}"
            (root / "training" / "tumor").mkdir(parents=True, exist_ok=True)
            shutil.copy(s.slide_path, root / "training" / "tumor" / f"{stem}.tif")
            (root / "training" / "lesion_annotations").mkdir(parents=True, exist_ok=True)
            shutil.copy(s.annotation_path, root / "training" / "lesion_annotations" / f"Tumor_{k:03d}.xml")
        else:
            stem = f"normal_{k:03d}" if k % 2 else f"Normal_{k:03d}"
            (root / "training" / "normal").mkdir(parents=True, exist_ok=True)
            shutil.copy(s.slide_path, root / "training" / "normal" / f"{stem}.tif")
    reference, labels = [], {}
    (root / "testing" / "images").mkdir(parents=True)
    (root / "testing" / "lesion_annotations").mkdir(parents=True)
    for k, s in enumerate(test, start=1):
        shutil.copy(s.slide_path, root / "testing" / "images" / f"test_{k:03d}.tif")
        if s.label:
            shutil.copy(s.annotation_path, root / "testing" / "lesion_annotations" / f"Test_{k:03d}.xml")
        reference.append(f"Test_{k:03d},Tumor,Macro,Yes" if s.label else f"Test_{k:03d},Normal,,")
        labels[f"test_{k:03d}"] = s.label
    (root / "testing" / "reference.csv").write_text("\r\n".join(reference) + "\r\n")
    return labels


def test_camelyon16_shaped_folder_to_report_with_no_hand_edits(tmp_path, capsys):
    import json

    from wsi_milssl.cli import main

    root = tmp_path / "CAMELYON16"
    test_labels = _camelyon16_like(root, tmp_path / "generated")
    assert sorted(test_labels.values()) == [0, 1]
    template = tmp_path / "tiny.toml"
    template.write_text(TINY_STAGES)
    out = tmp_path / "c16"
    assert main(["prepare", "camelyon16", str(root), "--out", str(out), "--template", str(template)]) == 0
    assert main(["run", str(out / "pipeline.toml")]) == 0, capsys.readouterr().err
    run = out / "run"
    metrics = json.loads((run / "evaluation" / "metrics.json").read_text())
    assert metrics["n_slides"] == 2 and metrics["n_tumor_slides"] == 1 and metrics["n_lesions"] >= 1
    assert (run / "evaluation" / "report.html").is_file()
    for stem in test_labels:
        assert (run / "heatmaps" / "test" / f"{stem}_detections.csv").is_file()
        assert (run / "heatmaps" / "test" / f"{stem}_probs.ome.tif").is_file()


def test_readme_recipe_commands_parse():
    """The README's CAMELYON16 recipe uses commands and options that exist."""
    import re
    import shlex

    from wsi_milssl.cli import build_parser

    text = (ROOT / "README.md").read_text()
    section = text.split("## CAMELYON16 from download to report", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = [line for line in block.splitlines() if line.startswith("wsi-milssl ")]
    assert [c.split()[1] for c in commands] == ["prepare", "run"]
    for command in commands:
        words = shlex.split(command)[1:]
        build_parser(words[0]).parse_args(words)
    assert "| train, the paper's grid (16 runs x 50 epochs = 800 epochs) |" in section and "computed from" in section
