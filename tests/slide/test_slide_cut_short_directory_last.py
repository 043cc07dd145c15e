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


def test_a_tiff_cut_inside_its_last_written_directory_is_cut_short(tmp_path):
    """Review EI, C4: a download cut inside the directory itself (its entries past the end) was taken as whole."""
    import struct

    pixels = np.random.default_rng(1).integers(0, 256, 70000, dtype=np.uint8).tobytes()
    first = 8 + len(pixels)  # one directory after the pixels, as libtiff and ASAP write it
    entries = [(256, 4, 1, 100), (257, 4, 1, 700), (258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 1),
               (273, 4, 1, 8), (277, 3, 1, 1), (278, 4, 1, 700), (279, 4, 1, len(pixels))]
    ifd = struct.pack("<H", len(entries)) + b"".join(
        struct.pack("<HHII", tag, kind, count, value) if kind == 4 else struct.pack("<HHIHH", tag, kind, count, value, 0)
        for tag, kind, count, value in entries) + struct.pack("<I", 0)
    whole = b"II*\x00" + struct.pack("<I", first) + pixels + ifd
    path = tmp_path / "slide.tif"
    path.write_bytes(whole)
    assert incomplete_file(path) is None
    path.write_bytes(whole[:-10])  # cut 10 bytes before the directory's end
    assert incomplete_file(path) == (f"this TIFF file is incomplete: its first directory is at byte {first:,}, but "
                                     f"the file ends after {len(whole) - 10:,} bytes")
