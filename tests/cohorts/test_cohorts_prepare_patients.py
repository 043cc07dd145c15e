"""``prepare folder`` with a labels file that names each slide's patient (CAMELYON17: five lymph nodes per
patient): the held-out test set keeps each patient whole (review AO, finding 2)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from prepare_trees import distinct_copy

from wsi_milssl.cli import main
from wsi_milssl.cohorts import prepare_folder, read_label_groups
from wsi_milssl.errors import LabelsError

#: patient -> the labels of its three slides (nodes)
PATIENTS = {"p0": (0, 0, 1), "p1": (1, 1, 0), "p2": (0, 1, 0), "p3": (1, 0, 0), "p4": (0, 0, 0), "p5": (0, 0, 0)}


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="") as fh:
        return list(csv.reader(fh))


def _cohort(root: Path, synth_slides: dict[str, Path], column: str = "patient") -> Path:
    """patient_<p>_node_<n>.tif (real generated slides, each its own bytes), the tumour ones annotated, and
    stages.csv 'slide,<column>,label'."""
    lines = [f"slide,{column},label"]
    for patient, labels in PATIENTS.items():
        for node, label in enumerate(labels):
            name = f"patient_{patient}_node_{node}"
            source = synth_slides["tumor" if label else "normal"]
            distinct_copy(source, root / f"{name}.tif")
            if label:
                (root / f"{name}.xml").write_bytes(source.with_suffix(".xml").read_bytes())
            lines.append(f"{name},{patient.upper() if node == 1 else patient},{label}")  # patients in any case
    (root / "stages.csv").write_text("\n".join(lines) + "\n")
    return root / "stages.csv"


def _patient_of(stem: str) -> str:
    return stem.split("_")[1]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_patients_slides_stay_in_one_set(tmp_path, synth_slides, seed):
    """Without a word, the split put one node of a patient into the test set and its others into training."""
    labels = _cohort(tmp_path / "c17", synth_slides)
    result = prepare_folder(tmp_path / "c17", labels, tmp_path / f"out{seed}", test_fraction=0.34, seed=seed)
    train, test = result.sets["train"], result.sets["test"]
    train_patients = {_patient_of(s) for s in train.slides}
    test_patients = {_patient_of(s) for s in test.slides}
    assert not train_patients & test_patients
    assert train_patients | test_patients == set(PATIENTS)
    assert len(train.slides) + len(test.slides) == 18
    assert {0, 1} <= set(test.labels.values()) and {0, 1} <= set(train.labels.values())
    # the labels files written name each slide's patient (for a later split of the training slides)
    rows = _rows(test.labels_csv)
    assert rows[0] == ["slide", "label", "patient"]
    assert all(_patient_of(slide).casefold() == patient.casefold() for slide, _, patient in rows[1:])


@pytest.mark.parametrize("column", ["Patient_ID", "Case_Submitter_ID", "CASE_ID"])
def test_the_patient_column_is_found_by_any_of_its_names(tmp_path, synth_slides, column):
    labels = _cohort(tmp_path / "c17", synth_slides, column)
    assert read_label_groups(labels)[0] == column
    result = prepare_folder(tmp_path / "c17", labels, tmp_path / "out", test_fraction=0.34)
    train, test = result.sets["train"].slides, result.sets["test"].slides
    assert not {_patient_of(s) for s in train} & {_patient_of(s) for s in test}


def test_a_name_column_is_not_a_patient_column(tmp_path):
    """case_id is also a slide-name column: as the only name column it names the slides, not patients."""
    (tmp_path / "a.csv").write_text("case_id,label\nx1,1\nx2,0\n")
    assert read_label_groups(tmp_path / "a.csv") is None
    (tmp_path / "b.csv").write_text("x1,1\nx2,0\n")
    assert read_label_groups(tmp_path / "b.csv") is None
    (tmp_path / "c.csv").write_text("slide,case_id,label\nx1,c1,1\nx2,,0\n")
    assert read_label_groups(tmp_path / "c.csv") == ("case_id", {"x1": "c1"})


def test_patients_that_cannot_be_split_are_one_error(tmp_path, synth_slides, capsys):
    """All tumour slides belong to one patient: no split keeps patients whole and has tumour slides in both."""
    root = tmp_path / "c"
    lines = ["slide,patient,label"]
    for k, (patient, label) in enumerate([("a", 1), ("a", 1), ("a", 0), ("b", 0), ("c", 0), ("d", 0)]):
        distinct_copy(synth_slides["tumor" if label else "normal"], root / f"s{k}.tif")
        if label:
            (root / f"s{k}.xml").write_bytes(synth_slides["tumor"].with_suffix(".xml").read_bytes())
        lines.append(f"s{k},{patient},{label}")
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(LabelsError, match=r"labels.csv: cannot keep each patient's slides in one set and have tumour "
                                          r"slides in both the training and the test set: its column 'patient'"):
        prepare_folder(root, root / "labels.csv", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_prepare_help_describes_the_patient_column(capsys):
    with pytest.raises(SystemExit):
        main(["prepare", "folder", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "patient, patient_id, case_id or case_submitter_id" in text and "whole patients" in text
    assert "--patient-column COLUMN" in text
