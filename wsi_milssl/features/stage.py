"""The feature stage: patch stores (or slides) -> a frozen encoder -> one feature file per slide.

    from wsi_milssl.config import FeaturesConfig
    from wsi_milssl.features import extract_features

    run = extract_features(["stores/"], "features/", FeaturesConfig(encoder="resnet50_trunc"))
    run.ok, run.status_csv          # features/features_status.csv

Patches go through the slide engine of the heatmap stage (:func:`wsi_milssl.inference.predict.run_slides`:
one pool of torch-free readers, chunks in shared memory, per-slide batches, outputs kept on the device),
so features come at the data-path speed of slide inference. Stores are read as they are; slides are cut
on the fly with a :class:`~wsi_milssl.tiling.TilingPlan` (a TileConfig's, else the stores' own), the
cells ``tile`` would keep.

The folder gets ``<stem>.h5`` per slide (:mod:`wsi_milssl.features.schema`), ``features_config.json``
(resolved settings, encoder, tiling plan, runtime) and ``features_status.csv``
(slide,status,n_patches,feature_dim,seconds,error,path; a slide's row added after it, rows of other slides
kept, sorted by slide). Status: 'ok',
'empty' (no patch: the file holds (0, D) features), 'skipped' (a file made with the same settings
from the same source is there) or 'failed'. Each file is written under a temporary name and renamed
when complete, so a killed run resumes where it stopped; until its last slide is done the folder holds a
hidden mark of the run (:func:`wsi_milssl.tiling.status.marking_unfinished`), so ``train`` on the
folder of a stopped run warns that slides are missing. A file made with other settings (another
encoder, weights, dtype, input size or precision), or from another slide file (a slide of the same
name elsewhere: test slides embedded into a training folder, say), is never replaced silently: files of
other settings stop the run before anything is written (ConfigError, so the folder's features_config.json
and status rows still describe its files), a file of another slide fails that slide, each with the fix
(``overwrite``, another folder or deleting the file; ``run`` replaces them in its own folders); a file whose source changed (a store tiled again, the same slide file changed) is
made again, and one whose store was labelled again gets the new labels in place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from wsi_milssl import __version__
from wsi_milssl.atomic import atomic_write_json, merge_csv_rows
from wsi_milssl.config.base import config_to_dict
from wsi_milssl.config.features import FeaturesConfig
from wsi_milssl.config.tile import TileConfig
from wsi_milssl.errors import ConfigError, OutputError, StoreError, WsiMilsslError
from wsi_milssl.events import ProgressCallback, ProgressEvent, emit
from wsi_milssl.features import schema
from wsi_milssl.features.encoders import Encoder
from wsi_milssl.locks import folder_lock
from wsi_milssl.paths import path_list
from wsi_milssl.runtime import restores_torch_settings
from wsi_milssl.tiling import PLAN_ATTR, TilingPlan
from wsi_milssl.tiling.status import marking_unfinished

__all__ = ["CONFIG_FILENAME", "STATUS_FILENAME", "STATUS_COLUMNS", "FeatureResult", "FeatureRun", "feature_inputs",
           "extract_features"]

logger = logging.getLogger(__name__)

CONFIG_FILENAME = "features_config.json"
STATUS_FILENAME = "features_status.csv"
STATUS_COLUMNS = ("slide", "status", "n_patches", "feature_dim", "seconds", "error", "path")
#: Feature files written by a thread while the encoder goes on; predictions that may wait for it.
_PENDING_WRITES = 3


@dataclass(frozen=True)
class FeatureResult:
    """What happened to one slide: ``status`` 'ok', 'empty', 'skipped' or 'failed' (``error`` says why);
    ``path`` the feature file (empty when failed)."""

    slide: str
    slide_path: str
    status: str
    n_patches: int
    feature_dim: int
    seconds: float
    error: str = ""
    path: str = ""


@dataclass(frozen=True)
class FeatureRun:
    """Outcome of :func:`extract_features`: per-slide results (input order), the folder's files and
    ``seconds`` from the first slide opened to the last file written."""

    results: tuple[FeatureResult, ...]
    out_dir: Path
    status_csv: Path
    config_json: Path
    seconds: float = 0.0

    @property
    def n_failed(self) -> int:
        return sum(r.status == "failed" for r in self.results)

    @property
    def ok(self) -> bool:
        return self.n_failed == 0

    @property
    def n_patches(self) -> int:
        """Patches embedded by this call (skipped slides not counted)."""
        return sum(r.n_patches for r in self.results if r.status in ("ok", "empty"))


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------

def feature_inputs(paths: Sequence[str | os.PathLike]):
    """Stores and slides from ``paths``: a store (``.h5`` file or ``.zarr`` folder), a folder holding
    stores (taken as stores), slide files, folders of slides or CSV lists. Returns
    :class:`~wsi_milssl.inference.predict.SlideInput` items (a store keeps the slide recorded in it).
    Raises ConfigError for a missing path, no input at all or two inputs with the same slide stem."""
    from wsi_milssl.inference.stage import match_inputs
    from wsi_milssl.store.schema import format_of

    stores: list[Path] = []
    slides: list[Path] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if not p.exists():
            raise ConfigError(f"{p}: no such store, slide or folder. Fix: check the path.")
        fmt = format_of(p)
        if (fmt == "h5" and p.is_file()) or (fmt == "zarr" and p.is_dir()):
            stores.append(p)
        elif p.is_dir() and any(format_of(c) is not None and not c.name.startswith(".") for c in p.iterdir()):
            stores.append(p)
        else:
            slides.append(p)
    if not stores and not slides:
        raise ConfigError("no inputs; pass patch stores (or folders of them) or slides.")
    items = (match_inputs([], stores) if stores else [])
    if slides:
        from wsi_milssl.tiling import find_slides

        items += match_inputs(find_slides(slides), None)
    seen: dict[str, Any] = {}
    for item in items:
        if item.stem in seen:
            raise ConfigError(f"{seen[item.stem].store_path or seen[item.stem].slide_path} and "
                              f"{item.store_path or item.slide_path} are both slide {item.stem!r}, so their feature "
                              "files would collide. Fix: pass one of them.")
        seen[item.stem] = item
    return items


@dataclass
class _Source:
    """What one input's features come from: the store's attributes (None for a slide), its coords
    attributes, whether it holds instance labels, and the fingerprint that decides reuse."""

    attrs: dict[str, Any] | None
    coords_attrs: dict[str, Any]
    has_labels: bool
    fingerprint: dict[str, Any]
    error: str = ""


def _read_store(path: Path) -> _Source:
    from wsi_milssl.store import open_store

    try:
        with open_store(path) as store:
            attrs = dict(store.attrs)
            coords_attrs = dict(store.array_attrs("coords"))
            has_labels = store.has(schema.INSTANCE_LABEL)
            n = len(store)
    except WsiMilsslError as exc:
        return _Source(None, {}, False, {}, error=str(exc))
    plain = {k: v.item() if isinstance(v, np.generic) else v for k, v in attrs.items()}
    # whether the store has labels, not the labels themselves: a store labelled again keeps its features,
    # and a kept file's labels are brought up to date (_refresh_labels)
    fingerprint = {"store_config_hash": plain.get("config_hash"), "n_patches": n, "instance_label": has_labels}
    # the slide file the store was cut from (stores of earlier versions do not record it): a store tiled
    # again from a changed slide, with the same settings and patch count, is not the same source
    fingerprint.update({k: plain[k] for k in ("slide_path", "slide_size_bytes", "slide_mtime_ns") if k in plain})
    return _Source(plain, coords_attrs, has_labels, fingerprint)


def _slide_fingerprint(path: Path | None, plan: TilingPlan, slide_mpp: float | None) -> dict[str, Any]:
    try:
        st = path.stat() if path is not None else None
    except OSError:
        st = None
    return {"slide": None if path is None else str(path.resolve()), "size": None if st is None else st.st_size,
            "mtime_ns": None if st is None else st.st_mtime_ns, "plan": plan.to_dict(), "slide_mpp": slide_mpp}


def _choose_plan(store_attrs: list[dict[str, Any]], tile: TileConfig | None) -> TilingPlan:
    """The tile recipe for slides cut on the fly (and the resolution every store must have): ``tile``'s,
    else the recorded plan of the stores of the most common resolution and patch size (older stores:
    their separate attributes), else the tile stage's defaults."""
    if tile is not None:
        return tile.tiling_plan()
    keys = [(attrs.get("target_mpp"), attrs.get("patch_size_px")) for attrs in store_attrs]
    if keys:
        common = max(keys, key=keys.count)
        store_attrs = [a for a, k in zip(store_attrs, keys) if k == common]
    for attrs in store_attrs:
        if attrs.get(PLAN_ATTR):
            try:
                return TilingPlan.from_json(str(attrs[PLAN_ATTR]), source=f"{attrs.get('slide_stem')}: {PLAN_ATTR}")
            except ConfigError as exc:
                raise StoreError(str(exc)) from None
    if store_attrs:
        from wsi_milssl.inference.model import plan_from_checkpoint_config

        attrs = store_attrs[0]
        return plan_from_checkpoint_config({"target_mpp": attrs.get("target_mpp"),
                                            "patch_size_px": attrs.get("patch_size_px"), "store_settings": attrs},
                                           source=str(attrs.get("slide_stem")))
    return TileConfig().tiling_plan()


# ----------------------------------------------------------------------------------------------
# Settings and reuse
# ----------------------------------------------------------------------------------------------

def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _settings(config: FeaturesConfig, encoder: Encoder, model) -> dict[str, Any]:
    """What decides the features' values (runtime settings that only change speed are left out)."""
    amp = model.runtime.amp_dtype
    return {"encoder": encoder.name, "encoder_kwargs": dict(encoder.kwargs),
            "encoder_weights_sha256": encoder.weights_sha256 or "random", "dtype": config.dtype,
            "input_size_px": int(model.input_size_px or model.plan.patch_size_px),
            "amp": "off" if amp is None else str(amp).replace("torch.", "")}


def _slide_of(item, src: "_Source | None") -> tuple[str | None, int | None]:
    """(resolved path, size in bytes) of the slide file an input comes from: a slide's own, or the one its
    store records (also when that file is gone); (None, None) when unknown."""
    attrs = (src.attrs or {}) if src is not None else {}
    recorded = str(attrs.get("slide_path") or "")
    if item.slide_path is None and not recorded:
        return None, None
    path = str(Path(item.slide_path).resolve()) if item.slide_path is not None else recorded
    size = attrs.get("slide_size_bytes") if (recorded and Path(recorded).resolve() == Path(path)) else None
    if size is None:
        try:
            size = Path(path).stat().st_size
        except OSError:
            size = None
    return path, None if size is None else int(size)


def _check_existing(path: Path, settings: dict[str, Any], settings_hash: str, source_hash: str, *,
                    slide: tuple[str | None, int | None] = (None, None)) -> int | None:
    """Patches in a reusable file at ``path`` (same settings, same source), None when there is none or
    its source changed (the same slide file changed, or its store was made again: made again); StoreError
    with the fix when it was made with other settings, from another slide file than ``slide`` ((path, size
    in bytes) of the slide this input comes from: a slide of the same name elsewhere, :func:`_other_slide`),
    or is not a readable feature file of this project."""
    import h5py

    if not path.exists():
        return None
    try:
        with h5py.File(path, "r") as fh:
            attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in fh.attrs.items()}
    except OSError as exc:
        raise StoreError(f"{path}: a file is already there but cannot be read, so it looks damaged ({exc}). Fix: "
                         "delete that file (this slide alone is embedded again), or pass --overwrite (every slide "
                         "is embedded again), or write to a new folder with --out.") from None
    if attrs.get("schema") != schema.SCHEMA:
        raise StoreError(f"{path}: a file not made by `wsi-milssl features` is already there. Fix: write to a new "
                         "folder with --out (or pass --overwrite to replace it).")
    version_error = schema.schema_version_error(path, attrs)
    if version_error is not None:
        raise StoreError(version_error)
    made_from = str(attrs.get("slide_path") or "")
    recorded_size = attrs.get("slide_size_bytes")
    recorded_size = int(recorded_size) if isinstance(recorded_size, (int, np.integer)) and recorded_size >= 0 else None
    if (made_from and slide[0] is not None and recorded_size is None and not Path(made_from).exists()
            and not _same_file(Path(made_from), Path(slide[0]))):
        raise StoreError(
            f"{path}: these features were made by an earlier version, which did not record the size of their slide "
            f"file, and that file ({made_from}) is gone, so it cannot tell whether {slide[0]} is the same slide "
            "(moved) or another of the same name. Fix: delete that file if it is this slide's (it is embedded "
            "again), or pass --overwrite (every slide is embedded again), or write to a new folder with --out.")
    if made_from and slide[0] is not None and _other_slide((made_from, recorded_size), slide):
        raise StoreError(
            f"{path}: these features were made from another slide file, {made_from}, not {slide[0]} "
            f"(two slides named {path.stem!r}: a test set embedded into a training set's folder, say). Fix: write "
            "this slide's features to another folder with --out; if the other slide's features are no longer "
            "wanted, delete that file (or pass --overwrite, which embeds every slide again).")
    if attrs.get("settings_hash") != settings_hash:
        raise StoreError(f"{path}: these features were made with other settings ({_settings_diffs(attrs, settings)}). "
                         "Fix: write to a new folder with --out, or pass --overwrite to replace them.")
    if attrs.get("source_hash") != source_hash:
        logger.info("%s: its store or slide changed since; made again", path)
        return None
    return int(attrs.get("n_patches", 0))


def _settings_diffs(attrs: dict[str, Any], settings: dict[str, Any]) -> str:
    """What differs between a feature file's recorded settings (its ``settings`` attribute) and ``settings``."""
    try:
        old = json.loads(str(attrs.get("settings", "{}")))
    except ValueError:
        old = {}
    diffs = [f"{k} {old.get(k)!r} -> {settings.get(k)!r}" for k in sorted(set(old) | set(settings))
             if old.get(k) != settings.get(k)]
    return "; ".join(diffs) or "hash differs"


def _refuse_other_settings(paths: Sequence[Path], settings: dict[str, Any], settings_hash: str) -> None:
    """ConfigError when feature files of this project at ``paths`` were made with other settings (another encoder,
    resolution, ...): every slide would fail, and the run would first have rewritten the folder's
    features_config.json and status rows with settings that made none of its files (review AL, finding 3).
    Files that cannot be read or are not this project's are left to each slide's own check."""
    import h5py

    other: list[tuple[Path, str]] = []
    for path in paths:
        if not path.is_file():
            continue
        try:
            with h5py.File(path, "r") as fh:
                attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in fh.attrs.items()}
        except OSError:
            continue
        if attrs.get("schema") != schema.SCHEMA or attrs.get("settings_hash") in (None, settings_hash):
            continue
        other.append((path, _settings_diffs(attrs, settings)))
    if other:
        first, diffs = other[0]
        more = f" and {len(other) - 1} more" if len(other) > 1 else ""
        raise ConfigError(f"{first}{more}: feature files made with other settings ({diffs}) are in "
                          f"{first.parent}; nothing was written. Fix: write to a new folder with --out, or pass "
                          "--overwrite to replace them.")


def _other_slide(recorded: tuple[str, int | None], given: tuple[str, int | None]) -> bool:
    """Whether the slide a feature file records ((path, size in bytes; None: not recorded)) is another slide
    than ``given``: another path whose size differs (the sizes recorded, else of the files still there).
    The same slide moved or copied keeps its size, so its features are made again (its source changed);
    when a size cannot be known (a file of an earlier version whose slide is gone), it counts as another
    slide: refused rather than replaced silently."""
    (a, a_size), (b, b_size) = recorded, given
    if _same_file(Path(a), Path(b)):
        return False

    def size(path: str, known: int | None) -> int | None:
        if known is not None:
            return known
        try:
            return Path(path).stat().st_size
        except OSError:
            return None

    a_size, b_size = size(a, a_size), size(b, b_size)
    return a_size is None or b_size is None or a_size != b_size


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: the same resolved path, or one file reached twice (a hard
    link; both must exist)."""
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _refresh_labels(path: Path, store_path: Path) -> bool:
    """Bring the instance labels of the kept feature file ``path`` up to date with its store's (a store
    labelled again: the features are the same, the labels not). Compared read-only; written in place only
    when they differ, at the same length, so a file stays whole (a run killed in between leaves labels that
    the next run writes again). False when they cannot be updated in place (another length, none, or the
    file or store cannot be opened for it): the file is made again."""
    import h5py

    from wsi_milssl.store import open_store

    try:
        with open_store(store_path) as store:
            labels = np.asarray(store.read_array(schema.INSTANCE_LABEL), dtype=np.uint8)
        with h5py.File(path, "r") as fh:
            held = fh.get(schema.INSTANCE_LABEL)
            if held is None or held.shape != labels.shape:
                return False
            if np.array_equal(held[()], labels):
                return True
        with h5py.File(path, "r+") as fh:
            fh[schema.INSTANCE_LABEL][...] = labels
    except (OSError, WsiMilsslError) as exc:
        logger.info("%s: its labels cannot be updated in place (%s); made again", path, exc)
        return False
    logger.info("%s: instance labels updated from its store (labelled again)", path)
    return True


# ----------------------------------------------------------------------------------------------
# The stage
# ----------------------------------------------------------------------------------------------

@restores_torch_settings
def extract_features(inputs: Sequence[str | os.PathLike], out_dir: str | os.PathLike,
                     config: FeaturesConfig | None = None, *, tile: TileConfig | None = None,
                     encoder: Encoder | None = None, overwrite: bool = False, replace_other: bool = False,
                     progress: ProgressCallback | None = None) -> FeatureRun:
    """Embed every patch of every input with the encoder of ``config`` and write one feature file per slide.

    ``inputs``: stores, folders of stores, slides, folders of slides or CSV lists
    (:func:`feature_inputs`). ``tile``: how slides are cut on the fly (default: the stores' recorded
    plan, else TileConfig's defaults); every store must have that plan's resolution and patch size.
    ``encoder``: an :class:`~wsi_milssl.features.encoders.Encoder` to use instead of building
    ``config.encoder``. ``overwrite``: make every file again. ``replace_other``: keep the files made with
    these settings from the same source, and make again those made with other settings, from another
    slide file of the same name (or unreadable, or not feature files), which otherwise fail their slide
    (``run`` uses it for the folders it owns, so a re-run embeds only the slides whose store or settings
    changed). Raises ConfigError / CheckpointError before any slide for bad inputs, settings or weights;
    per-slide errors are recorded in ``features_status.csv`` (rows of other slides, from earlier runs, are
    kept) and the run goes on. Holds the lock of ``out_dir`` for the run
    (:func:`wsi_milssl.locks.folder_lock`): a second run into the folder is refused with FolderLockedError.
    Returns a :class:`FeatureRun` (one result per slide, the folder and its status CSV).
    """
    from wsi_milssl.inference.predict import prestart_readers

    config = config or FeaturesConfig()
    prestart_readers()  # the readers' fork server starts while the inputs are read and the encoder is built
    out_dir = Path(out_dir)
    with folder_lock(out_dir):
        return _extract_features(path_list(inputs), out_dir, config, tile=tile, encoder=encoder,
                                 overwrite=overwrite, replace_other=replace_other, progress=progress)


def _extract_features(inputs: Sequence[str | os.PathLike], out_dir: Path, config: FeaturesConfig, *,
                      tile: TileConfig | None, encoder: Encoder | None, overwrite: bool, replace_other: bool,
                      progress: ProgressCallback | None) -> FeatureRun:
    from wsi_milssl.features.model import load_feature_model
    from wsi_milssl.inference.predict import run_slides

    items = feature_inputs(inputs)
    sources: list[_Source | None] = [(_read_store(it.store_path) if it.store_path is not None else None) for it in items]
    plan = _choose_plan([s.attrs for s in sources if s is not None and s.attrs is not None], tile)
    for it in items:
        target = schema.feature_path(out_dir, it.stem)
        if it.store_path is not None and target.resolve() == Path(it.store_path).resolve():
            raise ConfigError(f"{it.store_path}: the feature file of this store would replace the store itself. Fix: "
                              "write features to another folder (--out).")
    model = load_feature_model(config, plan=plan, encoder=encoder)
    encoder = model.encoder
    settings = _settings(config, encoder, model)
    settings_hash = _digest(settings)
    if not overwrite and not replace_other:  # before anything is written: the config and status stay the files'
        _refuse_other_settings([schema.feature_path(out_dir, it.stem) for it in items], settings, settings_hash)
    out_dir.mkdir(parents=True, exist_ok=True)
    config_json = atomic_write_json(out_dir / CONFIG_FILENAME, {
        "features": config_to_dict(config), "encoder": encoder.describe(), "settings": settings,
        "settings_hash": settings_hash, "tiling_plan": plan.to_dict(), "runtime": model.runtime.describe(),
        "package_version": __version__}, sort_keys=True)
    # marked unfinished until the last slide is done: `train` warns about a folder whose run was stopped
    with marking_unfinished(out_dir, "features", [it.stem for it in items]):
        status_csv = out_dir / STATUS_FILENAME
        results: dict[int, FeatureResult] = {}

        def record(i: int, result: FeatureResult) -> None:
            results[i] = result
            try:
                _merge_status([result], status_csv)
            except OutputError as exc:  # a full disk: the next slide's feature file may fill it meanwhile
                logger.warning("%s: this slide's row is written with the others at the end (%s)", result.slide,
                               str(exc).split(" Fix:")[0])
            emit(progress, ProgressEvent("features", len(results), len(items), unit="slide", item=result.slide,
                                         message=result.status))

        def failed(i: int, message: str, seconds: float = 0.0) -> FeatureResult:
            logger.error("%s: failed: %s", items[i].stem, message)
            return FeatureResult(items[i].stem, str(items[i].slide_path or ""), "failed", 0, encoder.dim, seconds,
                                 message)

        emit(progress, ProgressEvent("features", 0, len(items), unit="slide"))
        todo: list[int] = []
        source_hashes: dict[int, str] = {}
        for i, (it, src) in enumerate(zip(items, sources)):
            if src is not None and src.error:
                record(i, failed(i, src.error))
                continue
            if src is not None:
                mismatch = _resolution_mismatch(it, src.attrs, plan, tile_given=tile is not None)
                if mismatch:
                    record(i, failed(i, mismatch))
                    continue
                fingerprint = src.fingerprint
            else:
                fingerprint = _slide_fingerprint(it.slide_path, plan, config.slide_mpp)
            source_hashes[i] = _digest(fingerprint)
            path = schema.feature_path(out_dir, it.stem)
            if not overwrite:
                try:
                    n = _check_existing(path, settings, settings_hash, source_hashes[i], slide=_slide_of(it, src))
                except StoreError as exc:
                    if not replace_other:
                        record(i, failed(i, str(exc)))
                        continue
                    logger.info("%s; made again", str(exc).split(" Fix:")[0])
                    n = None
                if n is not None and src is not None and src.has_labels and not _refresh_labels(path, it.store_path):
                    n = None  # labels of another length: made again
                if n is not None:
                    record(i, FeatureResult(it.stem, str(it.slide_path or ""), "skipped", n, encoder.dim, 0.0, "",
                                            str(path)))
                    continue
            todo.append(i)
        if len(todo) < len(items):
            logger.info("%s: %d of %d slides need features", out_dir, len(todo), len(items))

        def write(i: int, out) -> FeatureResult:
            t0 = time.perf_counter()
            it, src = items[i], sources[i]
            path = _write_slide(out_dir, it, src, out, model=model, settings=settings, settings_hash=settings_hash,
                                source_hash=source_hashes[i])
            status = "ok" if len(out) else "empty"
            if status == "empty":
                logger.warning("%s: no patch, so its feature file holds no rows", it.stem)
            return FeatureResult(it.stem, str(it.slide_path or ""), status, len(out), encoder.dim,
                                 out.seconds + time.perf_counter() - t0, "", str(path))

        writes: dict = {}

        def collect(block: bool) -> None:
            done, _ = wait(list(writes), timeout=None if block else 0, return_when=FIRST_COMPLETED)
            for fut in done:
                i, seconds = writes.pop(fut)
                try:
                    result = fut.result()
                except Exception as exc:  # noqa: BLE001 - one slide's file must not stop the others
                    record(i, failed(i, _message(items[i].stem, exc), seconds))
                    continue
                logger.info("%s: %d patches -> %s (%.1f s)", result.slide, result.n_patches, result.path,
                            result.seconds)
                record(i, result)

        t_start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="wsi-features-write") as writer:
            for j, outcome in run_slides([items[i] for i in todo], model, batch_size=config.batch_size,
                                         decode=config.decode, slide_mpp=config.slide_mpp, progress=progress,
                                         event="features-patches", owner="FeaturesConfig"):
                i = todo[j]
                if isinstance(outcome, Exception):
                    record(i, failed(i, _message(items[i].stem, outcome)))
                    continue
                writes[writer.submit(write, i, outcome)] = (i, outcome.seconds)
                collect(block=False)
                while len(writes) >= _PENDING_WRITES:
                    collect(block=True)
            while writes:
                collect(block=True)
        ordered = tuple(results[k] for k in range(len(items)))
        _merge_status(ordered, status_csv)
        return FeatureRun(ordered, out_dir, status_csv, config_json, seconds=time.perf_counter() - t_start)


def _message(stem: str, exc: BaseException) -> str:
    if isinstance(exc, WsiMilsslError):
        return str(exc)
    logger.debug("unexpected error on %s:\n%s", stem,
                 "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    return f"{type(exc).__name__}: {exc}"


def _resolution_mismatch(item, attrs: dict[str, Any], plan: TilingPlan, *, tile_given: bool = False) -> str:
    """Why the store of ``item`` (its attributes ``attrs``) cannot join this run's features of ``plan``'s
    resolution and patch size ('' when it can). ``tile_given``: the plan is the caller's tile settings
    (``features --magnification / --mpp / --patch-size / --tile-config``), which cut slides only."""
    try:
        target_mpp, patch = float(attrs.get("target_mpp")), int(attrs.get("patch_size_px"))
    except (TypeError, ValueError):
        return f"{item.store_path}: the store records no target_mpp / patch_size_px. Fix: tile the slide again."
    if abs(target_mpp - plan.target_mpp) > 1e-6 * plan.target_mpp or patch != plan.patch_size_px:
        if tile_given:
            return (f"{item.store_path}: tiled at {target_mpp:g} µm/px with {patch} px patches, but the tile settings "
                    f"given ({plan.target_mpp:g} µm/px, {plan.patch_size_px} px: --magnification / --mpp / "
                    "--patch-size / --tile-config) apply to slides cut on the fly only: a store is embedded as it was "
                    "tiled. Fix: drop those options to embed the stores as they are, or pass the slides instead of "
                    "their stores to cut them at that resolution (or tile them again with `wsi-milssl tile`).")
        return (f"{item.store_path}: tiled at {target_mpp:g} µm/px with {patch} px patches, but this run embeds "
                f"patches of {plan.target_mpp:g} µm/px and {plan.patch_size_px} px (one feature set, one resolution). "
                "Fix: extract features of stores tiled differently into another --out.")
    return ""


def _merge_status(results, path: Path) -> Path:
    """Add or replace the rows of ``results`` in ``features_status.csv``; rows of other slides (earlier
    runs) are kept, every row sorted by slide."""
    rows = [{"slide": r.slide, "status": r.status, "n_patches": r.n_patches, "feature_dim": r.feature_dim,
             "seconds": f"{r.seconds:.2f}", "error": " ".join(r.error.split()), "path": r.path} for r in results]
    return merge_csv_rows(path, rows, columns=STATUS_COLUMNS)


def _write_slide(out_dir: Path, item, src: _Source | None, out, *, model, settings: dict[str, Any],
                 settings_hash: str, source_hash: str) -> Path:
    """The feature file of one slide's engine output ``out`` (a SlideOutputs with (N, D) outputs)."""
    encoder = model.encoder
    dtype = schema.FEATURE_DTYPES[settings["dtype"]]
    if len(out) == 0:  # a slide without a tissue patch: an empty feature file (its heatmap is 'empty')
        feats = np.zeros((0, encoder.dim), dtype)
    else:
        feats = np.asarray(out.outputs).reshape(len(out), -1).astype(dtype, copy=False)
    bad_rows = schema.non_finite_rows(feats)
    if bad_rows.size:
        raise StoreError(f"{item.store_path or item.slide_path}: the encoder {encoder.name!r} (weights "
                         f"{encoder.weights}) gave NaN or infinite features in {bad_rows.size} of {len(feats)} patches, "
                         "so none was written. Fix: check those weights, or extract in float32 (--dtype float32 "
                         "--amp off) if half precision overflowed.")
    stem = item.stem
    labels = None
    if src is not None:
        coords_attrs = dict(src.coords_attrs)
        if src.has_labels:
            from wsi_milssl.store import open_store

            with open_store(item.store_path) as store:
                labels = np.asarray(store.read_array(schema.INSTANCE_LABEL), dtype=np.uint8)
            if labels.shape != (len(out),):
                labels = None
        attrs = src.attrs or {}
        tiling_plan = str(attrs.get(PLAN_ATTR) or "")
    else:
        coords_attrs = out.geometry.coords_attrs(name=stem) if out.geometry is not None else {"name": stem}
        tiling_plan = model.plan.to_json()
    coords_attrs.update(savetodir=str(out_dir.resolve()), level0_width=int(out.dimensions_lv0[0]),
                        level0_height=int(out.dimensions_lv0[1]))
    coords_attrs.setdefault("name", stem)
    slide_path = item.slide_path or out.slide_path
    slide_size = _slide_of(item, src)[1]
    root = {
        "schema": schema.SCHEMA, "schema_version": schema.SCHEMA_VERSION, "package_version": __version__,
        "slide_stem": stem, "slide_path": "" if slide_path is None else str(Path(slide_path).resolve()),
        "slide_size_bytes": -1 if slide_size is None else slide_size,
        "store_path": "" if item.store_path is None else str(Path(item.store_path).resolve()),
        "source": out.source, "encoder": encoder.name, "encoder_kwargs": json.dumps(dict(encoder.kwargs), sort_keys=True),
        "encoder_weights": encoder.weights, "encoder_weights_sha256": encoder.weights_sha256 or "",
        "feature_dim": int(encoder.dim), "feature_dtype": settings["dtype"],
        "input_size_px": int(settings["input_size_px"]),
        "normalisation": json.dumps({"mean": list(encoder.mean), "std": list(encoder.std)}),
        "n_patches": len(out), "mpp": float(out.mpp), "dimensions_lv0": [int(v) for v in out.dimensions_lv0],
        "target_mpp": float(out.target_mpp), "patch_size_px": int(out.patch_size_px),
        "patch_size_lv0": int(out.patch_size_lv0), "stride_lv0": int(out.stride_lv0),
        "grid_origin_lv0": [int(v) for v in out.origin_lv0], "grid_shape": [int(v) for v in out.grid_shape],
        "tissue_detector": str(out.tissue_detector), "mask_mpp": float(out.mask_mpp), "tiling_plan": tiling_plan,
        "settings": json.dumps(settings, sort_keys=True), "settings_hash": settings_hash, "source_hash": source_hash,
    }
    return schema.write_feature_file(
        schema.feature_path(out_dir, stem), features=feats, coords=out.coords_lv0, attrs=root,
        coords_attrs=coords_attrs, features_attrs={"name": stem, "savetodir": str(out_dir.resolve()),
                                                   "encoder": encoder.name},
        instance_label=labels)
