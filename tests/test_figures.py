"""The product's PNGs are the size they are drawn at, whatever the user's matplotlibrc says of saving figures: a
``savefig.bbox: tight`` line cropped every one (a ``--thumbnail-px 320`` view came out 311 px wide; review DC)."""

from __future__ import annotations

import io

import matplotlib
from matplotlib.figure import Figure
from PIL import Image

from wsi_milssl.figures import png_bytes
from wsi_milssl.mil.plots import plot_training_metrics

USER_RC = {"savefig.bbox": "tight", "savefig.pad_inches": 0.5, "savefig.transparent": True, "savefig.dpi": 150}


def test_a_figure_is_saved_at_its_size_and_opaque_under_a_users_save_settings():
    fig = Figure(figsize=(3, 2))
    fig.add_subplot().plot([0, 1], [0, 1])
    with matplotlib.rc_context(USER_RC):
        img = Image.open(io.BytesIO(png_bytes(fig, dpi=100)))
    assert img.size == (300, 200)
    assert img.convert("RGBA").getextrema()[3] == (255, 255)  # no transparent pixel


def test_the_training_plot_is_its_size_under_a_users_save_settings(tmp_path):
    history = [{"epoch": e, "loss": 1.0 / e, "mu": 0.5, "pseudo_positive_fraction": 0.4} for e in (1, 2, 3)]
    with matplotlib.rc_context(USER_RC):
        path = plot_training_metrics(history, tmp_path / "metrics.png")
    assert Image.open(path).size == (1000, 700)
