"""The summary line of `wsi-milssl heatmap`: a rate over the slides predicted in this run only, and no rate
when every slide was already done."""

from __future__ import annotations

import re

from wsi_milssl.cli import main


def test_a_resumed_run_says_the_slides_were_done_instead_of_a_rate(tmp_path, slide_writer, checkpoint_factory,
                                                                   capsys):
    """A run whose slides were all done printed "85 patches in 0.0 s, 1191878.4 patches/s": the patches of
    the skipped slides over the time of a run that predicted nothing."""
    slides = [slide_writer(tmp_path / f"s{k}.tif", width=2048, height=2048, tissue_box=(256, 256, 1792, 1792),
                           tumour=lambda xs, ys, k=k: (xs // 300 + ys // 300 + k) % 4 == 0) for k in range(2)]
    out = tmp_path / "hm"
    cmd = ["heatmap", "--model", str(checkpoint_factory()), "--out", str(out), "--thumbnail-px", "128",
           "--workers", "0"]
    assert main([*cmd, str(slides[0])]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    n0 = int(re.search(r"; (\d+) patches in [\d.]+ s, [\d.]+ patches/s -> ", first).group(1))
    assert main([*cmd, *map(str, slides)]) == 0  # s0 done, s1 predicted: the rate is s1's alone
    second = capsys.readouterr().out.splitlines()[0]
    assert re.search(r"heatmaps of 2 slide\(s\): 2 ok, 0 failed, 0 empty; \d+ new patches in [\d.]+ s, [\d.]+ "
                     r"patches/s; 1 slide\(s\) already done with this checkpoint and settings, skipped -> ", second)
    n1 = int(re.search(r"; (\d+) new patches in ", second).group(1))
    assert main([*cmd, *map(str, slides)]) == 0
    third = capsys.readouterr().out.splitlines()[0]
    assert third == (f"heatmaps of 2 slide(s): 2 ok, 0 failed, 0 empty; {n0 + n1} patches; every slide was already "
                     f"done with this checkpoint and settings (skipped, nothing predicted) -> {out}")
    assert "patches/s" not in third
