"""One file SHA-256 (wsi_milssl.hashing.file_sha256) for prepare, the pipeline's stamps, label and the feature
encoders' weights (review AT, B3): the same hex digest of the bytes as before, at every call site."""

from __future__ import annotations

import hashlib

import pytest

from wsi_milssl.hashing import cached_file_sha256, file_sha256


@pytest.mark.parametrize("size", [0, 1, (1 << 20) - 1, 1 << 20, (1 << 20) + 7, 3 * (1 << 20) + 5])
def test_digest_is_the_sha256_of_the_bytes(tmp_path, size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert file_sha256(path) == file_sha256(str(path)) == hashlib.sha256(data).hexdigest()
    for limit in (0, 1, 1 << 20, (1 << 20) + 3, size + 10):
        assert file_sha256(path, limit_bytes=limit) == hashlib.sha256(data[:limit]).hexdigest()


def test_missing_file_raises_oserror(tmp_path):
    with pytest.raises(OSError):
        file_sha256(tmp_path / "none")


def test_every_call_site_uses_it_and_gives_the_same_digest(tmp_path):
    from wsi_milssl.cohorts import checks, write
    from wsi_milssl.features import encoders
    from wsi_milssl.labeling import stage as label_stage
    from wsi_milssl.pipeline import stamps

    data = b"<ASAP_Annotations/>\n" * 100_000
    path = tmp_path / "a.xml"
    path.write_bytes(data)
    expected = hashlib.sha256(data).hexdigest()
    for module in (checks, write, stamps, label_stage):
        assert not hasattr(module, "_sha256"), module.__name__
    assert label_stage.file_sha256 is checks.file_sha256 is write.file_sha256 is stamps.file_sha256 is file_sha256
    assert write._file_sha256(path) == expected
    assert stamps._file_identity(path, with_sha256=True)[2] == expected
    assert cached_file_sha256(path) == cached_file_sha256(path) == expected  # the second from the cache
    assert not hasattr(encoders, "file_sha256")  # review BQ: one home, hashing.py
