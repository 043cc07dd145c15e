"""The one slide-labels reader (issue 14 rows 2 and 16, issue 15 deliverable 1): every stage reads the
same file the same way."""

from __future__ import annotations

import pytest

from wsi_milssl.cohorts import SlideLabels, labels_for, read_labels, slide_stem
from wsi_milssl.errors import LabelsError
from wsi_milssl.evaluation import read_labels as evaluation_read_labels
from wsi_milssl.labeling import read_slide_labels
from wsi_milssl.mil.data import read_labels_csv

#: The labels readers of the label, train and evaluate stages.
STAGE_READERS = {"label": read_slide_labels, "train": read_labels_csv, "evaluate": evaluation_read_labels}


@pytest.fixture(params=sorted(STAGE_READERS))
def stage_reader(request):
    return STAGE_READERS[request.param]


@pytest.mark.parametrize("text, expected", [
    ("slide,label\nsynth_000,1\nsynth_001,0\n", {"synth_000": 1, "synth_001": 0}),
    ("synth_000,1\nsynth_001,0\n", {"synth_000": 1, "synth_001": 0}),  # no header
    ("label,comment,Slide\nTumour,x,a.TIF\nNEGATIVE,,b.svs\npositive,,c.ndpi\nnormal,,d.MRXS\n",
     {"a": 1, "b": 0, "c": 1, "d": 0}),
    ("bag_id,label\nslides/x.h5,1\nC:\\data\\y.zarr,0\n", {"x": 1, "y": 0}),
    ("Case_ID,Label\nP1,1\n", {"P1": 1}),
    # CAMELYON16 reference.csv as shipped: no header, Tumor/Normal, extra columns (some empty)
    ("Test_001,Tumor,Macro,Primary\nTest_002,Normal,,\nTest_003,Normal\n",
     {"Test_001": 1, "Test_002": 0, "Test_003": 0}),
    ("slide,label\n\n  a , 1 \n,\n", {"a": 1}),  # blank lines and cells are skipped, cells stripped
])
def test_every_stage_reads_the_accepted_layouts(stage_reader, tmp_path, text, expected):
    path = tmp_path / "labels.csv"
    path.write_text(text)
    assert dict(stage_reader(path)) == expected


@pytest.mark.parametrize("encoded", [
    b"\xef\xbb\xbfslide,label\r\nsynth_000,1\r\nsynth_001,0\r\n",  # Excel "CSV UTF-8": BOM and CRLF (row 16)
    b"\xef\xbb\xbfsynth_000,Tumor\r\nsynth_001,Normal\r\n",
    "slide,label\r\nsynth_000,1\r\nsynth_001,0\r\n".encode("utf-16"),  # Excel "Unicode text"
])
def test_bom_and_crlf_are_accepted_by_every_stage(stage_reader, tmp_path, encoded):
    path = tmp_path / "labels.csv"
    path.write_bytes(encoded)
    assert dict(stage_reader(path)) == {"synth_000": 1, "synth_001": 0}


def test_conflicting_duplicate_is_refused_by_every_stage(stage_reader, tmp_path):
    """Row 2: `train` used to take the last row silently (a tumour slide became a known negative)."""
    path = tmp_path / "labels.csv"
    path.write_text("slide,label\nsynth_000,1\nsynth_001,0\nSYNTH_000.tif,0\n")
    with pytest.raises(LabelsError, match=r"labels\.csv: lines 2 and 4 give slide 'SYNTH_000' different labels "
                                          r"\(1 and 0\).*Fix: keep one line per slide, with its true label"):
        stage_reader(path)


def test_train_stage_refuses_conflicting_labels(tmp_path):
    from wsi_milssl.cli.train import load_instances

    path = tmp_path / "labels.csv"
    path.write_text("slide,label\nsynth_000,1\nsynth_000,0\n")
    with pytest.raises(LabelsError, match="lines 2 and 3 give slide 'synth_000' different labels"):
        load_instances([tmp_path], mode="images", labels_path=path)


def test_identical_duplicate_is_accepted(tmp_path):
    path = tmp_path / "labels.csv"
    path.write_text("slide,label\nTest_001,Tumor\ntest_001.tif,1\n")
    labels = read_labels(path)
    assert dict(labels) == {"Test_001": 1} and labels.line("TEST_001") == 2


def test_names_match_case_insensitively_without_suffix(tmp_path):
    path = tmp_path / "reference.csv"
    path.write_text("Test_001,Tumor,Macro\nNormal_002.TIF,normal\n")
    labels = read_labels(path)
    assert isinstance(labels, SlideLabels) and labels.path == path
    assert labels["test_001"] == 1 and labels["TEST_001.svs"] == 1 and labels.get("normal_002") == 0
    assert "normal_002.h5" in labels and "Test_003" not in labels and labels.get("Test_003") is None
    assert list(labels) == ["Test_001", "Normal_002"]
    with pytest.raises(KeyError):
        labels["Test_003"]


def test_slide_stem():
    assert slide_stem("Tumor_001.tif") == "Tumor_001"
    assert slide_stem("a/b/Tumor_001.TIFF") == "Tumor_001"
    assert slide_stem("D:\\slides\\x.SVS") == "x"
    assert slide_stem("case.01") == "case.01"
    assert slide_stem("s.ndpi") == "s" and slide_stem("s.mrxs") == "s" and slide_stem("s.h5") == "s"
    assert slide_stem("s.zarr/") == "s"
    assert slide_stem(".tif") == ".tif"


def test_labels_for_lists_every_unmatched_name(tmp_path):
    path = tmp_path / "labels.csv"
    path.write_text("slide,label\nA,1\nB,0\n")
    labels = read_labels(path)
    assert labels_for(labels, ["a", "B.tif"]) == {"a": 1, "B.tif": 0}
    with pytest.raises(LabelsError, match=r"labels\.csv: no label for 2 slide\(s\): C, d\.svs \(names are matched "
                                          r"without folder, slide suffix and case\)\. Fix: add a 'slide,label' line"):
        labels_for(labels, ["a", "C", "d.svs"])
    assert labels_for({"x": 1}, ["X"]) == {"X": 1}  # a plain dict is matched the same way


def test_clam_s_label_words_and_trident_s_slide_column_are_read(tmp_path):
    """Review BP, C3: CLAM's example task labels slides tumor_tissue / normal_tissue, TRIDENT's slide lists name
    them in a 'wsi' column; both were refused."""
    path = tmp_path / "labels.csv"
    path.write_text("case_id,slide_id,label\np1,a,tumor_tissue\np2,b,normal_tissue\n")
    assert read_labels(path) == {"a": 1, "b": 0}
    path.write_text("wsi,label\nc.svs,1\nd.svs,0\n")
    assert read_labels(path) == {"c": 1, "d": 0}


@pytest.mark.parametrize("text, match", [
    ("slide,label\na,1\nb,maybe\n", r"line 3: label 'maybe' of slide 'b' is not 0/1 or normal/tumor\. Fix: use 1"),
    ("slide,label\na,1\nb\n", r"line 3: slide 'b' has no label\. Fix: add 1 \(tumour\) or 0 \(normal\)"),
    ("name,class\na,1\n", r"line 1: 'name,class' is neither a header with a name column .* Fix: write a header"),
    ("just_one_column\n", r"line 1: 'just_one_column' is neither a header"),
    ("slide,label\n", r"no labelled slides \(only a header or empty names\)\. Fix:"),
    ("", r"no slide labels in the file\. Fix:"),
    ("slide,label\na\x00,1\n", r"contains NUL bytes"),
    ('slide,label\n"a,1\n', r"no label|not valid CSV"),
])
def test_bad_files_name_file_line_and_fix(tmp_path, text, match):
    path = tmp_path / "labels.csv"
    path.write_text(text)
    with pytest.raises(LabelsError, match=r"labels\.csv: .*" + match):
        read_labels(path)


def test_unreadable_files(tmp_path):
    with pytest.raises(LabelsError, match=r"missing\.csv: slide-labels file not found\. Fix: check the path"):
        read_labels(tmp_path / "missing.csv")
    with pytest.raises(LabelsError, match=r"cannot read the slide labels .*Fix: give a readable CSV file"):
        read_labels(tmp_path)
    path = tmp_path / "latin1.csv"
    path.write_bytes("slide,label\nb\xe9b\xe9,1\n".encode("latin-1"))
    with pytest.raises(LabelsError, match=r"latin1\.csv: not UTF-8 text .*Fix: save the labels as UTF-8 CSV"):
        read_labels(path)
