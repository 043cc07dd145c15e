"""A self-contained HTML report: metrics table, plots, per-slide table with heatmap thumbnails and the
configuration used.

Every image is embedded as a ``data:image/png;base64`` URI and the style sheet is inline, so the
single file can be mailed or archived and opens offline. The page has no scripts: a per-slide image embedded
larger than ``thumbnail_px`` is shown at that size and toggles to its own size on a click (a hidden checkbox in
its label, styled by CSS).
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["ReportData", "png_data_uri", "png_size", "render_report_html", "write_report"]


@dataclass(frozen=True)
class ReportData:
    """Everything the report shows.

    ``metrics``: the content of ``metrics.json``. ``plots``: (caption, PNG bytes) pairs.
    ``slide_rows``: one mapping per slide (the per-slide CSV's columns, in order). ``thumbnails``:
    slide stem -> list of (caption, PNG bytes). ``configuration``: the settings and inputs used
    (JSON-serialisable). ``notes``: lines shown under the metrics (e.g. why a metric is missing).
    ``thumbnail_px``: the longer side (CSS px) at which the per-slide images are shown (None: their own size);
    a larger image is shown at it and opens at its own size on a click. ``gallery_legend``: a line above the
    per-slide images (the key of their symbols). ``model``: one line under the title on the model behind the
    predictions (its training run: :func:`model_line`), empty when unknown.
    """

    title: str
    metrics: Mapping[str, Any]
    plots: Sequence[tuple[str, bytes]] = ()
    slide_rows: Sequence[Mapping[str, Any]] = ()
    thumbnails: Mapping[str, Sequence[tuple[str, bytes]]] = field(default_factory=dict)
    configuration: Mapping[str, Any] = field(default_factory=dict)
    notes: Sequence[str] = ()
    thumbnail_px: int | None = None
    gallery_legend: str = ""
    model: str = ""


_VALIDATION_NAMES = {"val_bag_auc": "validation bag AUC", "val_instance_auc": "validation instance AUC",
                     "val_bag_nll": "validation bag NLL"}


def model_line(training: Mapping[str, Any]) -> str:
    """The report's line on the model (review CS: the training run was only in the configuration dump at the end),
    from the evaluation's training summary (``configuration["training"]``): e.g. ``resnet18, 6 epochs, μ 0.15, T 5,
    λ 25; best.pt: epoch 4, chosen by bag_auc (validation bag AUC 1.000)`` (μ fixed from the first epoch: ``μ 0.8
    fixed``, no T); empty for an empty summary."""
    if not training:
        return ""
    epochs = training.get("epochs")
    fixed = bool(training.get("fixed_mu"))
    names = {"mu": "μ {} fixed" if fixed else "μ {}", **({} if fixed else {"mu_ramp_epochs": "T {}"}), "lam": "λ {}"}
    parts = [str(training["model"])] if training.get("model") else []
    parts += [f"{epochs} epoch{'' if epochs == 1 else 's'}"] if epochs is not None else []
    parts += [form.format(f"{training[key]:g}" if isinstance(training[key], (int, float)) else training[key])
              for key, form in names.items() if training.get(key) is not None]
    line = ", ".join(parts)
    if training.get("best_epoch") is not None:
        chosen = f", chosen by {training['select_metric']}" if training.get("select_metric") else ""
        scores = ", ".join(f"{_VALIDATION_NAMES.get(key, key)} "
                           + (f"{value:.3f}" if isinstance(value, (int, float)) else str(value))
                           for key, value in (training.get("best_epoch_validation") or {}).items())
        line += f"; best.pt: epoch {training['best_epoch']}{chosen}" + (f" ({scores})" if scores else "")
    return line


def png_data_uri(png: bytes) -> str:
    """``data:image/png;base64,...`` for PNG bytes (checked by their signature)."""
    if not png.startswith(b"\x89PNG\r\n\x1a\n"):
        raise ValueError("png_data_uri expects PNG bytes (missing the PNG signature).")
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:2em auto;max-width:1200px;
color:#222;padding:0 1em}
h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.25em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.9em;margin:.5em 0}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:right;vertical-align:middle}
th{background:#f3f3f3}td.l,th.l{text-align:left}
.muted{color:#767676}.plots{display:flex;flex-wrap:wrap;gap:1em}
figure{margin:0}figcaption{font-size:.85em;color:#555;text-align:center}
pre{background:#f7f7f7;border:1px solid #ddd;padding:.8em;overflow:auto;font-size:.85em}
.thumbs{display:flex;gap:.6em;align-items:flex-start;flex-wrap:wrap}
.gallery{display:flex;flex-wrap:wrap;gap:1em}.card{border:1px solid #ddd;padding:.5em .8em}
h3{font-size:1em;margin:.2em 0 .5em}.wide{overflow-x:auto}th.sub{padding-left:1.8em;font-weight:normal}
label.zoom{position:relative;display:block}label.zoom img{cursor:zoom-in;display:block}
label.zoom input{position:absolute;opacity:0;width:1px;height:1px;margin:0}
label.zoom input:focus-visible+img{outline:2px solid #0a58ca;outline-offset:2px}
label.zoom input:checked+img{width:auto;height:auto;max-width:calc(100vw - 5em);cursor:zoom-out}
"""


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:.4f}"
    return str(value)


def _img(png: bytes, alt: str) -> str:
    return f'<img src="{png_data_uri(png)}" alt="{html.escape(alt)}">'


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) in pixels of PNG bytes, from their header."""
    if not png.startswith(b"\x89PNG\r\n\x1a\n") or len(png) < 24 or png[12:16] != b"IHDR":
        raise ValueError("png_size expects PNG bytes (a PNG signature followed by its IHDR header).")
    return struct.unpack(">II", png[16:24])


def _shown(png: bytes, alt: str, caption: str, max_px: int | None) -> str:
    """A per-slide figure: the image at its own size, or, when its longer side is over ``max_px``, at
    ``max_px`` and opening at its own size on a click."""
    width, height = png_size(png)
    if max_px is None or max(width, height) <= max_px:
        return (f'<figure><img src="{png_data_uri(png)}" alt="{html.escape(alt)}" width="{width}" height="{height}">'
                f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    scale = max_px / max(width, height)
    shown_w, shown_h = max(1, round(width * scale)), max(1, round(height * scale))
    return (f'<figure><label class="zoom" title="click to enlarge ({width} x {height} px) or shrink">'
            f'<input type="checkbox"><img src="{png_data_uri(png)}" alt="{html.escape(alt)}" width="{shown_w}" '
            f'height="{shown_h}"></label><figcaption>{html.escape(caption)} (click to enlarge)</figcaption></figure>')


def _metrics_table(metrics: Mapping[str, Any]) -> str:
    reasons = metrics.get("reasons", {}) or {}
    rows = []

    def row(name: str, value: Any, key: str | None = None, *, sub: bool = False, note: str = "") -> None:
        note = html.escape(reasons.get(key, "") if key and value is None else note)
        rows.append(f'<tr><th class="{"l sub" if sub else "l"}">{html.escape(name)}</th><td>{html.escape(_fmt(value))}'
                    f'</td><td class="l muted">{note}</td></tr>')

    row("Instance AUC (patches)", metrics.get("instance_auc"), "instance_auc")
    row("Bag AUC (slides)", metrics.get("bag_auc"), "bag_auc")
    protocol = metrics.get("froc_protocol")  # "CAMELYON16" only with the challenge script's settings
    row(f"FROC score ({protocol})" if protocol else "FROC score", metrics.get("froc"), "froc")
    rates = metrics.get("fp_rates") or []
    sens = metrics.get("froc_sensitivities") or []
    for rate, value in zip(rates, sens):
        label = {0.25: "1/4", 0.5: "1/2"}.get(rate, f"{rate:g}")
        row(f"sensitivity at {label} FP/slide", value, sub=True)
    excluded = list(metrics.get("lesion_excluded") or ())
    # the counts of the FROC and the instance AUC leave out the slides of lesion_exclude (review BS: unsaid)
    froc_only = (f"of the {metrics.get('n_slides', 0) - len(excluded)} slides of the FROC and the instance AUC "
                 f"({len(excluded)} left out by lesion_exclude)") if excluded else ""
    for key, name in (("n_slides", "slides evaluated"), ("n_tumor_slides", "tumour slides"),
                      ("n_normal_slides", "normal slides"), ("n_lesions", "lesions (non-ITC)"),
                      ("n_itc", "isolated tumour cell regions"), ("n_detections", "detections"),
                      ("n_patches", "patches scored"), ("n_positive_patches", "positive patches")):
        if key in metrics:
            row(name, metrics[key], note=froc_only if key not in ("n_slides", "n_tumor_slides", "n_normal_slides")
                else "")
    return ('<table><tr><th class="l">metric</th><th>value</th><th class="l">note</th></tr>'
            + "".join(rows) + "</table>")


def _slide_table(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return '<p class="muted">No slides.</p>'
    columns = list(rows[0].keys())
    head = "".join(f'<th class="l">{html.escape(c)}</th>' if c == "slide" else f"<th>{html.escape(c)}</th>"
                   for c in columns)
    out = [f'<div class="wide"><table><tr>{head}</tr>']
    for r in rows:
        cells = "".join(
            f'<td class="l">{html.escape(_fmt(r.get(c)))}</td>' if c == "slide"
            else f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in columns
        )
        out.append(f"<tr>{cells}</tr>")
    out.append("</table></div>")
    return "".join(out)


def _gallery(rows: Sequence[Mapping[str, Any]], thumbnails: Mapping[str, Sequence[tuple[str, bytes]]], *,
             max_px: int | None = None, legend: str = "", no_tissue: Sequence[str] = ()) -> str:
    """The per-slide cards; ``no_tissue``: the slides the heatmap stage found no tissue patch on."""
    cards = []
    for r in rows:
        stem = str(r.get("slide"))
        label = {0: "normal", 1: "tumour"}.get(r.get("label"), "")
        figs = "".join(_shown(png, f"{stem} {cap}", cap, max_px) for cap, png in thumbnails.get(stem, ()))
        if stem in no_tissue:
            figs = '<p class="muted">no tissue patch: the heatmap stage found none on this slide, which scores 0</p>' + figs
        if str(r.get("lesion_excluded")) == "1":
            figs = '<p class="muted">left out of the FROC and the instance AUC (lesion_exclude)</p>' + figs
        elif not figs:
            figs = '<p class="muted">no heatmap in the predictions folder</p>'
        cards.append(f'<div class="card"><h3>{html.escape(stem)} <span class="muted">{html.escape(label)}</span>'
                     f'</h3><div class="thumbs">{figs}</div></div>')
    if not cards:
        return ""
    key = f'<p class="muted">{html.escape(legend)}</p>' if legend else ""
    return f'{key}<div class="gallery">{"".join(cards)}</div>'


def render_report_html(data: ReportData) -> str:
    """The report as one HTML string (UTF-8, no external resources)."""
    from wsi_milssl import __version__

    plots = "".join(
        f"<figure>{_img(png, caption)}<figcaption>{html.escape(caption)}</figcaption></figure>"
        for caption, png in data.plots
    )
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in data.notes)
    config_json = json.dumps(data.configuration, indent=2, sort_keys=True, default=str, ensure_ascii=False)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html.escape(data.title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(data.title)}</h1>",
        f'<p class="muted">wsi-milssl {html.escape(__version__)} &middot; {stamp}</p>',
        f"<p><b>Model:</b> {html.escape(data.model)}</p>" if data.model else "",
        "<h2>Metrics</h2>",
        _metrics_table(data.metrics),
        f"<ul>{notes}</ul>" if notes else "",
        "<h2>Curves</h2>",
        f'<div class="plots">{plots}</div>' if plots else '<p class="muted">No curves could be drawn.</p>',
        "<h2>Slides</h2>",
        _slide_table(data.slide_rows),
        "<h2>Heatmaps</h2>" if data.slide_rows else "",
        _gallery(data.slide_rows, data.thumbnails, max_px=data.thumbnail_px, legend=data.gallery_legend,
                 no_tissue=tuple(data.metrics.get("no_tissue") or ())),
        "<h2>Configuration</h2>",
        f"<pre>{html.escape(config_json)}</pre>",
        "</body></html>",
    ]
    return "\n".join(p for p in parts if p) + "\n"


def write_report(data: ReportData, path: str | os.PathLike) -> Path:
    """Write ``report.html`` atomically (temp file in the same folder, fsync, rename)."""
    from wsi_milssl.atomic import atomic_write_bytes

    return atomic_write_bytes(Path(path), render_report_html(data).encode("utf-8"))
