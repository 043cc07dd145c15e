"""Group names are matched in one Unicode normal form (review AN, finding 5): 'Tumör' composed (NFC) in the
file and decomposed (NFD, as macOS may give it) in --tumor-groups did not match, so the tumour was ignored."""

from __future__ import annotations

import unicodedata

import numpy as np
import pytest

from wsi_milssl.annotations import GroupMap, PolygonAnnotation, read_annotations, write_asap_xml
from wsi_milssl.errors import ConfigError

NFC = unicodedata.normalize("NFC", "Tumör")
NFD = unicodedata.normalize("NFD", "Tumör")


@pytest.mark.parametrize("in_file, given", [(NFC, NFD), (NFD, NFC)])
def test_a_group_matches_in_either_unicode_form(tmp_path, in_file, given):
    square = np.array([[0, 0], [100, 0], [100, 100], [0, 100]], dtype=np.float64)
    path = write_asap_xml([PolygonAnnotation("A", in_file, square)], tmp_path / "s.xml")
    aset = read_annotations(path, group_map=GroupMap(tumor=(given,), non_tumor=("_2",)))
    assert aset.region.area == pytest.approx(100 * 100)
    assert GroupMap(tumor=(given,)).role(in_file.upper()) == "tumor"


def test_one_name_in_two_forms_cannot_be_both_tumour_and_non_tumour():
    with pytest.raises(ConfigError, match="listed as both tumour and non-tumour"):
        GroupMap(tumor=(NFC,), non_tumor=(NFD,))
