"""Review AB, finding 4: each shard (a torchrun rank, a --shard task) of heatmap prints its own summary,
and the summary names its shard, as tile's does (``tiled 2 slide(s) (shard 1/2): ...``)."""

from __future__ import annotations

from wsi_milssl.cli import main


def test_a_heatmap_shard_names_its_shard_in_its_summary(tmp_path, slide_writer, checkpoint_factory, capsys):
    slide = slide_writer(tmp_path / "s0.tif", width=1024, height=1024, tissue_box=(128, 128, 896, 896),
                         tumour=lambda xs, ys: xs < 512)
    out = tmp_path / "hm"
    cmd = ["heatmap", str(slide), "--model", str(checkpoint_factory()), "--out", str(out), "--workers", "0",
           "--thumbnail-px", "128"]
    assert main([*cmd, "--shard", "7/8"]) == 0  # s0 hashes to another shard: none of its slides
    assert f"heatmaps of 0 slide(s) (shard 7/8): 0 ok, 0 failed, 0 empty; 0 patches in " in capsys.readouterr().out
    assert main(cmd) == 0
    printed = capsys.readouterr().out
    assert "heatmaps of 1 slide(s): 1 ok" in printed and "(shard" not in printed
