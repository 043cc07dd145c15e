"""train's metrics.png from real (short) runs (review AP, finding 5): whole epochs on the epoch axis, and a
panel that says why a series is missing when the instances carry no labels."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from figure_text import drawn_texts, texts_outside, visible_ticks
from milcsv import make_mil_csv
from wsi_milssl.cli import main
from wsi_milssl.mil.plots import training_metrics_figure


def _train(csv: Path, val: Path, out: Path, epochs: int) -> list[dict]:
    assert main(["train", str(csv), "--val", str(val), "--out", str(out), "--epochs", str(epochs),
                 "--threads", "1"]) == 0
    with Image.open(out / "metrics.png") as png:
        assert png.size == (1000, 700)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _panel_texts(fig, ax) -> str:
    legend = ax.get_legend()
    own = [t.get_text() for t in ax.texts] + ([t.get_text() for t in legend.get_texts()] if legend else [])
    drawn = {id(t) for _, t, _ in drawn_texts(fig)}
    assert all(id(t) in drawn for t in ax.texts)
    return "\n".join(own)


def test_short_runs_have_whole_epochs_on_the_epoch_axis(mil_csv, mil_csv_val, tmp_path):
    """A 1- or 2-epoch run had ticks at 0.96, 0.98, ... 1.04 on every panel's epoch axis."""
    history = _train(mil_csv, mil_csv_val, tmp_path / "run", epochs=2)
    for n_epochs in (1, 2):
        fig = training_metrics_figure(history[:n_epochs])
        assert texts_outside(fig) == []
        for ax in fig.axes:
            ticks = visible_ticks(ax.xaxis)
            assert ticks and all(t == int(t) for t in ticks), ticks
            assert set(range(1, n_epochs + 1)) <= {int(t) for t in ticks}


def test_without_instance_labels_the_panels_say_why(mil_csv, mil_csv_val, tmp_path):
    """Instances without labels (a MIL CSV whose instance labels are its bag labels; unlabelled stores alike):
    the pseudo-label panel said only "not available" and the validation panel left instance AUC out silently."""
    plain = []
    for path in (mil_csv, mil_csv_val):
        rows = [line.split(",", 2) for line in path.read_text().splitlines()]
        positive = {bag for label, bag, _ in rows if label == "1"}
        out = tmp_path / path.name
        out.write_text("".join(f"{int(bag in positive)},{bag},{rest}\n" for _, bag, rest in rows))
        plain.append(out)
    history = _train(plain[0], plain[1], tmp_path / "run", epochs=2)
    assert all(r.get("pseudo_precision") is None and r.get("val_instance_auc") is None for r in history)
    assert all(r.get("val_bag_auc") is not None for r in history)
    fig = training_metrics_figure(history)
    assert texts_outside(fig) == []
    ax_pseudo, ax_val = fig.axes[2], fig.axes[3]
    assert "not available" in _panel_texts(fig, ax_pseudo)
    assert "never labelled" in _panel_texts(fig, ax_pseudo)
    val = _panel_texts(fig, ax_val)
    assert "bag AUC" in val and "instance AUC: not available" in val and "never labelled" in val


def test_labelled_runs_draw_every_series(mil_csv, mil_csv_val, tmp_path):
    """The reasons appear only where a series is missing."""
    history = _train(make_mil_csv(tmp_path / "train.csv", n_bags=20), mil_csv_val, tmp_path / "run", epochs=1)
    fig = training_metrics_figure(history)
    for ax in fig.axes:
        assert "not available" not in _panel_texts(fig, ax)
    assert {"precision", "recall", "accuracy"} <= set(_panel_texts(fig, fig.axes[2]).split("\n"))


def test_series_differ_by_more_than_colour_and_best_pt_is_marked(mil_csv, mil_csv_val, tmp_path):
    """Review BS, C8: the lines of a panel differed by colour only (green and orange, blue and green in grey),
    no panel had a y label and the epoch best.pt holds was not shown."""
    history = _train(make_mil_csv(tmp_path / "train.csv", n_bags=20), mil_csv_val, tmp_path / "run", epochs=2)
    fig = training_metrics_figure(history)
    for ax in fig.axes:
        lines = [line for line in ax.get_lines() if len(line.get_xdata()) and not line.get_label().startswith("best")]
        assert ax.get_ylabel()
        assert len({(line.get_marker(), line.get_linestyle()) for line in lines}) == len(lines)
    assert f"best.pt (epoch {history[-1]['best_epoch']})" in _panel_texts(fig, fig.axes[3])


def test_a_plot_left_behind_by_a_kill_is_drawn_again_on_resume(mil_csv, mil_csv_val, tmp_path):
    """Review CQ: a kill after the last epoch's checkpoints, while metrics.png was drawn, left the plot of an earlier
    epoch (naming an earlier best.pt); a resume with nothing left to train kept it, and the pipeline's stamp with it."""
    import os

    from wsi_milssl.mil.plots import plot_training_metrics

    out = tmp_path / "run"
    history = _train(mil_csv, mil_csv_val, out, epochs=2)
    plot_training_metrics(history, tmp_path / "full.png")
    plot_training_metrics(history[:1], out / "metrics.png")  # the first epoch's plot, as the kill left it
    last = (out / "last.pt").stat().st_mtime_ns
    os.utime(out / "metrics.png", ns=(last - 10**9, last - 10**9))
    assert main(["train", "--resume", str(out), "--threads", "1"]) == 0
    assert (out / "metrics.png").read_bytes() == (tmp_path / "full.png").read_bytes()
    drawn = (out / "metrics.png").stat().st_mtime_ns
    assert main(["train", "--resume", str(out), "--threads", "1"]) == 0  # a plot newer than last.pt is kept
    assert (out / "metrics.png").stat().st_mtime_ns == drawn
