"""Names decomposed by macOS (NFD) match composed (NFC) ones everywhere names are matched: labels,
annotation files and the label stage's check for annotations without a store."""

from __future__ import annotations

import unicodedata

import pytest

from wsi_milssl.cohorts.labels import SlideLabels
from wsi_milssl.cohorts.names import name_key

NFC = unicodedata.normalize("NFC", "café_3")
NFD = unicodedata.normalize("NFD", "café_3")


def test_the_two_spellings_are_different_strings_with_one_key():
    assert NFC != NFD and name_key(NFC) == name_key(NFD) == name_key(NFD.upper())


@pytest.mark.parametrize("in_file, asked", [(NFD, NFC), (NFC, NFD)])
def test_labels_match_either_spelling(in_file, asked):
    labels = SlideLabels([(in_file, 1, 2)])
    assert labels[asked] == 1 and labels[f"{asked}.tif"] == 1


def test_an_annotation_file_of_the_other_spelling_is_found(tmp_path):
    from wsi_milssl.annotations.io import find_annotation

    (tmp_path / f"{NFD}.xml").write_text("<ASAP_Annotations/>")
    found = find_annotation(NFC, tmp_path)
    assert found is not None and found.name == f"{NFD}.xml"
