"""Tile slides into patch stores: per-slide pipeline, parallel runner, resume and status CSV.

Per slide, the config's :class:`~wsi_milssl.tiling.plan.TilingPlan` is cut by the functions in
:mod:`wsi_milssl.tiling.cells` (the heatmap stage calls the same ones): tissue mask on a thumbnail ->
grid at the target resolution -> cells with enough tissue are read (bands of neighbours at the read
level, on reader threads) -> entropy filter. The kept patches' JPEG/raw pixels are streamed in
batches into a temporary ``.<stem>.<fmt>.<pid>.<random>.partial`` -> QC PNG -> rename to the final
store, whose attributes record the plan.
A run killed at any moment leaves no store that looks complete, and leaves the hidden mark that a run
writes into the folder before its first slide and removes after its last
(:func:`~wsi_milssl.tiling.status.marking_unfinished`), so ``train`` warns about the missing slides;
re-running skips complete stores made with the same settings, removes the killed run's temporaries
and refuses to mix settings in one folder. A run holds the output folder's lock
(:func:`wsi_milssl.locks.folder_lock`): a second run into the same folder is refused. Shard I of N
(``shard=(I, N)``: ``--shard I/N`` or a torchrun rank) tiles its share of the slides
(:func:`wsi_milssl.distributed.shard_items`); the shards of one run may write one folder at once, and
their ``tile_status.csv`` rows merge, sorted by slide as one run writes them. Before each slide the free
disk space is checked against an estimate of its store; a slide that does not fit, or whose store fills
the disk anyway, fails alone.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shlex
import shutil
import sys
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from wsi_milssl import __version__
from wsi_milssl.atomic import atomic_write_json
from wsi_milssl.config.base import config_to_dict
from wsi_milssl.cohorts.names import stem_too_long
from wsi_milssl.config.tile import TileConfig
from wsi_milssl.distributed import Shard, shard_items
from wsi_milssl.errors import FeatureFileGivenError, OutputError, StoreError, WsiMilsslError
from wsi_milssl.events import ProgressCallback, ProgressEvent, emit
from wsi_milssl.locks import folder_lock, folder_mutex, other_shards_writing
from wsi_milssl.paths import path_list
from wsi_milssl.parent_watch import watch_parent
from wsi_milssl.slide.reader import open_slide
from wsi_milssl.slide.resolution import mpp_to_magnification
from wsi_milssl.store import create_writer, encode_jpeg, find_stores, open_store
from wsi_milssl.store.base import dumps_settings
from wsi_milssl.store.schema import store_path
from wsi_milssl.tiling.cells import cut_band, open_band_source, plan_slide
from wsi_milssl.tiling.inputs import file_fingerprint, slide_stem
from wsi_milssl.tiling.qc import render_qc, write_qc_png
from wsi_milssl.tiling.plan import PLAN_ATTR
from wsi_milssl.tiling.reading import Band, ordered_map
from wsi_milssl.tiling.status import (STATUS_FILENAME, TileResult, finished_slides, marking_unfinished,
                                      merge_status_csv)

__all__ = [
    "CONFIG_FILENAME",
    "QC_DIRNAME",
    "TileRun",
    "check_existing_store",
    "check_folder_settings",
    "check_free_space",
    "estimate_store_bytes",
    "feature_file_error",
    "qc_path",
    "tile_slide",
    "tile_slides",
]

logger = logging.getLogger(__name__)

CONFIG_FILENAME = "tile_config.json"
QC_DIRNAME = "qc"
# Flush buffered patches to the store when they hold this many bytes (raw pixels are large).
_FLUSH_BYTES = 64 << 20
_QC_MAX_PX = 1024
_QC_MIN_PX = 512
# Free space a slide needs beyond its estimated store: HDF5/Zarr metadata, the QC PNG, status files.
_FREE_SPACE_MARGIN = 16 << 20
_FREE_SPACE_FACTOR = 1.1


def estimate_store_bytes(n_patches: int, *, pixels: str, patch_size_px: int, jpeg_quality: int | None = 90) -> int:
    """Upper estimate of a store's size in bytes for ``n_patches`` patches of ``patch_size_px``.

    Raw pixels count in full; JPEG at 1/8 of raw up to quality 90 (H&E patches measure 9-12x smaller),
    1/3 above it; each patch adds 24 bytes of coordinates, entropy and tissue fraction.
    """
    raw = patch_size_px * patch_size_px * 3
    per_patch = {"raw": raw, "jpeg": raw // (8 if (jpeg_quality or 90) <= 90 else 3), "none": 0}[pixels]
    return int(n_patches) * (per_patch + 24)


def check_free_space(path: str | os.PathLike, n_bytes: int, *, what: str) -> None:
    """Raise OutputError (naming ``path``, the sizes and the fix) when the disk that holds ``path``'s
    folder has less than ``n_bytes`` free."""
    path = Path(path)
    folder = path.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:  # cannot tell (e.g. the folder vanished): let the write report it
        return
    if free < n_bytes:
        mib = 1 << 20
        raise OutputError(
            f"{path}: not enough free disk space for {what}: it needs about {n_bytes / mib:.1f} MiB "
            f"(estimate with a margin), {free / mib:.1f} MiB are free in {folder}. Fix: free disk space "
            f"(`df -h {shlex.quote(str(folder))}`) or write to another folder (--out), and re-run.",
            errno=errno.ENOSPC,
        )


def qc_path(out_dir: str | os.PathLike, stem: str) -> Path:
    """Where the QC thumbnail of slide ``stem`` goes: ``DIR/qc/<stem>.png``."""
    return Path(out_dir) / QC_DIRNAME / f"{stem}.png"


def _slide_fingerprint_attrs(slide_path: str | os.PathLike) -> dict[str, Any]:
    """``slide_path`` (absolute), ``slide_size_bytes`` and ``slide_mtime_ns`` of the slide file, as
    recorded in a store; the size and time are None when the file cannot be stat'ed."""
    fp = file_fingerprint(slide_path)
    if fp is None:
        return {"slide_path": os.path.realpath(slide_path), "slide_size_bytes": None, "slide_mtime_ns": None}
    return {"slide_path": fp["path"], "slide_size_bytes": fp["size_bytes"], "slide_mtime_ns": fp["mtime_ns"]}


def _other_slide_reason(attrs: dict[str, Any], slide_path: str | os.PathLike) -> str | None:
    """Why a store with root ``attrs`` was not cut from the current file at ``slide_path`` (another
    file, or the same path since rewritten), or None when it was: the same path, size and modification time, or
    the same file name, size and time in another folder (the slides moved or copied with their times: ``mv``,
    ``cp -a``, ``rsync -a``; the store keeps the path it was cut from)."""
    now = _slide_fingerprint_attrs(slide_path)
    if now["slide_size_bytes"] is None:
        return f"the slide file {slide_path} cannot be read, so the store cannot be checked against it"
    recorded = str(attrs.get("slide_path"))
    if recorded != now["slide_path"] and (Path(recorded).name != Path(now["slide_path"]).name
                                          or attrs.get("slide_size_bytes") != now["slide_size_bytes"]):
        return f"it was cut from another slide file ({attrs.get('slide_path')!r}, now {now['slide_path']!r})"
    if recorded != now["slide_path"] and attrs.get("slide_mtime_ns") != now["slide_mtime_ns"]:
        # review DD: the same name and size elsewhere, another time (copied without it, or touched): not said to be
        # another file
        return (f"it was cut from {attrs.get('slide_path')!r}, and the slide file of that name and size here "
                f"({now['slide_path']!r}) has another modification time (copied without it, or changed), so it "
                "cannot be told from another file without reading it")
    if "slide_size_bytes" not in attrs or "slide_mtime_ns" not in attrs:
        return "it records no slide size and modification time (written by an older wsi-milssl)"
    if (attrs.get("slide_size_bytes"), attrs.get("slide_mtime_ns")) != (now["slide_size_bytes"], now["slide_mtime_ns"]):
        return (f"the slide file changed since it was tiled (size {attrs.get('slide_size_bytes')} -> "
                f"{now['slide_size_bytes']} bytes, modified time {attrs.get('slide_mtime_ns')} -> "
                f"{now['slide_mtime_ns']} ns)")
    return None


def check_existing_store(path: Path, config: TileConfig, *, slide_path: str | os.PathLike | None = None
                         ) -> int | None:
    """Number of patches of a complete store at ``path`` made with ``config``'s settings, or None when
    there is no store. Raises StoreError (suggesting a new --out or --overwrite) when a store is there
    but was made with other settings or cannot be read.

    With ``slide_path``, a store that was not cut from that very file also counts as no store (None,
    with a warning saying why), so that the slide is tiled again: the store's ``slide_path`` (or its file
    name, for slides moved), ``slide_size_bytes`` and ``slide_mtime_ns`` must equal the file's resolved path,
    size and modification time now. A store written before these attributes existed cannot be checked and is
    tiled again too (the safe choice), as is a store whose slide file is missing or unreadable (the
    old store stays until a new one replaces it).
    """
    if not path.exists():
        return None
    try:
        with open_store(path) as store:
            attrs = store.attrs
            n = len(store)
    except StoreError as exc:
        raise _unusable(path, exc) from None
    diffs = _settings_diffs(attrs, config)
    if diffs is not None:
        raise StoreError(
            f"{path}: this store was made with different settings ({diffs}). "
            "Fix: write to a new folder with --out, or pass --overwrite to replace it."
        )
    if slide_path is not None:
        reason = _other_slide_reason(attrs, slide_path)
        if reason is not None:
            logger.warning("%s: not reused: %s; tiling the slide again.", path, reason)
            return None
    return n


def feature_file_error(paths: list[Path]) -> FeatureFileGivenError | None:
    """The error for the feature files (of any tool: a ``features`` dataset and no ``patches``,
    :func:`wsi_milssl.features.schema.is_feature_file`) among ``paths``, where tile would write its stores;
    None when there is none. Tile never replaces a feature file, with or without --overwrite."""
    import h5py

    from wsi_milssl.features.schema import SCHEMA, is_feature_file

    found = [p for p in paths if is_feature_file(p)]
    if not found:
        return None
    if len(found) == 1:
        try:
            with h5py.File(found[0], "r") as fh:
                ours = fh.attrs.get("schema") in (SCHEMA, SCHEMA.encode())
        except OSError:
            ours = False
        maker = "`wsi-milssl features`" if ours else "a 'features' dataset and no patches, as TRIDENT and CLAM write"
        head = f"{found[0]}: this is a feature file ({maker}), not a patch store, where tile would write its store"
    else:
        names = ", ".join(str(p) for p in found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        head = f"{len(found)} feature files where tile would write its stores ({names})"
    return FeatureFileGivenError(
        f"{head}; tile never replaces a feature file. Fix: tile into another folder with --out (feature files are "
        "read by `wsi-milssl train FEATURES` and `wsi-milssl heatmap --features`).")


def _unusable(path: Path, exc: StoreError) -> StoreError:
    features = feature_file_error([path])  # a TRIDENT or CLAM file has no schema attribute to say so
    if features is not None:
        return features
    if isinstance(exc, FeatureFileGivenError):  # --overwrite would replace the features with a store
        return exc
    return StoreError(f"{path}: a store is already there but cannot be reused ({exc}). "
                      "Fix: pass --overwrite to replace it, or write to a new folder with --out.")


def _settings_diffs(attrs: dict[str, Any], config: TileConfig) -> str | None:
    """How the settings of a store with root ``attrs`` (or of a ``tile_config.json``) differ from
    ``config``'s ("patch_size_px 128 -> 256; stride_px 128 -> 256"), or None when they are the same
    (same settings hash)."""
    if attrs.get("config_hash") == config.settings_hash():
        return None
    old = attrs.get("settings", "{}")
    try:
        old = json.loads(old) if isinstance(old, str) else old
    except (TypeError, ValueError):
        old = {}
    if not isinstance(old, dict):
        old = {}
    new = config.settings()
    diffs = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return "; ".join(diffs) or "settings hash differs"


def _other_settings_stores(out_dir: Path, slides: list[Path], config: TileConfig, *, overwrite: bool
                           ) -> tuple[dict[Path, str], set[Path]]:
    """The complete stores in ``out_dir`` made with other settings: ({store: how the settings differ}, the
    stores among them that this run does not replace: those of slides not in ``slides`` and those in the
    other format; the format is a setting, so a store in the other format always differs). With
    ``overwrite`` the stores of ``slides`` in ``config.format`` are not checked (they are replaced). A
    store of one of ``slides`` in ``config.format`` that cannot be read raises StoreError (unless
    ``overwrite``); any other is skipped with a warning."""
    mine = {store_path(out_dir, slide_stem(s), config.format) for s in slides}
    differ: dict[Path, str] = {}
    others: set[Path] = set()
    for path in find_stores(out_dir):
        if overwrite and path in mine:
            continue
        try:
            with open_store(path) as store:
                diffs = _settings_diffs(store.attrs, config)
        except StoreError as exc:
            if path in mine:
                raise _unusable(path, exc) from None
            logger.warning("%s: not checked against this run's settings: %s", path, exc)
            continue
        if diffs is not None:
            differ[path] = diffs
            if path not in mine:
                others.add(path)
    return differ, others


def _describe_stores(differ: dict[Path, str], *, limit: int = 5) -> str:
    """``A.h5, B.h5 (patch_size_px 128 -> 256); C.h5 (pixels 'raw' -> 'jpeg')``: stores grouped by how
    their settings differ, at most ``limit`` names per group and ``limit`` groups."""
    groups: dict[str, list[str]] = {}
    for path in sorted(differ):
        groups.setdefault(differ[path], []).append(path.name)
    parts = []
    for diffs, names in list(groups.items())[:limit]:
        more = f" and {len(names) - limit} more" if len(names) > limit else ""
        parts.append(f"{', '.join(names[:limit])}{more} ({diffs})")
    if len(groups) > limit:
        parts.append(f"{sum(len(n) for n in list(groups.values())[limit:])} more with other differences")
    return "; ".join(parts)


def check_folder_settings(out_dir: str | os.PathLike, slides: list[Path], config: TileConfig, *,
                          overwrite: bool = False, keep_other_stores: bool = False) -> list[str]:
    """Check that the stores in ``out_dir`` (in either format) were made with ``config``'s settings, so
    that one folder holds the stores of one setting (which ``tile_config.json`` describes; the format is
    one of the settings); returns the names of the stores this run does not replace that were made with
    other settings and stay: those of slides not in ``slides`` and those in the other format (sorted).

    Without ``overwrite``, any store made with other settings raises one StoreError naming the stores,
    how their settings differ and the fix; with it, the stores of ``slides`` in ``config.format`` are
    replaced and the others made with other settings stay, with a warning. ``keep_other_stores``: those
    others neither raise nor warn (the pipeline keeps the stores of slides that left a set, and those of
    an earlier run in the other format, in the set's folder and reads only the set's stores).
    """
    out_dir = Path(out_dir)
    differ, others = _other_settings_stores(out_dir, slides, config, overwrite=overwrite)
    suffix = store_path(out_dir, "x", config.format).suffix
    refused = {p: d for p, d in differ.items() if p not in others or not (overwrite or keep_other_stores)}
    if refused:
        n = len(refused)
        if n == 1:
            (path, diffs), = refused.items()
            what = f"{path}: this store was made with different settings ({diffs})"
        else:
            what = f"{out_dir}: {n} stores in this folder were made with different settings: {_describe_stores(refused)}"
        theirs = sorted(p.name for p in refused if p in others and p.suffix == suffix)
        formats = sorted(p.name for p in refused if p.suffix != suffix)
        fixes = []
        if not theirs:
            if len(formats) < n:
                fixes.append("pass --overwrite to replace " + ("it" if n == 1 else "the stores of this run's slides"))
        elif n == 1:
            what += "; its slide is not in this run, but one folder holds the stores of one setting"
            fixes.append("pass --overwrite and give its slide too, to re-tile it with these settings")
        else:
            more = " ..." if len(theirs) > 5 else ""
            if len(theirs) == n:
                whose, slides_of = "none of their slides is", "their slides"
            else:
                whose = f"the slide{'s' if len(theirs) > 1 else ''} of {len(theirs)} of them {'are' if len(theirs) > 1 else 'is'} not"
                slides_of = "the slides of the stores not in this run"
            what += f"; {whose} in this run ({', '.join(theirs[:5])}{more}), but one folder holds the stores of one setting"
            fixes.append(f"pass --overwrite and give {slides_of} too, to re-tile them with these settings")
        if formats:
            more = " ..." if len(formats) > 5 else ""
            if n == 1:
                what += f"; it is not in this run's format ({config.format})"
            elif len(formats) == n:
                what += f"; none of them is in this run's format ({config.format})"
            else:
                what += f"; {len(formats)} of them {'is' if len(formats) == 1 else 'are'} not in this run's format ({config.format}: {', '.join(formats[:5])}{more})"
            fixes.append(f"move the {Path(formats[0]).suffix} store{'s' if len(formats) > 1 else ''} to another folder")
        raise StoreError(f"{what}. Fix: write to a new folder with --out, or {' and '.join(fixes)}.")
    kept = {p: differ[p] for p in others}
    if kept and not keep_other_stores:
        formats = any(p.suffix != suffix for p in kept)
        slides_out = any(p.suffix == suffix for p in kept)
        whose = " or ".join(w for w, yes in (("of slides not in this run", slides_out),
                                             (f"not in this run's format ({config.format})", formats)) if yes)
        fix = "re-tile their slides with --overwrite too, or move them" if slides_out and not formats else "move them"
        logger.warning("%s: %d store(s) %s were made with other settings and stay as they are: %s; %s lists them "
                       "under 'stores_with_other_settings'. Fix: %s to another folder.", out_dir, len(kept), whose,
                       _describe_stores(kept), CONFIG_FILENAME, fix)
    return sorted(p.name for p in kept)


@dataclass
class _Buffer:
    coords: list[np.ndarray] = field(default_factory=list)
    entropy: list[np.ndarray] = field(default_factory=list)
    tissue: list[np.ndarray] = field(default_factory=list)
    patches: list[Any] = field(default_factory=list)
    n: int = 0
    nbytes: int = 0

    def add(self, coords, entropy, tissue, payload, nbytes: int) -> None:
        self.coords.append(coords)
        self.entropy.append(entropy)
        self.tissue.append(tissue)
        if payload is not None:
            self.patches.append(payload)
        self.n += len(coords)
        self.nbytes += nbytes

    def flush(self, writer, pixels: str) -> None:
        if self.n == 0:
            return
        if pixels == "jpeg":
            patches: Any = [b for chunk in self.patches for b in chunk]
        elif pixels == "raw":
            patches = np.concatenate(self.patches)
        else:
            patches = None
        writer.append(coords=np.concatenate(self.coords), entropy_bits=np.concatenate(self.entropy),
                      tissue_fraction=np.concatenate(self.tissue), patches=patches)
        self.__init__()


def _slide_error(exc: BaseException, slide_path: str | os.PathLike) -> str:
    """The status CSV's error for a slide: a project error's own message (it names the file and the
    fix), else the exception named with the slide file it happened on."""
    if isinstance(exc, WsiMilsslError):
        return str(exc)
    return f"{slide_path}: {type(exc).__name__}: {exc}"


def tile_slide(slide_path: str | os.PathLike, out_dir: str | os.PathLike, config: TileConfig, *,
               overwrite: bool = False, progress: ProgressCallback | None = None) -> TileResult:
    """Tile one slide into ``out_dir/<stem>.<format>`` and its QC PNG; returns its TileResult.

    A feature file where the store goes (of this project, TRIDENT or CLAM) raises FeatureFileGivenError
    (:func:`feature_file_error`), with or without ``overwrite``. Skips (status 'skipped') when a
    complete store with the same settings, cut from this very slide
    file (same resolved path, size and modification time: see :func:`check_existing_store`), exists,
    unless ``overwrite``; a store of another or a changed slide file is replaced. Raises
    SlideReadError / MissingResolutionError / StoreError on bad input; the partial store is deleted on
    any error.
    """
    t0 = time.perf_counter()
    slide_path = Path(slide_path)
    out_dir = Path(out_dir)
    stem = slide_stem(slide_path)
    too_long = stem_too_long(stem)
    if too_long:  # the first stage to meet the name: later ones would fail on their longer file names
        raise OutputError(f"{slide_path}: {too_long}.", errno=errno.ENAMETOOLONG)
    final = store_path(out_dir, stem, config.format)
    # taken before any pixel is read: a slide rewritten while it is tiled is tiled again next time
    fingerprint = _slide_fingerprint_attrs(slide_path)
    features = feature_file_error([final])  # never replaced, even with --overwrite
    if features is not None:
        raise features
    if not overwrite:
        n_existing = check_existing_store(final, config, slide_path=slide_path)
        if n_existing is not None:
            return TileResult(stem, str(slide_path), "skipped", n_existing, time.perf_counter() - t0, "", str(final))

    plan = config.tiling_plan()
    with open_slide(slide_path, mpp_override=config.slide_mpp) as slide:
        cells = plan_slide(slide, plan)
        slide_mpp = slide.mpp
        own = slide.metadata_mpp if config.slide_mpp is not None else None
        if own is not None and abs(own - slide_mpp) > 0.01 * own:  # review CX: it overrode the slide without a word
            logger.warning("%s: --slide-mpp %.4g µm/px overrides the slide's own %.4g µm/px (its metadata): the "
                           "patches cover %.3gx the area they would. Fix: drop --slide-mpp (slide_mpp in [tile]) for "
                           "slides that record their resolution, unless that record is wrong.", stem, slide_mpp, own,
                           (own / slide_mpp) ** 2)
        geometry, tissue = cells.geometry, cells.tissue
        cand_coords = cells.coords_lv0
        cand_fraction = cells.tissue_fraction
        logger.info("%s: %d grid cells, %d with tissue >= %.2f; level %d (downsample %.3f), patch %d lv0 px",
                    stem, cells.n_grid, cells.n_candidates, plan.min_tissue, geometry.level,
                    geometry.level_downsample, geometry.patch_size_lv0)

        coords_attrs = {
            "patch_size": geometry.patch_size_level,
            "patch_level": geometry.level,
            "downsample": [geometry.level_downsample, geometry.level_downsample],
            "level_dim": list(geometry.level_dimensions),
            "patch_size_level0": geometry.patch_size_lv0,
            "target_magnification": float(geometry.target_magnification),
            "level0_magnification": float(mpp_to_magnification(slide_mpp)),
            "overlap": max(0, plan.patch_size_px - plan.stride_px),
            "name": stem,
        }
        need = estimate_store_bytes(cells.n_candidates, pixels=config.pixels, patch_size_px=plan.patch_size_px,
                                    jpeg_quality=config.jpeg_quality)
        check_free_space(final, int(need * _FREE_SPACE_FACTOR) + _FREE_SPACE_MARGIN,
                         what=f"this store ({cells.n_candidates} candidate patches)")
        bands = list(cells.bands)
        source = open_band_source(slide, geometry, bands, plan=plan)
        pixels = config.pixels
        quality = config.jpeg_quality

        def process(band: Band):
            cut = cut_band(slide, band, geometry, plan=plan, source=source)
            if pixels == "jpeg":
                payload = [encode_jpeg(p, quality=quality) for p in cut.patches]
                nbytes = sum(len(b) for b in payload)
            elif pixels == "raw":
                payload = cut.patches
                nbytes = payload.nbytes
            else:
                payload, nbytes = None, 0
            return cut, payload, nbytes

        kept_chunks: list[np.ndarray] = []
        dropped_chunks: list[np.ndarray] = []
        buffer = _Buffer()
        done = 0
        total = len(cand_coords)
        emit(progress, ProgressEvent("tile-patches", 0, total, unit="patch", item=stem))
        with create_writer(final, pixels=pixels, patch_size_px=config.patch_size_px,
                           coords_attrs=coords_attrs) as writer, _closing(source):
            for cut, payload, nbytes in ordered_map(process, bands, threads=config.threads):
                kept_idx = cut.indices
                kept_chunks.append(cand_coords[kept_idx])
                dropped_chunks.append(cand_coords[cut.dropped_indices])
                if len(kept_idx):
                    buffer.add(cand_coords[kept_idx], cut.entropy_bits[cut.keep].astype(np.float32),
                               cand_fraction[kept_idx], payload, nbytes)
                if buffer.n >= config.batch_size or buffer.nbytes >= _FLUSH_BYTES:
                    buffer.flush(writer, pixels)
                done += cut.n_read
                emit(progress, ProgressEvent("tile-patches", done, total, unit="patch", item=stem))
            buffer.flush(writer, pixels)

            kept = np.concatenate(kept_chunks) if kept_chunks else np.zeros((0, 2), np.int64)
            dropped = np.concatenate(dropped_chunks) if dropped_chunks else np.zeros((0, 2), np.int64)
            qc_thumb = _qc_thumbnail(slide, tissue.thumbnail)
            w0, h0 = slide.dimensions
            qc = render_qc(qc_thumb, downsample_xy=(w0 / qc_thumb.shape[1], h0 / qc_thumb.shape[0]),
                           mask=None if plan.tissue == "none" else tissue.mask,
                           kept_lv0=kept, dropped_lv0=dropped, patch_size_lv0=geometry.patch_size_lv0)
            write_qc_png(qc, qc_path(out_dir, stem))

            settings = config.settings()
            attrs = {
                "package_version": __version__,
                **{k: v for k, v in fingerprint.items() if v is not None},
                "slide_stem": stem,
                "dimensions_lv0": list(slide.dimensions),
                "mpp": float(slide_mpp),
                "mpp_source": slide.mpp_source,
                "target_mpp": float(geometry.target_mpp),
                "target_magnification": float(geometry.target_magnification),
                "patch_size_px": geometry.patch_size_px,
                "patch_size_lv0": geometry.patch_size_lv0,
                "patch_size_level": geometry.patch_size_level,
                "stride_px": geometry.stride_px,
                "stride_lv0": geometry.stride_lv0,
                "grid_origin_lv0": [0, 0],
                "level": geometry.level,
                "level_downsample": geometry.level_downsample,
                "pixels": pixels,
                "jpeg_quality": quality,
                "entropy_threshold_bits": plan.entropy_threshold_bits,
                "tissue_detector": plan.tissue,
                "min_tissue": plan.min_tissue,
                "mask_mpp": plan.mask_mpp,
                "n_grid": cells.n_grid,
                "n_candidates": int(total),
                "settings": dumps_settings(settings),
                "config_hash": config.settings_hash(),
                PLAN_ATTR: plan.to_json(),
            }
            writer.finalize(attrs)
    n_kept = int(len(kept))
    if cells.n_grid == 0:
        logger.warning("%s: the slide (%d x %d px at level 0, %.4g µm/px) is smaller than one patch at the chosen "
                       "resolution (%d px at %.4g µm/px cover %d x %d level-0 px), so no grid cell fits in it; the "
                       "store is empty.", stem, w0, h0, slide_mpp, plan.patch_size_px, geometry.target_mpp,
                       geometry.patch_size_lv0, geometry.patch_size_lv0)
    elif n_kept == 0:
        logger.warning("%s: no patch passed the tissue and entropy filters; the store is empty.", stem)
    return TileResult(stem, str(slide_path), "ok", n_kept, time.perf_counter() - t0, "", str(final))


@contextmanager
def _closing(source):
    try:
        yield source
    finally:
        if source is not None:
            source.close()


def _qc_thumbnail(slide, mask_thumbnail: np.ndarray) -> np.ndarray:
    """RGB uint8 thumbnail for the QC image: the tissue-mask thumbnail when it is large enough
    (shrunk to at most _QC_MAX_PX), else a new one of up to _QC_MIN_PX."""
    from PIL import Image

    h, w = mask_thumbnail.shape[:2]
    if max(h, w) < _QC_MIN_PX and max(slide.dimensions) > max(h, w):
        thumb, _ = slide.thumbnail(max_size_px=min(_QC_MIN_PX, max(slide.dimensions)))
        return thumb
    if max(h, w) > _QC_MAX_PX:
        scale = _QC_MAX_PX / max(h, w)
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
        return np.asarray(Image.fromarray(mask_thumbnail).resize(size, Image.Resampling.BOX))
    return mask_thumbnail


def _tile_one_safely(slide_path: str, out_dir: str, config: TileConfig, overwrite: bool,
                     progress: ProgressCallback | None = None) -> TileResult:
    """tile_slide that turns any error into a 'failed' TileResult (runs in worker processes)."""
    t0 = time.perf_counter()
    try:
        return tile_slide(slide_path, out_dir, config, overwrite=overwrite, progress=progress)
    except Exception as exc:  # noqa: BLE001 - one bad slide must not stop the others
        if not isinstance(exc, WsiMilsslError):
            logger.debug("unexpected error on %s:\n%s", slide_path, traceback.format_exc())
        message = _slide_error(exc, slide_path)
        logger.info("%s: failed: %s", slide_path, message)
        return TileResult(slide_stem(slide_path), str(slide_path), "failed", 0, time.perf_counter() - t0,
                          message, "")


@dataclass(frozen=True)
class TileRun:
    """Outcome of :func:`tile_slides`: per-slide results (input order; this shard's slides) and the
    files written."""

    results: tuple[TileResult, ...]
    status_csv: Path
    config_json: Path

    @property
    def n_failed(self) -> int:
        return sum(r.status == "failed" for r in self.results)

    @property
    def ok(self) -> bool:
        return self.n_failed == 0


def _write_config(out_dir: Path, config: TileConfig, other_settings: list[str]) -> Path:
    """``tile_config.json``: the config, its hashed settings and hash, and the stores in the folder it does
    not describe (``stores_with_other_settings``: stores of other slides made with other settings)."""
    data = {"tile": config_to_dict(config), "settings": config.settings(), "config_hash": config.settings_hash(),
            "package_version": __version__, "stores_with_other_settings": other_settings}
    return atomic_write_json(out_dir / CONFIG_FILENAME, data, sort_keys=True)


def tile_slides(slides: Iterable[str | os.PathLike], out_dir: str | os.PathLike, config: TileConfig, *,
                overwrite: bool = False, progress: ProgressCallback | None = None,
                shard: tuple[int, int] | Shard = (0, 1), keep_other_stores: bool = False) -> TileRun:
    """Tile every slide into ``out_dir`` with ``config.workers`` processes.

    ``shard`` = (I, N): tile only shard I of N of the slides (:func:`wsi_milssl.distributed.shard_items`:
    the slides whose stem hashes to I, so shards given different lists never tile a slide twice; a
    :class:`~wsi_milssl.distributed.Shard` with ``by='position'``, torchrun's ranks: every N-th slide
    from the I-th).

    Holds the lock of ``out_dir`` for the whole run (as shard I of N: together with the other shards):
    while another run holds it, FolderLockedError (naming the folder and the other run's pid); an
    output folder that cannot be written, OutputError. Before any work, every store in ``out_dir`` (in
    either format) is checked: a feature file where a store would go raises FeatureFileGivenError naming
    it, with or without ``overwrite`` (:func:`feature_file_error`); then (:func:`check_folder_settings`)
    stores made with other settings raise
    one StoreError, unless ``overwrite`` (then those of other slides and those in the other format stay,
    with a warning, and ``tile_config.json`` lists them); ``keep_other_stores``: those are kept without a
    word (the pipeline). The check and ``tile_config.json`` (the same from every shard) are done before
    the first slide under the folder's mutex, one shard at a time: a shard (without ``overwrite``) whose
    settings differ from the ``tile_config.json`` already there (of a shard started with it, before any
    store exists) raises StoreError naming both. Slides that fail
    (including a missing file, a folder named like a slide, a full disk) are recorded as 'failed' in
    ``out_dir/tile_status.csv`` (its row added after each slide, rows of other slides kept, sorted by
    slide) while the others finish. Also writes ``qc/<stem>.png`` per slide. From before the first slide
    until this run (shard) has done its last, the folder holds its mark of an unfinished run
    (:func:`~wsi_milssl.tiling.status.marking_unfinished`): a run that stops in any way leaves it.
    Returns a :class:`TileRun` (``results``: one TileResult per slide of this shard, ``ok``, ``n_failed``).
    """
    every = [Path(s) for s in path_list(slides)]  # every shard checks the stores of the whole run's slides
    slides = shard_items(every, *shard, name=slide_stem)
    out_dir = Path(out_dir)
    with folder_lock(out_dir, shard=shard):
        with folder_mutex(out_dir):  # one shard at a time: the first records the run's settings
            # while other shards of the run write here, their settings decide (their stores are no earlier
            # run's: --overwrite would mix two settings in one folder); else the stores of an earlier,
            # finished run with other settings get the unsharded run's error (--out or --overwrite)
            features = feature_file_error([store_path(out_dir, slide_stem(s), config.format) for s in every])
            if features is not None:  # before any slide is tiled, with or without --overwrite
                raise features
            sharded = shard[1] > 1 and not overwrite
            if sharded and other_shards_writing(out_dir, shard):
                _check_shard_settings(out_dir, config)
            other_settings = check_folder_settings(out_dir, every, config, overwrite=overwrite,
                                                   keep_other_stores=keep_other_stores)
            if sharded:
                _check_shard_settings(out_dir, config)
            config_json = _write_config(out_dir, config, other_settings)
        # marked unfinished until this run's last slide is done: `train` warns about a folder whose run stopped
        # (and clears the marks of stopped runs whose slides are all done now, whatever their shards)
        with marking_unfinished(out_dir, "tile", [slide_stem(s) for s in slides],
                                shard=(int(shard[0]), int(shard[1])) if shard[1] > 1 else None,
                                finished=lambda: finished_slides(out_dir)):
            return _tile_slides_locked(slides, out_dir, config, overwrite=overwrite, progress=progress,
                                       config_json=config_json)


def _check_shard_settings(out_dir: Path, config: TileConfig) -> None:
    """A shard's settings against those ``tile_config.json`` records (written by the first shard of the
    run before its first store, or by an earlier run): StoreError naming both when they differ, since
    shards started together with other settings would fill the folder with stores of two settings."""
    from wsi_milssl.locks import folder_settings_record

    path = out_dir / CONFIG_FILENAME
    recorded = folder_settings_record(path, error=StoreError)
    if not recorded or not (recorded.get("config_hash") or isinstance(recorded.get("settings"), (dict, str))):
        return  # none, not a JSON object or one without settings: nothing to compare with, as label and heatmap read it
    diffs = _settings_diffs(recorded, config)
    if diffs is not None:
        raise StoreError(f"{path}: this folder is tiled with other settings than this shard's ({diffs}); the "
                         "shards of one run must use the same settings. Fix: give this shard the settings of "
                         "the other shards, or write to a new folder with --out (or, when no other shard is "
                         "running, pass --overwrite to re-tile with these settings).")


def _tile_slides_locked(slides: list[Path], out_dir: Path, config: TileConfig, *, overwrite: bool,
                        progress: ProgressCallback | None, config_json: Path) -> TileRun:
    status_csv = out_dir / STATUS_FILENAME
    results: dict[int, TileResult] = {}
    total = len(slides)

    def record(i: int, result: TileResult) -> None:
        results[i] = result
        try:
            merge_status_csv([result], status_csv)
        except OutputError as exc:  # a full disk: the batch goes on; the final write reports it
            logger.warning("%s", exc)
        emit(progress, ProgressEvent("tile", len(results), total, unit="slide", item=result.slide,
                                     message=result.status))

    emit(progress, ProgressEvent("tile", 0, total, unit="slide"))
    if config.workers <= 1 or total <= 1:
        for i, s in enumerate(slides):
            record(i, _tile_one_safely(str(s), str(out_dir), config, overwrite, progress))
    else:
        _run_pool(slides, out_dir, config, overwrite, record, workers=min(config.workers, total))
    ordered = tuple(results[i] for i in range(total))
    merge_status_csv(ordered, status_csv)
    return TileRun(ordered, status_csv, config_json)


def _pool_context():
    """Fork on Linux (fast start; the parent holds no open slide or store at this point), else spawn."""
    if sys.platform.startswith("linux") and "fork" in get_all_start_methods():
        return get_context("fork")
    return get_context("spawn")


def _run_pool(slides: list[Path], out_dir: Path, config: TileConfig, overwrite: bool, record,
              *, workers: int) -> None:
    """Run slides on a process pool; slides caught in a crashed pool are retried alone, once.

    The workers end themselves when this process is gone (:func:`wsi_milssl.parent_watch.watch_parent`):
    forked, they hold the output folder's lock too, and after a kill -9 of this process they would run
    on and keep every later run out of the folder."""
    ctx = _pool_context()
    todo = list(range(len(slides)))
    retry: list[int] = []
    watch = {"initializer": watch_parent, "initargs": (os.getpid(),)}
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, **watch)
    try:
        futures = {pool.submit(_tile_one_safely, str(slides[i]), str(out_dir), config, overwrite): i for i in todo}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                i = futures[fut]
                try:
                    record(i, fut.result())
                except BrokenProcessPool:
                    retry.append(i)
    except BaseException:  # Ctrl-C or an error in the parent: drop queued slides, do not wait
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    for i in sorted(retry):
        t0 = time.perf_counter()
        try:
            with ProcessPoolExecutor(max_workers=1, mp_context=ctx, **watch) as pool:
                record(i, pool.submit(_tile_one_safely, str(slides[i]), str(out_dir), config, overwrite).result())
        except BrokenProcessPool:
            record(i, TileResult(
                slide_stem(slides[i]), str(slides[i]), "failed", 0, time.perf_counter() - t0,
                "the worker process died while tiling this slide (a crash in the slide library or out of "
                "memory). Fix: check the file opens with `wsi-milssl info`, or run with fewer --workers.",
            ))
