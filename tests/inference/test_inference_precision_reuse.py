"""A slide predicted at another precision is predicted again (review AS, finding 3: ``[heatmap] amp = "off"``
after bf16 kept every bf16 map, 1e-2 apart from float32 ones, while heatmap_config.json named amp=off).

The precision counts as ``amp`` resolves on this device ('auto' and 'bf16' are the same on the CPU); the other
runtime settings (channels_last, fuse_batchnorm: ~1e-6 apart) still reuse a slide's files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wsi_milssl.config import HeatmapConfig
from wsi_milssl.inference import make_heatmaps

FAST = dict(thumbnail_px=96, batch_size=32, num_workers=0, device="cpu")


@pytest.fixture(scope="module")
def two_slides(tmp_path_factory, slide_writer) -> list[Path]:
    folder = tmp_path_factory.mktemp("precision")
    a = slide_writer(folder / "a.tif", width=1536, height=1536, tissue_box=(256, 256, 1280, 1280),
                     tumour=lambda xs, ys: (xs // 300 + ys // 300) % 4 == 0)
    b = slide_writer(folder / "b.tif", width=1536, height=1536, tissue_box=(0, 256, 1536, 1280),
                     tumour=lambda xs, ys: (xs // 300 + ys // 300 + 1) % 4 == 0)
    return [a, b]


def _fingerprints(folder: Path) -> set[str]:
    return {json.loads((folder / f"{s}_probs.json").read_text())["fingerprint"] for s in ("a", "b")}


def test_another_precision_predicts_again_other_runtime_settings_do_not(tmp_path, two_slides, checkpoint_factory,
                                                                         predicted):
    ckpt = checkpoint_factory()
    out = tmp_path / "hm"
    assert make_heatmaps(two_slides, ckpt, out, HeatmapConfig(**FAST, amp="auto")).ok
    assert predicted == ["a", "b"]
    bf16 = _fingerprints(out)

    predicted.clear()  # 'bf16' is what 'auto' resolves to on the CPU; layout and fusion change nothing
    run = make_heatmaps(two_slides, ckpt, out, HeatmapConfig(**FAST, amp="bf16", channels_last=False,
                                                             fuse_batchnorm=False))
    assert run.ok and predicted == [] and run.skipped == ("a", "b")

    predicted.clear()
    run = make_heatmaps(two_slides, ckpt, out, HeatmapConfig(**FAST, amp="off"))
    assert run.ok and predicted == ["a", "b"] and run.skipped == () and run.redrawn == ()
    assert len(_fingerprints(out)) == 1 and _fingerprints(out) != bf16
    fresh = tmp_path / "fresh"
    assert make_heatmaps(two_slides, ckpt, fresh, HeatmapConfig(**FAST, amp="off")).ok
    assert _fingerprints(out) == _fingerprints(fresh)
    for s in ("a", "b"):
        assert (out / f"{s}_probs.npy").read_bytes() == (fresh / f"{s}_probs.npy").read_bytes()

    predicted.clear()  # a drawing change at another precision is no redraw: the probabilities differ
    run = make_heatmaps(two_slides, ckpt, out, HeatmapConfig(**FAST, amp="bf16", colormap="magma"))
    assert run.ok and predicted == ["a", "b"] and run.redrawn == ()


def test_a_feature_heads_fingerprint_names_its_precision(tmp_path):
    from feature_heads import train_head

    from wsi_milssl.inference.feature_maps import _feature_fingerprint, load_feature_head
    from wsi_milssl.inference.stage import checkpoint_sha256

    run = train_head(tmp_path)
    prints = {}
    for amp in ("auto", "off", "bf16"):
        config = HeatmapConfig(device="cpu", amp=amp)
        head = load_feature_head(run, config=config)
        prints[amp] = _feature_fingerprint(config, head, checkpoint_sha256(head))
    assert prints["auto"] == prints["off"]  # feature heads predict in float32 on the CPU by default
    assert prints["bf16"] != prints["off"]

