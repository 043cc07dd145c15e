"""Review EA (mutation test): no test saw the modification time in a large input's fingerprint (dropping it went
unnoticed), so a slide replaced in place by another file of the same size would not have been tiled again."""

from __future__ import annotations

import os

from wsi_milssl.pipeline.stamps import CONTENT_BYTES, fingerprint_paths


def test_a_file_of_the_same_size_written_at_another_time_is_another_input(tmp_path):
    slide = tmp_path / "slide.tif"
    slide.write_bytes(b"a" * 1000)
    os.utime(slide, ns=(1_000_000_000, 1_000_000_000))
    before = fingerprint_paths([slide])
    slide.write_bytes(b"b" * 1000)  # another slide, the same size
    os.utime(slide, ns=(2_000_000_000, 2_000_000_000))
    after = fingerprint_paths([slide])
    assert before != after and before[0][1] == after[0][1] == 1000
    assert after == [[str(slide), 1000, 2_000_000_000]]
    # small files count by content instead: the same bytes touched are the same input, other bytes are not
    small = tmp_path / "labels.csv"
    small.write_text("slide,label\n")
    first = fingerprint_paths([small], content=True)
    os.utime(small, ns=(3_000_000_000, 3_000_000_000))
    assert fingerprint_paths([small], content=True) == first
    small.write_text("slide,lab3l\n")
    assert fingerprint_paths([small], content=True) != first
    assert CONTENT_BYTES > small.stat().st_size
