"""The digit-bag figure's legends stand off the data (review AP, finding 6): measured on the committed results
(benchmarks/results/bags.json), where the hard protocol's legend in the lower right covered test-pos8."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from figure_text import drawn_texts, texts_outside
from wsi_milssl.benchmark.plots import digit_bags_figure

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@pytest.mark.parametrize("protocol", ["hard", "normal"])
def test_legends_are_outside_the_panels(protocol):
    result = json.loads((RESULTS / "bags.json").read_text())[protocol]
    fig = digit_bags_figure(result)
    texts = drawn_texts(fig)
    assert texts_outside(fig) == []
    renderer = fig.canvas.get_renderer()
    panels = [ax for ax in fig.axes if ax.get_legend() is not None]
    assert len(panels) == 2
    for ax in panels:
        legend = ax.get_legend().get_window_extent(renderer)
        assert not legend.overlaps(ax.get_window_extent(renderer))  # off every data point and error bar
        own = {id(t) for t in ax.get_legend().get_texts()}
        others = [ext for _, t, ext in texts if id(t) not in own]
        assert not any(legend.overlaps(ext) for ext in others)  # and off the axis labels and tick labels
    # the committed figure is this one (redrawn with benchmarks/bench_bags.py --from-json)
    with Image.open(RESULTS / f"bags_{protocol}.png") as png:
        assert png.size == tuple(round(v) for v in fig.get_size_inches() * 100)
