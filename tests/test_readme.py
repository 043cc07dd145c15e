"""The README opens with the two commands CI and users run, and .ci/run runs the second verbatim."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_opens_with_demo_and_test_commands():
    demo, tests = _commands()
    assert demo.endswith("wsi-milssl demo demo_out") and "pip install -e ." in demo
    assert tests.endswith("pytest") and "pip install -e '.[test]'" in tests
    head = (ROOT / "README.md").read_text().split("```bash")[0]
    assert head.strip() == "# wsi-milssl"  # the commands come first


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _commands()[1] in ci


def test_the_readme_loop_names_the_detections_and_masks_as_the_challenge_script_reads_them(tmp_path):
    """Review CR: the challenge's Evaluation_FROC.py takes a slide for a tumour slide only by a CSV named
    Tumor*, with its mask as <CSV name>_Mask.tif; the README gave no command for it. Its loop runs here as written,
    on a prepare folder and a download laid out as the AWS bucket and GigaDB lay out their masks."""
    import subprocess

    text = (ROOT / "README.md").read_text()
    loop = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "Evaluation_FROC" not in b
                and "_Mask.tif" in b)
    c16, out = tmp_path / "CAMELYON16", tmp_path / "c16"
    (out / "cohort").mkdir(parents=True)
    (out / "cohort" / "test_labels.csv").write_text("slide,label\ntest_001,1\ntest_002,0\nTest_003,1\n")
    heatmaps = out / "run" / "heatmaps" / "test"
    heatmaps.mkdir(parents=True)
    for slide in ("test_001", "test_002", "Test_003"):
        (heatmaps / f"{slide}_detections.csv").write_text(f"0.9,10,20\n# {slide}\n")
    (c16 / "masks").mkdir(parents=True)
    (c16 / "masks" / "test_001_mask.tif").write_bytes(b"mask 1")
    (c16 / "testing" / "evaluation").mkdir(parents=True)
    (c16 / "testing" / "evaluation" / "Test_003_Mask.tif").write_bytes(b"mask 3")
    loop = loop.replace("C16=/data/CAMELYON16 C16OUT=/data/c16",
                        f"C16={shlex.quote(str(c16))} C16OUT={shlex.quote(str(out))}")
    assert str(c16) in loop
    subprocess.run(["bash", "-euo", "pipefail", "-c", loop], cwd=tmp_path, check=True)
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["Tumor_Test_003.csv", "Tumor_test_001.csv",
                                                                      "test_002.csv"]
    assert (tmp_path / "sub" / "test_002.csv").read_text().endswith("# test_002\n")
    assert (tmp_path / "masks" / "Tumor_test_001_Mask.tif").read_bytes() == b"mask 1"
    assert (tmp_path / "masks" / "Tumor_Test_003_Mask.tif").read_bytes() == b"mask 3"
    assert sorted(p.name for p in (tmp_path / "masks").iterdir()) == ["Tumor_Test_003_Mask.tif",
                                                                        "Tumor_test_001_Mask.tif"]
