"""One file SHA-256 (wsi_milssl.hashing.file_sha256) for prepare, the pipeline's stamps, label and the feature
encoders' weights (review AT, B3): the same hex digest of the bytes as before, at every call site."""

from __future__ import annotations

import hashlib

import pytest

from wsi_milssl.hashing import cached_file_sha256, file_reads_kept, file_sha256, kept_file_read


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


def test_file_reads_are_kept_within_a_run_only_and_per_identity_of_the_file(tmp_path):
    """Review CH: one pipeline run hashed every small feature file up to five times."""
    import os

    path = tmp_path / "bag.h5"
    path.write_bytes(b"a" * 100)
    calls = []

    def read():
        calls.append(1)
        return file_sha256(path)

    def kept():
        return kept_file_read("sha256", path, os.stat(path), read)

    with file_reads_kept():
        first = kept()
        with file_reads_kept():  # a nested block shares the outer one's
            assert kept() == first
        assert kept() == first and len(calls) == 1
        path.write_bytes(b"b" * 101)  # written again: another file
        assert kept() == file_sha256(path) != first and len(calls) == 2
    kept(), kept()  # outside: read every time
    assert len(calls) == 4


def test_an_up_to_date_feature_pipeline_hashes_each_file_once(tmp_path, monkeypatch):
    from tinypipeline import FEATURE_BAGS, feature_bags
    from wsi_milssl.pipeline import load_pipeline, run_pipeline, stamps

    feature_bags(tmp_path / "bags" / "train", 8, 0)
    feature_bags(tmp_path / "bags" / "test", 4, 1)
    (tmp_path / "p.toml").write_text('[pipeline]\nname = "hashes"\n' + FEATURE_BAGS + "mu_ramp_epochs = 1\n")
    out = tmp_path / "out"
    run_pipeline(load_pipeline(tmp_path / "p.toml", out_dir=out))
    hashed = []

    def counted(path, **kwargs):
        hashed.append(str(path))
        return file_sha256(path, **kwargs)

    monkeypatch.setattr(stamps, "file_sha256", counted)
    outcomes = run_pipeline(load_pipeline(tmp_path / "p.toml", out_dir=out))
    assert {o.status for o in outcomes} == {"skipped"}
    assert any(p.endswith("bag_00.h5") for p in hashed)
    assert len(hashed) == len(set(hashed)), sorted(p for p in set(hashed) if hashed.count(p) > 1)


def test_runs_in_two_threads_keep_their_own_reads_and_leave_none():
    """Review CL: one module-wide memo; two overlapping runs in two threads left it on for the rest of the process."""
    import threading

    from wsi_milssl import hashing

    both_inside = threading.Barrier(2)
    memos, after = [], []

    def run(wait_s: float) -> None:
        with file_reads_kept():
            memos.append(hashing._KEPT.get())
            both_inside.wait()
            time.sleep(wait_s)  # the second finishes last
        after.append(hashing._KEPT.get())

    import time

    threads = [threading.Thread(target=run, args=(s,)) for s in (0.0, 0.2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(memos) == 2 and memos[0] is not memos[1]
    assert after == [None, None] and hashing._KEPT.get() is None
    later = []
    t = threading.Thread(target=lambda: later.append(hashing._KEPT.get()))
    t.start()
    t.join()
    assert later == [None]
