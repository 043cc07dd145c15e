"""Review ES, A3: a config, pipeline or labels file that never ends (a device such as /dev/zero, which reports size
0 as pipes do) was read whole: memory grew until a MemoryError traceback. The reads are bounded now."""

from __future__ import annotations

import pytest

from wsi_milssl.cohorts import read_labels
from wsi_milssl.config.base import load_toml
from wsi_milssl.errors import ConfigError, LabelsError


def test_a_config_file_that_never_ends_is_one_error():
    with pytest.raises(ConfigError, match=r"^/dev/zero: more than 16 MiB, far too large for a config file"):
        load_toml("/dev/zero")


def test_a_labels_file_that_never_ends_is_one_error():
    with pytest.raises(LabelsError, match=r"^/dev/zero: more than \d+ bytes, far too large for a slide-labels CSV"):
        read_labels("/dev/zero")


@pytest.mark.parametrize("kind", ["slide list", "GeoJSON", "detections", "patch table", "slide scores"])
def test_other_input_files_that_never_end_are_one_error_each(tmp_path, kind):
    """Review EU, B4: the same by other paths: a slide list (``tile``, ``evaluate --slides``, a pipeline's lists), a
    GeoJSON annotation, and the heatmap tables evaluate reads were read whole."""
    from wsi_milssl.annotations import read_annotations
    from wsi_milssl.artifacts import read_detections, read_patch_probs, read_scores
    from wsi_milssl.errors import AnnotationError, EvaluationError
    from wsi_milssl.tiling.inputs import read_slide_list

    name, read, error = {"slide list": ("slides.csv", read_slide_list, ConfigError),
                         "GeoJSON": ("s.geojson", read_annotations, AnnotationError),
                         "detections": ("s.csv", read_detections, EvaluationError),
                         "patch table": ("s_patches.csv", read_patch_probs, EvaluationError),
                         "slide scores": ("scores.csv", read_scores, EvaluationError)}[kind]
    (tmp_path / name).symlink_to("/dev/zero")
    with pytest.raises(error, match=rf"{name}: cannot read .*\(more than \d+ MiB, far larger than any such file\)"):
        read(tmp_path / name)


def test_a_bounded_read_allocates_what_it_reads_and_takes_pipes_whole(tmp_path):
    """The bound is not allocated up front (read(n) takes n bytes first: 256 MiB for every small labels file, which
    the GeoJSON reader's memory test caught), and a pipe's text arrives whole across pieces."""
    import os
    import threading
    import tracemalloc

    from wsi_milssl.paths import FileTooLarge, read_bounded

    small = tmp_path / "small.csv"
    small.write_bytes(b"slide,label\n" * 1000)
    tracemalloc.start()
    try:
        assert read_bounded(small, 256 << 20) == small.read_bytes()
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
    with pytest.raises(FileTooLarge, match=r"more than 100 bytes, far larger than any such file"):
        read_bounded(small, 100)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    text = b"x" * ((3 << 20) + 5)  # more than one piece
    writer = threading.Thread(target=lambda: fifo.write_bytes(text))
    writer.start()
    assert read_bounded(fifo, 4 << 20) == text
    writer.join()
