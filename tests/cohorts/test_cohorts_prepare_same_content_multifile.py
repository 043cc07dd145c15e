"""Multi-file slides (MIRAX ``.mrxs`` with its data folder, Hamamatsu ``.vms`` with its image files) are copies
only when their data files hold the same bytes too (review AQ, finding A): the ``.mrxs`` index is a small ini,
often the same bytes for every slide of a scanner, and the same-content check compared it alone, so different
slides left training as 'copies'."""

from __future__ import annotations

import shutil
from pathlib import Path

from prepare_trees import distinct_copy

from wsi_milssl.cohorts import prepare_folder

#: One MIRAX index for every slide (as a scanner writes it).
MRXS_INDEX = b"[GENERAL]\nSLIDE_VERSION=01.02\nSLIDE_NAME=slide\n"


def _data_file(source: Path, target: Path, tag: str) -> None:
    """``target``: the generated slide's bytes and ``tag`` (every tag of one length: the same size, other bytes)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(source.read_bytes() + tag.encode())


def _mirax(root: Path, stem: str, source: Path) -> None:
    """``<stem>.mrxs`` (the shared index) beside its data folder ``<stem>/`` (Slidedat.ini, Index.dat, Data0000.dat),
    whose files have the same sizes for every slide and bytes of their own."""
    (root / f"{stem}.mrxs").write_bytes(MRXS_INDEX)
    (root / stem).mkdir(parents=True)
    (root / stem / "Slidedat.ini").write_text(f"[GENERAL]\nSLIDE_ID={stem}\n")
    (root / stem / "Index.dat").write_bytes(b"VMSLIDE" + stem.encode())
    _data_file(source, root / stem / "Data0000.dat", stem)


def _vms(folder: Path, stem: str, source: Path, tag: str) -> None:
    """``<stem>.vms`` naming ``image.jpg`` and ``map.jpg`` beside it (the same index text for every slide)."""
    folder.mkdir(parents=True)
    (folder / f"{stem}.vms").write_text("[Virtual Microscope Specimen]\nNoLayers=1\nImageFile=image.jpg\n"
                                        "MapFile=map.jpg\n")
    _data_file(source, folder / "image.jpg", tag)
    (folder / "map.jpg").write_bytes(b"map")


def test_mirax_and_vms_slides_with_one_index_are_copies_only_when_their_data_is(tmp_path, synth_slides):
    root = tmp_path / "cohort"
    lines = ["slide,label"]
    for k in range(4):
        distinct_copy(synth_slides["tumor"], root / f"tum{k}.tif")
        (root / f"tum{k}.xml").write_bytes(synth_slides["tumor"].with_suffix(".xml").read_bytes())
        lines.append(f"tum{k},1")
    for k in range(4):
        _mirax(root, f"nor{k}", synth_slides["normal"])
        lines.append(f"nor{k},0")
    # nor4: a true copy of nor0 (index and data folder)
    shutil.copy(root / "nor0.mrxs", root / "nor4.mrxs")
    shutil.copytree(root / "nor0", root / "nor4")
    # vms5, vms6: the same index text, image files of the same size and other bytes
    _vms(root / "vms_a", "vms5", synth_slides["normal"], "a")
    _vms(root / "vms_b", "vms6", synth_slides["normal"], "b")
    # nor7: a MIRAX index without its data folder (a broken download): never called a copy of anything
    (root / "nor7.mrxs").write_bytes(MRXS_INDEX)
    lines += ["nor4,0", "vms5,0", "vms6,0", "nor7,0"]
    (root / "labels.csv").write_text("\n".join(lines) + "\n")

    result = prepare_folder(root, root / "labels.csv", tmp_path / "out", test_fraction=0.25)
    kept = {*result.sets["train"].slides, *result.sets["test"].slides}
    assert kept == {"tum0", "tum1", "tum2", "tum3", "nor0", "nor1", "nor2", "nor3", "vms5", "vms6", "nor7"}
    repeat = [n for n in result.notes if "same label are left out" in n]
    assert len(repeat) == 1 and "nor4 (the same file as nor0, kept)" in repeat[0]
