"""Review AM, finding 1: a tile run stopped at one world size (torchrun's ranks, or --shard N) and finished by a
run at another left its marks for good: a finishing shard removed only the marks whose slides were all among
its own, which no shard of another split ever covers, so `train` kept warning that "the last tile run did not
finish", citing the stopped run. Now a finishing run (shard) removes a mark once every slide it lists is
finished in the folder: a store there, or a failed row in tile_status.csv (by this run or another)."""

from __future__ import annotations

import pytest

from wsi_milssl.config import TileConfig
from wsi_milssl.distributed import Shard
from wsi_milssl.tiling import find_slides, tile_slides
from wsi_milssl.tiling.status import unfinished_runs

#: coarse (2 µm/px, 32 px patches): a second or so a slide
TILE = TileConfig(target_mpp=2.0, patch_size_px=32, entropy_threshold_bits=3.0, min_tissue=0.3, mask_mpp=8.0,
                  threads=1)


def _crash_after(n: int):
    def crash(event):
        if event.stage == "tile" and event.done >= n:
            raise RuntimeError("a crash")
    return crash


def _marks(out) -> list[list[str]]:
    return sorted(r["slides"] for r in unfinished_runs(out, "tile"))


def test_a_run_at_another_world_size_clears_the_stopped_runs_marks(four_slides, tmp_path):
    slides = find_slides([four_slides[0]])  # slide_0 .. slide_3
    out = tmp_path / "st"
    # torchrun's 2 ranks (every 2nd slide), each stopped after its first slide
    for rank in (0, 1):
        with pytest.raises(RuntimeError, match="a crash"):
            tile_slides(slides, out, TILE, shard=Shard(rank, 2, "position"), progress=_crash_after(1))
    assert _marks(out) == [["slide_0", "slide_2"], ["slide_1", "slide_3"]]
    # the same slides again on 3 ranks: slide_0 + slide_3, slide_1, slide_2
    assert tile_slides(slides, out, TILE, shard=Shard(0, 3, "position")).ok
    assert _marks(out) == [["slide_0", "slide_2"]]  # slide_1 and slide_3 have stores now; slide_2 has none
    assert tile_slides(slides, out, TILE, shard=Shard(1, 3, "position")).ok
    assert _marks(out) == [["slide_0", "slide_2"]]
    assert tile_slides(slides, out, TILE, shard=Shard(2, 3, "position")).ok
    assert _marks(out) == [] and not list(out.glob(".wsi-milssl.unfinished-*"))


def test_a_failed_slide_is_finished_and_a_missing_store_is_not(four_slides, tmp_path):
    every = find_slides([four_slides[0]])
    gone = tmp_path / "gone.tif"  # no such file: its slide fails
    out = tmp_path / "st"
    with pytest.raises(RuntimeError, match="a crash"):
        tile_slides([every[0], every[1], gone], out, TILE, progress=_crash_after(1))
    assert _marks(out) == [["gone", "slide_0", "slide_1"]]
    # a store recorded 'ok' but removed since is missing, not finished: the mark stays
    (out / "slide_0.h5").unlink()
    run = tile_slides([every[1], gone], out, TILE)
    assert run.n_failed == 1
    assert _marks(out) == [["gone", "slide_0", "slide_1"]]
    # slide_0 tiled again: every slide of the mark has a store or failed
    assert tile_slides([every[0]], out, TILE).ok
    assert _marks(out) == []


def test_the_mark_of_a_shard_writing_the_folder_now_is_kept(four_slides, tmp_path):
    """Shard 1/3's slides may all have stores (of an earlier run) while it still runs: another shard finishing
    does not remove its mark then."""
    from wsi_milssl.locks import folder_lock

    slides = find_slides([four_slides[0]])
    out = tmp_path / "st"
    with pytest.raises(RuntimeError, match="a crash"):  # shard 1/3 (slide_1) stops after its slide is done
        tile_slides(slides, out, TILE, shard=Shard(1, 3, "position"), progress=_crash_after(1))
    assert _marks(out) == [["slide_1"]]
    with folder_lock(out, shard=(1, 3)):  # shard 1/3 runs again
        assert tile_slides(slides, out, TILE, shard=Shard(0, 3, "position")).ok
        assert _marks(out) == [["slide_1"]]
    assert tile_slides(slides, out, TILE, shard=Shard(2, 3, "position")).ok
    assert _marks(out) == []
