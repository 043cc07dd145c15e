"""Fuzzing the slide-labels reader: any bytes give labels or a LabelsError, never another exception."""

from __future__ import annotations

import pytest
from fuzzing import DEFAULT, LONG, mutated
from hypothesis import given
from hypothesis import strategies as st

from wsi_milssl.cohorts import LABEL_WORDS, read_labels, slide_stem
from wsi_milssl.errors import LabelsError

CELLS = st.one_of(
    st.sampled_from(["slide", "label", "Slide", "LABEL", "bag_id", "case_id", "name", "class", ""]),
    st.sampled_from(sorted(LABEL_WORDS) + ["Tumor", "NORMAL", "Macro", "ITC", "2", "-1", "maybe"]),
    st.sampled_from(["synth_000", "Test_001.tif", "a/b/c.SVS", "x.h5", ".tif", "C:\\s\\y.ndpi", " spaced "]),
    st.text(max_size=10),
)


@st.composite
def labels_bytes(draw) -> bytes:
    rows = draw(st.lists(st.lists(CELLS, max_size=5), max_size=8))
    sep = draw(st.sampled_from([",", ",", ";", "\t"]))
    end = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    quote = draw(st.booleans())
    text = end.join(sep.join(f'"{c}"' if quote else c for c in row) for row in rows)
    encoding = draw(st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "latin-1"]))
    try:
        data = text.encode(encoding)
    except UnicodeEncodeError:
        data = text.encode("utf-8")
    return draw(st.one_of(st.just(data), mutated(data)))


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("labels_fuzz")


def _check(tmp_dir, data: bytes) -> None:
    path = tmp_dir / "labels.csv"
    path.write_bytes(data)
    try:
        labels = read_labels(path)
    except LabelsError as exc:
        assert str(exc).startswith(f"{path}: ")
        return
    assert len(labels) > 0
    keys = {stem.casefold() for stem in labels}
    for stem in labels:  # every stem read is found again: as read, in upper case, with a slide suffix
        assert stem and stem == stem.strip() and labels[stem] in (0, 1)
        if stem.upper().casefold() == stem.casefold():
            assert labels[stem.upper()] == labels[stem]
        if f"{stem}.tif".casefold() not in keys:
            assert labels[f"{stem}.tif"] == labels[stem] and slide_stem(f"{stem}.svs") == stem


@DEFAULT
@given(data=labels_bytes())
def test_labels_fuzz(fuzz_dir, data):
    _check(fuzz_dir, data)


@DEFAULT
@given(data=st.binary(max_size=1024))
def test_labels_random_bytes(fuzz_dir, data):
    _check(fuzz_dir, data)


@pytest.mark.slow
@LONG
@given(data=st.one_of(labels_bytes(), st.binary(max_size=4096)))
def test_labels_fuzz_long(fuzz_dir, data):
    _check(fuzz_dir, data)
