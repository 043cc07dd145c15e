"""The probability grid, the pixel -> cell rule, smoothing, overlay drawing and the colour-map registry."""

from __future__ import annotations

import numpy as np
import pytest
import shapely

from wsi_milssl.inference.colormaps import COLORMAPS, apply_colormap, colormap_lut, register_colormap
from wsi_milssl.inference.heatmap import (
    colorbar_panel,
    grid_indices,
    pixel_cells,
    probability_grid,
    render_overlay,
    sample_grid,
)


def test_probability_grid_places_each_patch_by_origin_and_stride():
    coords = np.array([[100, 50], [164, 50], [100, 178]])
    grid = probability_grid(coords, [0.1, 0.2, 0.3], origin_lv0=(100, 50), stride_lv0=64, shape=(3, 2))
    assert grid.dtype == np.float32
    np.testing.assert_allclose(grid, [[0.1, 0.2], [np.nan, np.nan], [0.3, np.nan]])
    assert grid_indices(coords, origin_lv0=(100, 50), stride_lv0=64).tolist() == [[0, 0], [0, 1], [2, 0]]


def test_probability_grid_rejects_off_grid_and_outside_patches():
    with pytest.raises(ValueError, match=r"not on the grid of stride 64"):
        probability_grid(np.array([[10, 0]]), [0.5], origin_lv0=(0, 0), stride_lv0=64, shape=(2, 2))
    with pytest.raises(ValueError, match="outside the 2 x 2 grid"):
        probability_grid(np.array([[128, 0]]), [0.5], origin_lv0=(0, 0), stride_lv0=64, shape=(2, 2))


def test_pixel_cells_nearest_centre_rule_with_overlap_and_gaps():
    # patches 100 px every 50 px (overlap): pixel centres at 10, 30, ..., each goes to the nearest centre
    r, rin, c, cin = pixel_cells((1, 12), (20.0, 20.0), origin_lv0=(0, 0), stride_lv0=50, patch_size_lv0=100,
                                 grid_shape=(1, 4))
    centres = (np.arange(12) + 0.5) * 20  # 10 .. 230; patch centres at 50, 100, 150, 200
    expected = np.clip(np.floor((centres - 50) / 50 + 0.5), 0, 3).astype(int)
    assert c.tolist() == expected.tolist()
    assert cin.tolist() == [True] * 12  # the grid covers 0..250
    # patches 40 px every 100 px (gaps): pixels between patches belong to none
    _, _, c, cin = pixel_cells((1, 10), (20.0, 20.0), origin_lv0=(0, 0), stride_lv0=100, patch_size_lv0=40,
                               grid_shape=(1, 2))
    assert cin.tolist() == [True, True, False, False, False, True, True, False, False, False]
    assert c[:2].tolist() == [0, 0] and c[5:7].tolist() == [1, 1]


def test_sample_grid_without_and_with_smoothing():
    grid = np.full((4, 4), 0.0, np.float32)
    grid[1, 1] = 1.0
    grid[3, 3] = np.nan
    raw = sample_grid(grid, (8, 8), (16.0, 16.0), origin_lv0=(0, 0), stride_lv0=32, patch_size_lv0=32)
    assert raw.shape == (8, 8)
    assert np.argwhere(raw == 1.0).tolist() == [[2, 2], [2, 3], [3, 2], [3, 3]]
    assert np.isnan(raw[6:, 6:]).all()
    smooth = sample_grid(grid, (8, 8), (16.0, 16.0), origin_lv0=(0, 0), stride_lv0=32, patch_size_lv0=32,
                         smooth_sigma_cells=1.0)
    assert np.isnan(smooth[6:, 6:]).all()  # no patch stays no patch
    assert 0 < smooth[2, 2] < 1.0 and smooth[0, 7] < smooth[2, 2]  # spread out and falling off
    assert np.nanmax(smooth) == pytest.approx(smooth[2:4, 2:4].max())


def test_render_overlay_colours_patch_pixels_only_and_appends_a_colour_bar():
    thumb = np.full((20, 30, 3), 200, np.uint8)
    grid = np.array([[0.9, 0.2, np.nan]], np.float32)
    out = render_overlay(grid, thumb, downsample_xy=(10.0, 10.0), origin_lv0=(0, 0), stride_lv0=100,
                         patch_size_lv0=100, colormap="red", alpha=1.0, colorbar=False)
    assert out.shape == thumb.shape
    def colour(p):
        return np.broadcast_to(apply_colormap(np.float64(np.float32(p)), "red"), (10, 10, 3))

    np.testing.assert_array_equal(out[:10, :10], colour(0.9))
    np.testing.assert_array_equal(out[:10, 10:20], colour(0.2))
    np.testing.assert_array_equal(out[:10, 20:], thumb[:10, 20:])  # NaN cell: untouched
    np.testing.assert_array_equal(out[10:], thumb[10:])  # below the grid: untouched
    # threshold, alpha, tissue clipping
    tissue = np.zeros((2, 3), bool)
    tissue[0, 0] = True
    out = render_overlay(grid, thumb, downsample_xy=(10.0, 10.0), origin_lv0=(0, 0), stride_lv0=100,
                         patch_size_lv0=100, colormap="red", alpha=0.5, threshold=0.5, tissue_mask=tissue,
                         tissue_downsample_xy=(100.0, 100.0), colorbar=True)
    assert out.shape[0] == 20 and out.shape[1] > 30
    red = apply_colormap(np.float64(np.float32(0.9)), "red").astype(float)
    np.testing.assert_array_equal(out[0, 0], np.round(0.5 * 200 + 0.5 * red).astype(np.uint8))
    np.testing.assert_array_equal(out[:10, 10:30], thumb[:10, 10:30])  # below threshold


def test_render_overlay_draws_annotation_outlines_at_their_level0_place():
    thumb = np.full((50, 50, 3), 255, np.uint8)
    square = shapely.box(100, 100, 300, 300)  # level-0 px; downsample 10 -> pixels 10..30
    out = render_overlay(np.zeros((0, 0), np.float32), thumb, downsample_xy=(10.0, 10.0), origin_lv0=(0, 0),
                         stride_lv0=100, patch_size_lv0=100, outlines=square, outline_color="#0000ff",
                         outline_width_px=1, colorbar=False)
    blue = (out == [0, 0, 255]).all(axis=2)
    ys, xs = np.nonzero(blue)
    assert abs(xs.min() - 10) <= 1 and abs(xs.max() - 30) <= 1 and abs(ys.min() - 10) <= 1 and abs(ys.max() - 30) <= 1
    assert not blue[20, 20]  # an outline, not a fill


def test_colormap_registry_accepts_new_maps_and_rejects_unknown_ones():
    assert {"jet", "viridis", "inferno", "red"} <= set(COLORMAPS)
    lut = colormap_lut("viridis", 4)
    assert lut.shape == (4, 3) and lut.dtype == np.uint8
    assert colormap_lut("jet", 2)[1].tolist() == [128, 0, 0]  # jet ends in dark red

    @register_colormap("test_grey")
    def grey(values):
        g = np.round(np.asarray(values) * 255).astype(np.uint8)
        return np.stack([g, g, g], axis=-1)

    try:
        assert apply_colormap(np.array([0.0, 1.0]), "test_grey").tolist() == [[0, 0, 0], [255, 255, 255]]
        panel = colorbar_panel(200, colormap="test_grey")
        assert panel.shape[0] == 200 and panel.dtype == np.uint8
    finally:
        COLORMAPS.pop("test_grey")
    with pytest.raises(ValueError, match="unknown colour map 'nope'; registered colour maps: .*jet"):
        apply_colormap(np.zeros(2), "nope")


def test_overlay_defaults_keep_the_tissue_visible_and_add_a_title_band_and_scale_bar():
    from wsi_milssl.config import HeatmapConfig
    from wsi_milssl.inference.heatmap import footer_panel, scale_bar_length_um

    d = HeatmapConfig()
    assert d.colormap == "viridis" and d.overlay_threshold >= 0.5 and d.alpha <= 0.5 and d.title and d.scale_bar
    thumb = np.full((40, 60, 3), 200, np.uint8)
    grid = np.array([[0.2, 0.9]], np.float32)
    out = render_overlay(grid, thumb, downsample_xy=(10.0, 10.0), origin_lv0=(0, 0), stride_lv0=300,
                         patch_size_lv0=300, colormap=d.colormap, alpha=d.alpha, threshold=d.overlay_threshold,
                         colorbar=True, title="slide_1: score 0.900", scale_bar_um_per_px=5.0)
    assert out.shape[0] > 40 and out.shape[1] > 60
    np.testing.assert_array_equal(out[:30, :30], thumb[:30, :30])   # below the threshold: the H&E as it is
    assert (out[:30, 30:60] != thumb[:30, 30:60]).any(axis=2).all()  # above: blended, the H&E beneath
    assert (out[:40, 30:60] != 0).all()
    band = out[40:, :60]
    assert (band < 128).any()  # text and the scale bar are drawn in the band below the thumbnail
    # 60 px at 5 µm/px = 300 µm: 20 % is 60 µm, the round length nearest is 50 µm
    assert scale_bar_length_um(60, 5.0) == 50.0
    assert scale_bar_length_um(2048, 0.243 * 50) == 5000.0
    panel = footer_panel(300, title="t", um_per_px=10.0)
    bar_rows = (panel[:, :, 0] == 0) & (panel[:, :, 1] == 0)
    assert bar_rows.any(axis=0).sum() >= 50  # a 500 µm bar is 50 px long at 10 µm/px


def _glyphs(font, text: str) -> tuple:
    mask = font.getmask(text)
    return mask.size, bytes(mask)


def test_labels_draw_the_micro_sign_and_accented_slide_names():
    """The scale bar's µ and a slide name's ü are drawn as letters, not as the box of a missing glyph (Pillow's
    built-in font has ASCII only): the labels use matplotlib's DejaVu Sans."""
    from wsi_milssl.inference.heatmap import _font, _um_text, footer_panel

    font = _font(20)
    missing = _glyphs(font, "\U000F0000")  # a private-use code point: no font has a glyph for it
    for text in ("µ", "ü"):
        assert _glyphs(font, text) != missing, text
    assert _um_text(100, font) == "100 µm" and _um_text(2000, font) == "2 mm"
    named = footer_panel(300, title="Zürich µ", um_per_px=10.0)
    boxes = footer_panel(300, title="Z\U000F0000rich \U000F0000", um_per_px=10.0)
    assert (named != boxes).any()


def test_labels_without_dejavu_fall_back_to_ascii(monkeypatch):
    from wsi_milssl.inference import heatmap

    monkeypatch.setattr(heatmap, "_font_file", lambda: None)
    font = heatmap._font(20)
    assert _glyphs(font, "a") != _glyphs(font, "\U000F0000")
    assert heatmap._um_text(100, font) == "100 um"  # not a box for µ
    panel = heatmap.footer_panel(300, title="slide", um_per_px=10.0)
    assert (panel < 128).any()


@pytest.mark.parametrize("width_px, um_per_px", [(64, 32.0), (64, 100.0), (80, 16.0), (300, 10.0)])
def test_the_scale_bar_label_stays_inside_a_small_image(width_px, um_per_px):
    """Review AP, finding 7: at heatmap --thumbnail-px 64 the label, centred on a bar at the right edge, ran off
    the image ('500 µr'). Its ink now ends at least a pixel inside both edges."""
    from wsi_milssl.inference.heatmap import footer_panel

    panel = footer_panel(width_px, um_per_px=um_per_px)
    bar = (panel[:, :, 0] == 0) & (panel[:, :, 1] == 0) & (panel[:, :, 2] == 0)
    first_bar_row = int(np.argmax(bar.sum(axis=1) == bar.sum(axis=1).max()))
    ink = (panel[:first_bar_row - 1] < 200).any(axis=2)  # the label, above the bar
    assert ink.any()
    columns = np.flatnonzero(ink.any(axis=0))
    assert columns[0] >= 1 and columns[-1] <= width_px - 2, (columns[0], columns[-1])


def test_the_colour_bar_shows_what_the_overlay_leaves_unpainted():
    """Review AP, finding 10: the bar showed viridis's dark low end (which reads like haematoxylin) for values the
    overlay never paints (below overlay_threshold). Below the threshold the bar is now white, as the overlay
    leaves those pixels, with a tick at the threshold."""
    from wsi_milssl.inference.heatmap import colorbar_panel

    plain = colorbar_panel(400, colormap="viridis")
    cut = colorbar_panel(400, colormap="viridis", threshold=0.5)
    font_px = 10  # at 400 px: the bar spans x 5..15 and y 2 * font_px .. 400 - font_px
    column, top, bottom = 8, 2 * font_px, 400 - font_px
    upper = cut[top + 5:(top + bottom) // 2 - 5, column]
    lower = cut[(top + bottom) // 2 + 5:bottom - 5, column]
    assert (lower == 255).all()  # unpainted: white
    assert (upper != 255).any(axis=1).all()  # painted values keep the colour map
    assert (plain[(top + bottom) // 2 + 5:bottom - 5, column] != 255).any(axis=1).all()  # no threshold: colour
