"""Cohort folders for the prepare tests, made of the session's generated slides (tests/conftest.py).

Each slide name gets its own file content (a copy of a generated slide with its name appended after the
TIFF data, which readers ignore), as real slides differ; :func:`same_copy` makes a byte-identical copy."""

from __future__ import annotations

import shutil
from pathlib import Path


def distinct_copy(source: Path, target: Path) -> Path:
    """A copy of the slide ``source`` at ``target`` whose bytes differ from every other name's."""
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, target)
    with open(target, "ab") as fh:
        fh.write(target.name.encode())
    return target


def same_copy(source: Path, target: Path) -> Path:
    """A byte-identical copy of ``source`` at ``target`` (a separate file, not a link)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, target)
    return target


def gigadb_tree(root: Path, synth_slides: dict[str, Path]) -> Path:
    """CAMELYON16 as downloaded from GigaDB: training/normal, training/tumor, testing/images, loose lesion
    annotations (the generated tumour slide's ASAP XML) and testing/reference.csv; every slide distinct."""
    tumour, normal = synth_slides["tumor"], synth_slides["normal"]
    xml = tumour.with_suffix(".xml")
    for name, source, folder in (("Normal_001", normal, "training/normal"), ("Normal_002", normal, "training/normal"),
                                 ("Tumor_001", tumour, "training/tumor"), ("Tumor_002", tumour, "training/tumor"),
                                 ("Test_001", tumour, "testing/images"), ("Test_002", normal, "testing/images"),
                                 ("Test_003", normal, "testing/images")):
        distinct_copy(source, root / folder / f"{name}.tif")
    for name, folder in (("Tumor_001", "training"), ("Tumor_002", "training"), ("Test_001", "testing")):
        (root / folder / "lesion_annotations").mkdir(parents=True, exist_ok=True)
        shutil.copy(xml, root / folder / "lesion_annotations" / f"{name}.xml")
    (root / "testing" / "reference.csv").write_text("Test_001,Tumor,Macro,\nTest_002,Normal,,\nTest_003,Normal,,\n")
    return root
