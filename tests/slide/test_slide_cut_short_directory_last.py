"""Review EH, B2: libtiff (Pillow) and ASAP, whose writer made CAMELYON16's slides, write a directory after the image
data it describes, so a download stopped early keeps a header that points past the file's end. No directory could
be read, and a file of 64 KiB or more was taken for no TIFF at all; prepare then accepted it and tile said "give a
pyramidal slide", the wrong fix."""

from __future__ import annotations

import numpy as np
from PIL import Image

from wsi_milssl.slide.reader import incomplete_file


def test_a_tiff_whose_first_directory_lies_past_its_end_is_cut_short(tmp_path):
    path = tmp_path / "slide.tif"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(path)
    data = path.read_bytes()
    assert len(data) > 65536 and incomplete_file(path) is None
    # what such a writer's file cut at half its size holds: a header naming a directory beyond the part received
    first = 2 * len(data)
    cut = data[:4] + first.to_bytes(4, "little" if data[:2] == b"II" else "big") + data[8: len(data) // 2]
    path.write_bytes(cut)
    assert incomplete_file(path) == (f"this TIFF file is incomplete: its first directory is at byte {first:,}, but "
                                     f"the file ends after {len(cut):,} bytes")
    other = tmp_path / "notes.tif"
    other.write_bytes(b"not a tiff" * 10000)
    assert incomplete_file(other) is None  # no TIFF: OpenSlide's error, not this one
