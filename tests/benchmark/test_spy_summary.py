"""benchmarks/spy_summary.py on a small file in py-spy's raw format (``--threads --subprocesses``)."""

from __future__ import annotations

import gzip

from benchscripts import load_benchmark_script


def _raw() -> str:
    main = 'process 10:"python3 -m wsi_milssl heatmap slides";thread (10): MainThread'
    writer = 'process 10:"python3 -m wsi_milssl heatmap slides";thread (11): wsi-heatmap-write_0'
    reader = 'process 12:"python3 -B -c from multiprocessing.forkserver import main";thread (12): MainThread'
    return "\n".join([
        f"{main};<module> (wsi_milssl/__main__.py:3);run (wsi_milssl/cli/heatmap.py:210);"
        "_make_heatmaps (wsi_milssl/inference/stage.py:767);collect (wsi_milssl/inference/stage.py:720);"
        "wait (threading.py:320) 30",
        f"{main};<module> (wsi_milssl/__main__.py:3);run (wsi_milssl/cli/heatmap.py:210);"
        "_make_heatmaps (wsi_milssl/inference/stage.py:767);_Batcher.add (wsi_milssl/inference/predict.py:280);"
        "Conv2d._conv_forward (torch/nn/modules/conv.py:543) 10",
        f"{main};<module> (wsi_milssl/__main__.py:3);_find_and_load (<frozen importlib._bootstrap>:1176) 60",
        f"{writer};_worker (thread.py:89);write_png (wsi_milssl/inference/heatmap.py:384);"
        "_encode_tile (PIL/ImageFile.py:640) 25",
        f"{reader};read_chunk (wsi_milssl/inference/sources.py:360);jpeg_decode (imagecodecs.py:1808) 5",
        "",
    ])


def test_summary_gives_each_thread_its_share_of_samples(tmp_path):
    spy = load_benchmark_script("spy_summary")
    path = tmp_path / "run.spy.gz"
    with gzip.open(path, "wt") as fh:
        fh.write(_raw())
    text = spy.summarise(spy.read(path), top=5, thread_filter=None, min_samples=1)
    lines = text.splitlines()
    assert lines[1].startswith("## 10 python3 -m wsi_milssl heatmap slides: 125 samples")
    main = lines.index("### thread (10): MainThread: 100 samples")
    assert lines[main + 1] == "self: _find_and_load (<frozen importlib._bootstrap>) 60%; wait (threading.py) 30%; " \
                              "Conv2d._conv_forward (conv.py) 10%"
    assert "_make_heatmaps (stage.py) 40%" in lines[main + 2]
    assert "### thread (11): wsi-heatmap-write_0: 25 samples" in lines
    assert any(line.startswith("## 12 forkserver/reader: 5 samples") for line in lines)
    # only the samples under one function, and only some threads
    only = spy.summarise(spy.read(path, within="_make_heatmaps"), top=5, thread_filter="Main", min_samples=1)
    assert "### thread (10): MainThread: 40 samples" in only and "write_0" not in only
    assert "self: wait (threading.py) 75%; Conv2d._conv_forward (conv.py) 25%" in only
