"""The feature-file contract: dataset names, dtypes and attributes (one place), writer and reader.

``docs/artifacts.md`` documents the same contract for people; keep both in step and bump
``SCHEMA_VERSION`` when a reader of the old layout would misread the new one.

One HDF5 file per slide, ``DIR/<slide_stem>.h5``, laid out as TRIDENT's ``extract_patch_features`` and
CLAM's ``extract_features_fp.py`` write theirs, so their tools (and this project's ``train``) read it
as it is:

=================  ===================  ========  ==================================================
name               dtype                shape     meaning
=================  ===================  ========  ==================================================
``features``       float32 or float16   (N, D)    the encoder's output for patch i
``coords``         int64                (N, 2)    level-0 top-left (x, y) of patch i, row-major
``instance_label`` uint8                (N,)      1 = tumour patch, copied from the store (optional;
                                                  evaluation only)
=================  ===================  ========  ==================================================

Attributes of ``features`` (TRIDENT's): ``name`` (slide stem), ``savetodir`` (the output folder),
``encoder``. Attributes of ``coords``: the store's CLAM/TRIDENT ``coords`` attributes (``patch_size``,
``patch_level``, ``downsample``, ``level_dim``, ``patch_size_level0``, ``target_magnification``,
``level0_magnification``, ``overlap``, ``name``) plus TRIDENT's ``savetodir``, ``level0_width`` and
``level0_height``. Root attributes (this project's; see :data:`ROOT_ATTRS`): provenance, the encoder,
and the grid the patches sit on, so heatmaps can be drawn from the file alone.

Files written by other tools are read too (:func:`read_feature_file`): TRIDENT's (features and coords
with their attributes, no root attributes), CLAM's (``features`` float32 and ``coords`` int32, no
attributes) and files with a ``bag_ids`` dataset holding several bags (the MIL CSV layout).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from wsi_milssl.errors import StoreError

log = logging.getLogger(__name__)

__all__ = [
    "FEATURE_FILE_SUFFIXES",
    "feature_files_in",
    "feature_files_of",
    "SCHEMA",
    "SCHEMA_VERSION",
    "SUFFIX",
    "FEATURES",
    "COORDS",
    "INSTANCE_LABEL",
    "BAG_IDS",
    "FEATURE_DTYPES",
    "FEATURES_ATTRS",
    "TRIDENT_COORDS_ATTRS",
    "ROOT_ATTRS",
    "FeatureFile",
    "GridLayout",
    "FEATURE_SETTING_KEYS",
    "PRECISION_KEYS",
    "RANDOM_WEIGHTS",
    "encoder_label",
    "encoders_differ",
    "settings_differences",
    "feature_path",
    "write_feature_file",
    "read_feature_file",
    "is_feature_file",
    "looks_like_hdf5",
    "damaged_message",
    "schema_version_error",
    "NOMINAL_SIZE_RATIO",
    "same_physical_size",
]

SCHEMA = "wsi-milssl-features"
SCHEMA_VERSION = 1
SUFFIX = ".h5"

FEATURES = "features"
COORDS = "coords"
INSTANCE_LABEL = "instance_label"
#: Several bags in one file (the MIL CSV layout): (N,) integer or string bag ids.
BAG_IDS = "bag_ids"

#: Feature dtypes a file may hold (as ``FeaturesConfig.dtype`` names them).
FEATURE_DTYPES: dict[str, np.dtype] = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16)}

#: Attributes of the ``features`` dataset, as TRIDENT writes them.
FEATURES_ATTRS: tuple[str, ...] = ("name", "savetodir", "encoder")
#: TRIDENT's ``coords`` attributes beyond the store's (``wsi_milssl.store.schema.COORDS_ATTRS``).
TRIDENT_COORDS_ATTRS: tuple[str, ...] = ("savetodir", "level0_width", "level0_height")

#: Root attributes written by the feature stage -> Python type.
ROOT_ATTRS: dict[str, type | tuple[type, ...]] = {
    "schema": str,  # SCHEMA
    "schema_version": int,
    "package_version": str,
    "slide_stem": str,
    "slide_path": str,  # "" when unknown
    "slide_size_bytes": int,  # the slide file's size when embedded; -1 when unknown (tells another slide of the same name)
    "store_path": str,  # "" when cut from the slide on the fly
    "source": str,  # store | slide
    "encoder": str,  # registry name, e.g. resnet50_trunc or timm:vit_large_patch16_224
    "encoder_kwargs": str,  # JSON
    "encoder_weights": str,  # the weights file, or "random"
    "encoder_weights_sha256": str,  # "" for random weights (settings then record RANDOM_WEIGHTS)
    "feature_dim": int,
    "feature_dtype": str,  # float32 | float16
    "input_size_px": int,  # patch side the encoder saw (after resizing; = patch_size_px without)
    "normalisation": str,  # JSON {"mean": [...], "std": [...]}
    "n_patches": int,
    "mpp": float,  # level-0 µm/px of the slide
    "dimensions_lv0": list,  # [width, height]
    "target_mpp": float,
    "patch_size_px": int,
    "patch_size_lv0": int,
    "stride_lv0": int,
    "grid_origin_lv0": list,  # [x, y]: patch (r, c) of the grid starts at origin + (c, r) * stride_lv0
    "grid_shape": list,  # [rows, cols]
    "tissue_detector": str,
    "mask_mpp": float,
    "tiling_plan": str,  # JSON of the tile recipe (wsi_milssl.tiling.TilingPlan), "" when unknown
    "settings": str,  # JSON of what decides the features (encoder, weights, dtype, input size, precision)
    "settings_hash": str,
    "source_hash": str,  # what the patches came from (store settings and size, or slide file and plan)
}


#: Two physical sizes (µm, or µm/px) count as the same where the larger is at most this factor of the
#: smaller: scanners label their level 0 by a nominal magnification ("40x" is 0.221 to 0.2527 µm/px;
#: CAMELYON16 holds 0.243 and about 0.226), so "20x" patches of 512 level-0 px are 113 to 129 µm on
#: slides of one cohort. Another magnification or a tiling level (a factor of 2 or more) is far beyond it.
NOMINAL_SIZE_RATIO = 1.2


def same_physical_size(a: float, b: float) -> bool:
    """Whether two positive sizes (µm) agree within :data:`NOMINAL_SIZE_RATIO` (nominal magnifications)."""
    return a > 0 and b > 0 and max(a, b) / min(a, b) <= NOMINAL_SIZE_RATIO


def feature_path(out_dir: str | os.PathLike, stem: str) -> Path:
    """``out_dir / <stem>.h5``: where the features of slide ``stem`` go."""
    return Path(out_dir) / f"{stem}{SUFFIX}"


def encoders_differ(a: tuple[str | None, str | None], b: tuple[str | None, str | None]) -> bool:
    """Whether two sets of features come from different encoders, given their (encoder name, weights
    SHA-256) pairs: the names differ where both record one, or the weights where both record a hash."""
    (name_a, sha_a), (name_b, sha_b) = a, b
    return bool(name_a and name_b and name_a != name_b) or bool(sha_a and sha_b and sha_a != sha_b)


#: What :attr:`FeatureFile.feature_settings` holds as ``encoder_weights_sha256`` for features of
#: ``--weights random``: one fixed, seeded initialisation (``wsi_milssl.features.encoders.RANDOM_SEED``), so
#: two random-weight runs of one encoder agree, and differ from every weights file.
RANDOM_WEIGHTS = "random"


#: What a feature file records that decides its values besides the patches themselves (see
#: :attr:`FeatureFile.feature_settings`): the files of one training set, its validation set and the test
#: features of a head must agree on each that both record.
FEATURE_SETTING_KEYS: tuple[str, ...] = ("settings_hash", "encoder", "encoder_weights_sha256", "encoder_kwargs",
                                         "feature_dtype", "input_size_px", "amp", "target_mpp", "patch_size_px")


#: Settings that change only the numerical precision of the same features (float16 storage, the encoder's
#: autocast): files that differ in them alone may be mixed (``amp = auto`` differs between machines).
PRECISION_KEYS: tuple[str, ...] = ("feature_dtype", "amp")


def settings_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """``['target_mpp 0.5 vs 1', ...]``: the :data:`FEATURE_SETTING_KEYS` that ``a`` and ``b`` (two
    :attr:`FeatureFile.feature_settings`) both record with different values (µm/px within 0.1 %), the
    precision aside (:data:`PRECISION_KEYS`); the settings hash (which covers the precision too) only when
    a file does not record a setting it covers (the encoder, its options and weights, the input size: a
    head trained on random-weight features by an earlier version records no weights) and the precision
    settings both record agree. Empty when they agree."""
    out = []
    for key in FEATURE_SETTING_KEYS:
        if key == "settings_hash" or key in PRECISION_KEYS or a.get(key) is None or b.get(key) is None:
            continue
        x, y = a[key], b[key]
        if key == "target_mpp":
            if not math.isclose(float(x), float(y), rel_tol=1e-3):
                out.append(f"target_mpp {float(x):g} vs {float(y):g} µm/px")
        elif x != y:
            width = 12 if key == "encoder_weights_sha256" else None
            out.append(f"{key} {str(x)[:width]} vs {str(y)[:width]}")
    covered = ("encoder", "encoder_kwargs", "encoder_weights_sha256", "input_size_px")
    unrecorded = any(a.get(k) is None or b.get(k) is None for k in covered)
    precision_differs = any(a.get(k) is not None and b.get(k) is not None and a[k] != b[k] for k in PRECISION_KEYS)
    if (not out and unrecorded and not precision_differs and a.get("settings_hash") and b.get("settings_hash")
            and a["settings_hash"] != b["settings_hash"]):
        out.append(f"settings_hash {a['settings_hash']} vs {b['settings_hash']}")
    return out


def non_finite_rows(features: np.ndarray) -> np.ndarray:
    """The indices of the rows of (N, D) ``features`` that hold NaN or infinity."""
    return np.flatnonzero(~np.isfinite(features).all(axis=1)) if features.size else np.zeros(0, np.int64)


def _beyond_float32_rows(features: np.ndarray) -> np.ndarray:
    """The indices of the rows of (N, D) ``features`` (finite, of a dtype wider than float32) with a value
    that float32 cannot hold (it becomes infinite there); none for float32 and float16."""
    if features.dtype.itemsize <= 4 or not features.size:
        return np.zeros(0, np.int64)
    with np.errstate(over="ignore"):
        return np.flatnonzero(np.isinf(features.astype(np.float32)).any(axis=1))


def _instance_labels(path: Path, values: np.ndarray) -> np.ndarray:
    """``instance_label`` as uint8, after checking it holds 0 (normal) and 1 (tumour) only: a value such as
    -1 ('unknown' in some tools) or 255 has no meaning here, and as uint8 it would count as tumour."""
    if values.dtype.kind not in "biuf":
        raise StoreError(f"{path}: 'instance_label' must be numbers 0 (normal) or 1 (tumour); got dtype "
                         f"{values.dtype}.")
    bad = np.flatnonzero(~np.isin(values.reshape(-1), (0, 1)))
    if bad.size:
        found = np.unique(values.reshape(-1)[bad])
        shown = ", ".join(f"{v:g}" for v in found[:5].tolist()) + (", ..." if found.size > 5 else "")
        raise StoreError(f"{path}: 'instance_label' must hold 0 (normal) or 1 (tumour); found [{shown}] in "
                         f"{bad.size} of {values.size} rows (first: row {int(bad[0])}). Fix: write 1 for tumour "
                         "patches and 0 for the others (a patch of unknown label has no value here), or leave the "
                         "dataset out (it is for evaluation only).")
    return values.astype(np.uint8)


def encoder_label(name: str | None, sha256: str | None) -> str:
    """``'resnet50_trunc weights 0123456789ab'``: an encoder and its weights (``random`` for random weights), for
    messages."""
    weights = ("random weights" if sha256 == "random" else f"weights {sha256[:12]}" if sha256 else "weights unknown")
    name = name if name is None or len(str(name)) <= 80 else f"{str(name)[:77]}..."  # (a 50 MB attribute: review ES)
    return f"{name or 'encoder unknown'} {weights}"


def _h5_attr(value: Any) -> Any:
    if value is None:
        return "None"  # as TRIDENT writes a None
    if isinstance(value, Mapping):
        return json.dumps(dict(value), sort_keys=True)
    if isinstance(value, (list, tuple)):
        return np.asarray(value)
    return value


def write_feature_file(path: str | os.PathLike, *, features: np.ndarray, coords: np.ndarray,
                       attrs: Mapping[str, Any], coords_attrs: Mapping[str, Any],
                       features_attrs: Mapping[str, Any], instance_label: np.ndarray | None = None) -> Path:
    """Write one slide's feature file atomically (temporary name in the same folder, fsync, rename).

    ``features`` float32/float16 (N, D), ``coords`` int (N, 2) level-0 top-left; ``instance_label`` uint8
    (N,) or None. Datasets are resizable along N, as TRIDENT's and CLAM's (their tools append to them).
    Raises ValueError for inconsistent shapes or dtypes; a full disk, a file-size limit or a read-only
    folder raise OutputError naming the file and the fix (HDF5 writes through the store writer's
    fail-safe file, so a failed write never leaves HDF5 with a file it cannot close: a segfault).
    """
    from wsi_milssl.atomic import atomic_open
    from wsi_milssl.store.h5_store import FailSafeFile
    import h5py

    features = np.asarray(features)
    coords = np.asarray(coords, dtype=np.int64).reshape(-1, 2)
    if features.ndim != 2 or features.dtype not in FEATURE_DTYPES.values():
        raise ValueError(f"features must be float32 or float16 (N, D); got {features.dtype} {features.shape}.")
    n, dim = features.shape
    if len(coords) != n:
        raise ValueError(f"features have {n} rows but coords {len(coords)}.")
    if instance_label is not None and np.asarray(instance_label).shape != (n,):
        raise ValueError(f"instance_label must have shape ({n},); got {np.asarray(instance_label).shape}.")
    rows = max(1, min(n, 256))
    path = Path(path)
    with atomic_open(path, "wb") as tmp:
        fh = FailSafeFile(tmp.name, "r+b")  # atomic_open's temporary: it fsyncs, renames or removes it
        try:
            with h5py.File(fh, "w") as f:
                ds = f.create_dataset(FEATURES, data=features, maxshape=(None, dim), chunks=(rows, max(1, dim)))
                for key, value in features_attrs.items():
                    ds.attrs[key] = _h5_attr(value)
                ds = f.create_dataset(COORDS, data=coords, maxshape=(None, 2), chunks=(rows, 2))
                for key, value in coords_attrs.items():
                    ds.attrs[key] = _h5_attr(value)
                if instance_label is not None:
                    f.create_dataset(INSTANCE_LABEL, data=np.asarray(instance_label, dtype=np.uint8),
                                     maxshape=(None,), chunks=(rows,))
                for key, value in attrs.items():
                    f.attrs[key] = _h5_attr(value)
            fh.check()
        except Exception:
            if fh.error is not None:
                raise fh.error from None  # the failed write itself, not HDF5's report of it
            raise
        finally:
            fh.close()
    return path


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


#: the most cells of one slide's map (a 10^6 x 10^6 px slide cut into 64-px patches has 2.4e8)
MAX_GRID_CELLS = 1 << 28


@dataclass(frozen=True)
class GridLayout:
    """The regular grid a slide's patches sit on (what a probability map needs): level-0 ``origin_lv0``,
    ``stride_lv0`` and ``patch_size_lv0``, ``grid_shape`` (rows, cols), ``dimensions_lv0`` (width,
    height), level-0 ``mpp``, and where each fact came from (``notes``, for logs)."""

    origin_lv0: tuple[int, int]
    stride_lv0: int
    patch_size_lv0: int
    grid_shape: tuple[int, int]
    dimensions_lv0: tuple[int, int]
    mpp: float
    target_mpp: float
    patch_size_px: int
    notes: tuple[str, ...] = ()


@dataclass
class FeatureFile:
    """One feature file as read: ``features`` (N, D) as stored, ``coords`` int64 (N, 2) or None,
    ``instance_label`` uint8 (N,) or None, ``bag_ids`` (N bag names) for a file of several bags, else
    None, and the attributes of the root, ``features`` and ``coords``."""

    path: Path
    stem: str
    features: np.ndarray
    coords: np.ndarray | None
    instance_label: np.ndarray | None = None
    bag_ids: list[str] | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    features_attrs: dict[str, Any] = field(default_factory=dict)
    coords_attrs: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.features.shape[0])

    @property
    def encoder(self) -> str | None:
        """The encoder that made the features (root ``encoder`` or TRIDENT's ``features.attrs['encoder']``)."""
        value = self.attrs.get("encoder") or self.features_attrs.get("encoder")
        return None if value in (None, "", "None") else str(value)

    @property
    def encoder_weights_sha256(self) -> str | None:
        """The SHA-256 of the encoder's weights file (this project's files; None for random weights and
        for TRIDENT's and CLAM's files)."""
        return str(self.attrs.get("encoder_weights_sha256") or "") or None

    @property
    def feature_settings(self) -> dict[str, Any]:
        """What decides these features' values besides the patches, as far as the file records it
        (:data:`FEATURE_SETTING_KEYS`; a key is left out when unknown): this project's files record all
        of them (``settings_hash`` covers the encoder, its arguments and weights, the dtype, the input
        size and the precision; not the resolution, hence ``target_mpp`` and ``patch_size_px``);
        TRIDENT's the encoder and the resolution (from ``coords``' ``target_magnification`` and
        ``patch_size``); CLAM's nothing (its ``patch_size`` is at ``patch_level``: a level-0 size with
        ``downsample``, :func:`clam_patch_size_lv0`, compared as a physical size when mapped). Random weights, whose ``encoder_weights_sha256`` attribute is
        '', count as the weights :data:`RANDOM_WEIGHTS` (another encoder than any weights file)."""
        a, c = self.attrs, self.coords_attrs
        out: dict[str, Any] = {"settings_hash": str(a.get("settings_hash") or "") or None, "encoder": self.encoder,
                               "encoder_weights_sha256": self.encoder_weights_sha256 or self._random_weights(),
                               "feature_dtype": str(a.get("feature_dtype") or "") or None,
                               "input_size_px": _first_int(a.get("input_size_px"))}
        for key, attr in (("encoder_kwargs", a.get("encoder_kwargs")), ("amp", a.get("settings"))):
            try:
                value = json.loads(str(attr)) if attr not in (None, "", "None") else None
            except ValueError:
                value = str(attr)
            if key == "amp":
                value = value.get("amp") if isinstance(value, dict) else None
            elif value is not None:
                value = json.dumps(value, sort_keys=True)
            out[key] = value
        target_mpp = _first_float(a.get("target_mpp"))
        if target_mpp is None and _first_float(c.get("target_magnification")) is not None:
            from wsi_milssl.slide.resolution import magnification_to_mpp

            target_mpp = magnification_to_mpp(_first_float(c.get("target_magnification")))
        out["target_mpp"] = target_mpp
        # TRIDENT's coords patch_size is at its target magnification; CLAM's (and this project's, which
        # also has patch_level) at patch_level, so no patch size at the target resolution
        out["patch_size_px"] = _first_int(a.get("patch_size_px"), None if "patch_level" in c else c.get("patch_size"))
        return {k: v for k, v in out.items() if v is not None}

    def _random_weights(self) -> str | None:
        """:data:`RANDOM_WEIGHTS` for this project's features of random weights (``encoder_weights`` "random",
        or the settings' ``encoder_weights_sha256`` "random", as the feature stage writes them), else None."""
        try:
            settings = json.loads(str(self.attrs.get("settings") or "{}"))
        except ValueError:
            settings = {}
        recorded = settings.get("encoder_weights_sha256") if isinstance(settings, dict) else None
        random = self.attrs.get("encoder_weights") == RANDOM_WEIGHTS or recorded == RANDOM_WEIGHTS
        return RANDOM_WEIGHTS if random else None

    def grid_layout(self, *, slide_mpp: float | None = None, slide_dimensions: tuple[int, int] | None = None,
                    trained_on: tuple[float, int] | None = None) -> GridLayout:
        """The grid of the patches, for a probability map: from this project's root attributes, else
        from TRIDENT's or CLAM's ``coords`` attributes, else inferred from the coordinates (their common step).
        ``slide_mpp`` / ``slide_dimensions``: the slide's own facts, used where the file has none.
        ``trained_on``: (target µm/px, patch side in px) of the patches a head was trained on, for a file
        that records no patch size or resolution (CLAM's): their level-0 size at the slide's µm/px is the
        least step the coordinates may take, and, where the file's physical patch size agrees, the
        resolution recorded for the map.

        The stride is the file's (``stride_lv0``, or the level-0 patch size less a declared ``overlap``: in
        pixels of coords' ``patch_size``, in level-0 pixels where coords record none), else the level-0
        patch size where the coordinates lie on its grid (one patch, a sparse file), else the coordinates'
        step (for a file of unknown patch size, the step nearest the head's patches); a single patch of
        unknown size is refused. The head's patch size is compared within :data:`NOMINAL_SIZE_RATIO`.

        Raises StoreError (with the fix) when the level-0 µm/px is unknown, a position holds two patches
        (of one bag), the coordinates step by less than a level-0 patch with no overlap declared
        (coordinates at the tiling level where the step is about half of it or less, else an unrecorded
        overlap or, against the head's patches, another patch size), are not on one regular grid (CLAM
        and TRIDENT may grid each tissue region separately), or a patch starts outside the slide where its
        level-0 size is known (the file's or the slide's): another slide's file, or coordinates that are not
        level-0 pixels."""
        if self.coords is None:
            raise StoreError(f"{self.path}: no 'coords' dataset, so the features cannot be placed on the slide. "
                             "Fix: extract features with coordinates (wsi-milssl features, TRIDENT or CLAM).")
        a, c, notes = self.attrs, self.coords_attrs, []
        coords = self.coords
        mpp = _first_float(a.get("mpp"), slide_mpp)
        if _first_float(a.get("mpp")) is not None and slide_mpp is not None and not 0.99 <= slide_mpp / mpp <= 1.01:
            log.warning("%s: the file records level-0 %g µm/px (the slide's when its patches were cut), not the %g "
                        "µm/px given (--slide-mpp, or the slide's metadata): the file's is used.", self.path, mpp,
                        slide_mpp)  # review DB: said nothing
        if mpp is None and c.get("level0_magnification") not in (None, "None"):
            from wsi_milssl.slide.resolution import magnification_to_mpp

            mpp = magnification_to_mpp(float(c["level0_magnification"]))
            notes.append(f"level-0 {mpp:g} µm/px from level0_magnification {float(c['level0_magnification']):g}x")
        if mpp is None:
            raise StoreError(f"{self.path}: the level-0 µm/px of the slide is not recorded. Fix: pass the slide (SLIDE "
                             "arguments, matched to feature files by name: SLIDE.svs to SLIDE.h5) or --slide-mpp.")
        patch_lv0, why = _first_int(a.get("patch_size_lv0")), "its patch_size_lv0 attribute"
        if patch_lv0 is None:
            patch_lv0, why = _first_int(c.get("patch_size_level0")), "TRIDENT's patch_size_level0 attribute"
        if patch_lv0 is None:
            patch_lv0 = clam_patch_size_lv0(c)
            why = (f"CLAM's patch_size {_plain(c.get('patch_size'))} at patch_level {_plain(c.get('patch_level'))}, "
                   f"downsample {_first_float(*np.ravel(c.get('downsample', [])).tolist()) or 1:g}")
        target_mpp, patch_px = _first_float(a.get("target_mpp")), _first_int(a.get("patch_size_px"))
        if target_mpp is None and c.get("target_magnification") not in (None, "None"):
            from wsi_milssl.slide.resolution import magnification_to_mpp

            target_mpp = magnification_to_mpp(float(c["target_magnification"]))
        if patch_px is None and "patch_level" not in c:
            patch_px = _first_int(c.get("patch_size"))  # TRIDENT's: at the target magnification
        _check_duplicates(self.path, coords, self.bag_ids)
        trained_lv0 = None  # the level-0 size of the head's patches at this slide's µm/px (nominally)
        if trained_on is not None and target_mpp is None and patch_px is None:
            trained_lv0 = trained_on[0] * trained_on[1] / mpp
        # 'overlap' is in pixels of coords' patch_size (TRIDENT: at the target magnification, CLAM: at
        # patch_level); a file that records no patch_size (CLAM's coords alone) gives it in level-0 pixels
        overlap = _first_float(c.get("overlap")) or (0.0 if _first_int(c.get("overlap")) == 0 else None)
        size_attr = _first_float(c.get("patch_size"))

        def overlap_lv0(size_lv0: float) -> float:
            if not overlap:
                return 0.0
            return overlap * size_lv0 / size_attr if size_attr else overlap

        stride, stride_why = _first_int(a.get("stride_lv0")), "its stride_lv0 attribute"
        if stride is None and patch_lv0 is not None and overlap is not None and (size_attr or overlap):
            stride = int(round(patch_lv0 - overlap_lv0(patch_lv0)))
            stride_why = (f"the level-0 patch size {patch_lv0} px ({why}) less its 'overlap' {overlap:g} "
                          + (f"px of patch_size {size_attr:g}" if size_attr else "level-0 px"))
        step = _grid_step(coords)
        expected, exact, expected_why = None, True, ""
        if stride is not None:
            expected, expected_why = float(stride), f"the stride: {stride_why}"
        elif patch_lv0 is not None:
            expected, expected_why = float(patch_lv0), f"the level-0 patch size, from {why}"
        elif trained_lv0 is not None:
            expected, exact = trained_lv0 - overlap_lv0(trained_lv0), False
            expected_why = (f"the level-0 size of the patches the head was trained on: {trained_on[1]} px at "
                            f"{trained_on[0]:g} µm/px, at this slide's {mpp:g} µm/px"
                            + (f", less the 'overlap' of {overlap_lv0(trained_lv0):g} px" if overlap else ""))
        if step is not None and expected is not None:
            self._check_step(step, expected, exact=exact, why=expected_why, stride_given=stride is not None,
                             size_attr=size_attr, patch_lv0=patch_lv0)
        positions = len(np.unique(coords, axis=0)) if len(coords) else 0
        if stride is None:
            if patch_lv0 is not None and positions and _on_grid(coords, patch_lv0):
                stride = patch_lv0  # one patch, a sparse file, or a full grid: its cells are the patches
                notes.append(f"stride {stride} level-0 px: the patch size (the coordinates lie on its grid)")
            elif expected is not None and not exact and positions == 1:
                stride = int(round(expected))
                notes.append(f"stride {stride} level-0 px: that of the patches the head was trained on (one patch)")
            elif expected is not None and not exact and positions:
                seen = step or _common_step(coords)
                k = max(1, int(round(seen / expected)))  # a sparse file's step may span k patches
                stride = seen // k if seen % k == 0 and same_physical_size(seen // k, expected) else seen
                stride = stride if _on_grid(coords, stride) else seen
                if stride < seen and not _any_neighbours(coords, stride):
                    # review DB: every step k patches and no two patches touching is rarely a tissue tiling: a µm/px
                    # k times too coarse (--slide-mpp 0.5 for a 0.25 slide) drew a lattice of 1/k-size patches
                    log.warning(
                        "%s: the patches step by %d level-0 px, %dx the %.0f px of the patches the head was trained on "
                        "at this slide's %g µm/px, and no two of them touch: the map draws them apart from each other. "
                        "If the slide's µm/px is %dx too coarse (%g would fit), check --slide-mpp or the slide's own "
                        "µm/px; a file whose patches are that far apart is mapped as it is (recording the patch size "
                        "on coords, CLAM's patch_size, patch_level and downsample or TRIDENT's patch_size_level0, "
                        "says so).", self.path, seen, k, expected, mpp, k, mpp / k)
                notes.append(f"stride {stride} level-0 px inferred from the coordinates (the head's patches are "
                             f"{expected:.0f} px at this slide's µm/px)")
            elif positions == 1:
                raise StoreError(
                    f"{self.path}: a single patch position and no record of its size, so the map's cell size is "
                    "unknown. Fix: record the patch size on coords (CLAM's patch_size, patch_level and downsample, or "
                    "TRIDENT's patch_size_level0), or map it with a head whose training features record their "
                    "resolution and patch size (`wsi-milssl features` files), with the slide or --slide-mpp given.")
            else:
                stride = step or _common_step(coords)
                notes.append(f"stride {stride} level-0 px inferred from the coordinates")
        if patch_lv0 is None and trained_lv0 is not None:
            patch_lv0 = int(round(stride + overlap_lv0(trained_lv0)))
            notes.append(f"patch size {patch_lv0} level-0 px: the stride{' and the overlap' if overlap else ''} "
                         "(the file records none; the head's patches are of this size)")
        if patch_lv0 is None:
            row_step = _row_step(coords)
            ambiguous = row_step is not None and row_step > stride and not overlap
            if ambiguous and _would_overlap(coords, row_step, stride):
                # review BU: one piece with gaps, whose patches of the row's step would overlap, so the step is the
                # patch; review CW: or pieces gridded from their own corners whose patches do overlap: the positions
                # alone cannot tell the two apart, so the map's choice is said
                log.warning("%s: neighbouring patches of a row lie %d level-0 px apart, but their positions line up "
                            "on a grid of %d px and the file records no patch size: the map takes %d-px patches (as "
                            "for one tissue piece with gaps). If the patches are %d px (tissue pieces gridded from "
                            "their own corners, as CLAM does, whose patches overlap), record the patch size on coords "
                            "(CLAM's patch_size, patch_level and downsample, or TRIDENT's patch_size_level0).",
                            self.path, row_step, stride, stride, row_step)
                notes.append(f"patch size {stride} px chosen over the row step {row_step} px (the file records none)")
            elif ambiguous:
                # review BP: CLAM grids each tissue piece from its own corner; where the corners differ by a
                # multiple of a small step, the pieces lie on that finer grid and the map was drawn with patches
                # of its size, without a word
                raise StoreError(
                    f"{self.path}: neighbouring patches of a row lie {row_step} level-0 px apart, but the positions of "
                    f"all patches line up only on a grid of {stride} px (tools that grid each tissue region from its "
                    "own corner place them so), and the file records no patch size: a map of this grid would draw "
                    f"{stride}-px patches. Fix: record the patch size on coords (CLAM's patch_size, patch_level and "
                    "downsample, or TRIDENT's patch_size_level0), or extract features from stores made by "
                    "`wsi-milssl tile` (`wsi-milssl features STORES...`).")
            patch_lv0 = int(round(stride + (overlap if overlap and not size_attr else 0)))
            notes.append("patch size taken as the stride" + (" and the overlap" if overlap and not size_attr else "")
                         + " (no attribute says otherwise)")
        origin = tuple(int(v) for v in a["grid_origin_lv0"]) if a.get("grid_origin_lv0") is not None else None
        if origin is None:
            origin = (int(coords[:, 0].min() % stride), int(coords[:, 1].min() % stride)) if len(coords) else (0, 0)
        if len(coords) and ((coords - np.asarray(origin)) % stride != 0).any():
            raise StoreError(
                f"{self.path}: the patch coordinates are not on one regular grid of stride {stride} level-0 px "
                "(tools that grid each tissue region separately place them so), so they cannot form a "
                "probability map. Fix: extract features from stores made by `wsi-milssl tile` "
                "(`wsi-milssl features STORES...`).")
        dims, dims_from = None, None
        if a.get("dimensions_lv0") is not None:
            dims, dims_from = tuple(int(v) for v in a["dimensions_lv0"]), "as the file records it"
        elif c.get("level0_width") is not None and c.get("level0_height") is not None:
            dims, dims_from = (int(c["level0_width"]), int(c["level0_height"])), "as the file records it"
        elif slide_dimensions is not None:
            dims, dims_from = (int(slide_dimensions[0]), int(slide_dimensions[1])), "the slide given"
        if dims is not None:
            self._check_inside(dims, patch_lv0, dims_from)
        elif len(coords):
            dims = (int(coords[:, 0].max()) + patch_lv0, int(coords[:, 1].max()) + patch_lv0)
            notes.append(f"slide size {dims[0]} x {dims[1]} level-0 px taken from the coordinates (no slide file "
                         "and no recorded size): the maps cover the patches, not the whole slide")
        else:
            dims = (patch_lv0, patch_lv0)
        w, h = dims
        cols = (w - origin[0] - patch_lv0) // stride + 1 if w - origin[0] >= patch_lv0 else 0
        rows = (h - origin[1] - patch_lv0) // stride + 1 if h - origin[1] >= patch_lv0 else 0
        if len(coords):
            cols = max(cols, int((coords[:, 0].max() - origin[0]) // stride) + 1)
            rows = max(rows, int((coords[:, 1].max() - origin[1]) // stride) + 1)
        if target_mpp is None and patch_px is None and trained_on is not None and \
                same_physical_size(patch_lv0 * mpp, trained_on[0] * trained_on[1]):
            target_mpp, patch_px = float(trained_on[0]), int(trained_on[1])  # the head's patches, as CLAM cut them
            notes.append(f"resolution {target_mpp:g} µm/px, {patch_px} px patches: those the head was trained on "
                         "(the file records none; its patches are of the same physical size)")
        if target_mpp is None:
            target_mpp = mpp if patch_px is None else patch_lv0 * mpp / patch_px
        if patch_px is None:
            patch_px = int(round(patch_lv0 * mpp / target_mpp))
        if rows * cols > MAX_GRID_CELLS:  # (review ES: a recorded size of 2e9 px asked numpy for 55 TiB)
            raise StoreError(f"{self.path}: its patches would sit on a map of {rows} x {cols} cells (a {w} x {h} px "
                             f"slide, {stride} px apart), more than the {MAX_GRID_CELLS} a slide's map may have. Fix: "
                             "check its dimensions_lv0 (level0_width, level0_height) and coords attributes.")
        return GridLayout(origin_lv0=(int(origin[0]), int(origin[1])), stride_lv0=int(stride),
                          patch_size_lv0=int(patch_lv0), grid_shape=(int(rows), int(cols)), dimensions_lv0=(w, h),
                          mpp=float(mpp), target_mpp=float(target_mpp), patch_size_px=int(patch_px),
                          notes=tuple(notes))

    def _check_step(self, step: int, expected: float, *, exact: bool, why: str, stride_given: bool,
                    size_attr: float | None, patch_lv0: int | None) -> None:
        """StoreError naming the file when the coordinates step by less than ``expected`` level-0 px (``why``
        says where that comes from): by any amount where the file's own attributes give it (``exact``),
        by more than nominal magnifications differ (:data:`NOMINAL_SIZE_RATIO`) where it is the size of the
        head's patches at this slide's µm/px. A step of at most about half of it is called coordinates at
        a tiling level (or an unrecorded overlap); a step in between, a size difference. The fix names the
        attributes that would declare an overlap."""
        if (step >= 0.99 * expected) if exact else (step * NOMINAL_SIZE_RATIO >= expected):
            return
        lost = expected - step
        if stride_given:
            attrs = (f"the stride the attributes give must be the coordinates' step ({step} level-0 px): set "
                     "'stride_lv0', or 'overlap' (in pixels of coords' patch_size), to match")
        elif patch_lv0 is not None and size_attr:
            attrs = (f"record it as coords' 'overlap' attribute in pixels of its patch_size ({size_attr:g}): "
                     f"{size_attr * lost / patch_lv0:g} here")
        elif patch_lv0 is not None:
            attrs = f"record it as coords' 'overlap' attribute in level-0 pixels: {lost:g} here"
        else:
            attrs = (f"record it as coords' 'overlap' attribute, in level-0 pixels where coords record no "
                     f"patch_size ({lost:.0f} here), or with CLAM's patch_size, patch_level and downsample, in "
                     "pixels of that patch_size")
        if step * 2 <= expected * NOMINAL_SIZE_RATIO:  # a half or less: another level's pixels
            raise StoreError(
                f"{self.path}: the coordinates step by {step} px, less than {expected:.0f} px ({why}), so the "
                f"patches would overlap {expected / step:.3g}x over: coordinates at the tiling level, not level 0, "
                "or patches cut with an overlap the file does not record. Fix: coords must be level-0 pixels "
                f"(multiply coordinates of a tiling level by its downsample); for patches cut with overlap, {attrs}.")
        if exact:
            raise StoreError(
                f"{self.path}: the coordinates step by {step} px, less than {expected:.0f} px ({why}), so the "
                f"patches overlap by {lost:.0f} level-0 px, which the file does not record. Fix: {attrs}; or, "
                "if the patches do not overlap, record their true size.")
        raise StoreError(
            f"{self.path}: the coordinates step by {step} px, {expected / step:.3g}x less than {expected:.0f} px "
            f"({why}): more than the {NOMINAL_SIZE_RATIO:g}x by which scanners' nominal magnifications differ, so "
            f"the patches are smaller than the head's, or overlap by about {lost:.0f} px without a record of it. "
            f"Fix: pass feature files of patches of the training size; for patches cut with overlap, {attrs}.")

    def _check_inside(self, dims: tuple[int, int], patch_lv0: int, dims_from: str) -> None:
        """StoreError naming the file when a patch starts outside the slide of level-0 size ``dims``
        (width, height; ``dims_from`` says where that came from) or ends before its left or top edge: the
        file is another slide's, or its coordinates are not level-0 pixels. A patch overhanging the right
        or bottom edge (by less than a patch) is normal."""
        coords = self.coords
        w, h = dims
        outside = ((coords[:, 0] >= w) | (coords[:, 1] >= h) | (coords[:, 0] + patch_lv0 <= 0)
                   | (coords[:, 1] + patch_lv0 <= 0))
        if outside.any():
            x, y = (int(v) for v in coords[np.flatnonzero(outside)[0]])
            raise StoreError(
                f"{self.path}: {int(outside.sum())} of {len(coords)} patches start outside the slide ({w} x {h} "
                f"level-0 px, {dims_from}), e.g. at ({x}, {y}); the coordinates reach ({int(coords[:, 0].max())}, "
                f"{int(coords[:, 1].max())}). So the file is not this slide's, or its coordinates are not level-0 "
                "pixels. Fix: pass this slide's feature file, with coords in level-0 pixels (coordinates at a "
                "tiling level must be multiplied by its downsample).")


def _first_int(*values: Any) -> int | None:
    for v in values:
        if v is not None and v != "None":
            try:
                return int(v)
            except (TypeError, ValueError):
                continue
    return None


def _first_float(*values: Any) -> float | None:
    for v in values:
        if v is not None and v != "None":
            try:
                f = float(v)
            except (TypeError, ValueError):
                continue
            if math.isfinite(f) and f > 0:
                return f
    return None


def clam_patch_size_lv0(coords_attrs: Mapping[str, Any]) -> int | None:
    """The level-0 patch side CLAM's ``coords`` attributes give: ``patch_size`` (at ``patch_level``) times
    that level's ``downsample``; None without both (TRIDENT's ``patch_size`` is at its target
    magnification, and it records ``patch_size_level0``)."""
    size = _first_float(_plain(coords_attrs.get("patch_size")))
    if size is None or coords_attrs.get("downsample") is None:
        return None
    downsample = _first_float(*np.ravel(np.asarray(_plain(coords_attrs["downsample"]), dtype=object)).tolist())
    return None if downsample is None else int(round(size * downsample))


def _grid_step(coords: np.ndarray) -> int | None:
    """The common step of ``coords`` (:func:`_common_step`) when they lie on one regular grid of it, else
    None (no two distinct positions, or patches gridded region by region: the grid check says so)."""
    if len(coords) < 2 or (len(np.unique(coords[:, 0])) < 2 and len(np.unique(coords[:, 1])) < 2):
        return None
    step = _common_step(coords)
    origin = coords.min(axis=0) % step
    return step if not ((coords - origin) % step != 0).any() else None


def _row_step(coords: np.ndarray) -> int | None:
    """The most common step between neighbouring patches of one row (equal y), None without two in a row."""
    if len(coords) < 2:
        return None
    order = np.lexsort((coords[:, 0], coords[:, 1]))
    xy = coords[order]
    same_row = xy[1:, 1] == xy[:-1, 1]
    diffs = (xy[1:, 0] - xy[:-1, 0])[same_row]
    diffs = diffs[diffs > 0]
    if len(diffs) == 0:
        return None
    values, counts = np.unique(diffs, return_counts=True)
    return int(values[np.argmax(counts)])


def _would_overlap(coords: np.ndarray, side: int, stride: int) -> bool:
    """Whether squares of ``side`` level-0 px at ``coords`` (on a grid of ``stride``) would overlap: then ``side`` cannot
    be the patch size of patches cut without overlap (one tissue piece with gaps, not pieces on a finer grid:
    review BU)."""
    k = max(1, -(-side // stride))  # offsets of whole strides closer than ``side``
    cells = (coords - coords.min(axis=0)) // stride
    width = int(cells[:, 0].max()) + 2 * k + 1
    keys = (cells[:, 1] + k) * width + cells[:, 0] + k
    for dy in range(-k + 1, k):
        for dx in range(-k + 1, k):
            if (dx or dy) and abs(dx) * stride < side and abs(dy) * stride < side:
                if np.isin(keys + dy * width + dx, keys).any():
                    return True
    return False


def _any_neighbours(coords: np.ndarray, stride: int) -> bool:
    """Whether two of ``coords`` lie ``stride`` apart in x (one row) or in y (one column)."""
    seen = {(int(x), int(y)) for x, y in coords}
    return any((x + stride, y) in seen or (x, y + stride) in seen for x, y in seen)


def _on_grid(coords: np.ndarray, stride: int) -> bool:
    """Whether every coordinate lies on the grid of ``stride`` through the smallest ones."""
    if stride < 1:
        return False
    origin = coords.min(axis=0) % stride
    return not ((coords - origin) % stride != 0).any()


def _common_step(coords: np.ndarray) -> int:
    """The most common step between neighbouring distinct x (and y) positions: the grid's stride when the
    patches sit on one (1 without two distinct positions)."""
    diffs = [np.diff(np.unique(coords[:, axis])) for axis in (0, 1)]
    diffs = np.concatenate([d for d in diffs if len(d)]) if any(len(d) for d in diffs) else np.zeros(0, np.int64)
    if len(diffs) == 0:
        return 1
    values, counts = np.unique(diffs, return_counts=True)
    return max(1, int(values[np.argmax(counts)]))


#: suffixes of feature files (any case)
FEATURE_FILE_SUFFIXES = (".h5", ".hdf5")


def feature_files_in(folder: str | os.PathLike) -> list[Path]:
    """The feature files a folder holds, as every command and the pipeline read a folder: its ``.h5`` / ``.hdf5``
    files (any case), not hidden ones (a writer's temporary ``.<stem>.h5...`` file), sorted by name."""
    return sorted(q for q in Path(folder).iterdir()
                  if q.suffix.lower() in FEATURE_FILE_SUFFIXES and not q.name.startswith(".") and q.is_file())


def feature_files_of(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Feature files from files (as given) and folders (:func:`feature_files_in`), each file once however often it
    is named (a folder and a file in it, a folder spelled two ways: review DT, DU). A file named again under another
    name (a link) is read once, as the file itself rather than a link to it (else as it was first named), and a
    warning says so (review DW: its maps went missing without a word; EB: a link's name could win)."""
    first: dict[str, Path] = {}
    for raw in paths:
        p = Path(raw)
        for f in feature_files_in(p) if p.is_dir() else [p]:
            key = os.path.realpath(f)
            kept = first.setdefault(key, f)
            if kept.name != f.name:
                if kept.is_symlink() and not f.is_symlink():  # the file itself, not the link, names its slide
                    first[key], f, kept = f, kept, f
                log.warning("%s is the same file as %s (a link): it is read once, as %s.", f, kept, kept)
    return list(first.values())


def is_feature_file(path: str | os.PathLike) -> bool:
    """True for an HDF5 file with a ``features`` dataset and no ``patches`` (not a patch store)."""
    import h5py

    path = Path(path)
    if not path.is_file() or path.suffix.lower() not in FEATURE_FILE_SUFFIXES:
        return False
    try:
        with h5py.File(path, "r") as fh:
            return FEATURES in fh and "patches" not in fh
    except OSError:
        return False


def read_feature_file(path: str | os.PathLike, *, instance_labels: bool = True) -> FeatureFile:
    """Read a feature file (this project's, TRIDENT's or CLAM's) of one slide.

    The slide stem is the root ``slide_stem`` attribute, else the file stem (TRIDENT and CLAM name the
    file after the slide). Raises StoreError naming the file for one that cannot be opened, one of this
    project of another schema version (:func:`schema_version_error`), one with no
    ``features``, features that are not (N, D) (TRIDENT's empty (0,) counts as N = 0) or not all finite (in
    float32, which models read them in), coordinates that are not (N, 2) (or (N, 1, 2)) or whose count
    differs, or instance labels other than 0 and 1 (coordinates that hold a patch twice are refused where
    patches are placed on a map, :meth:`FeatureFile.grid_layout`, not here: training places none, and files
    of several bags may hold placeholder coordinates); an HDF5 file that cannot be read (cut short) is
    called damaged,
    with the fix (:func:`damaged_message`). ``instance_labels`` False leaves them unread (None): a reader that
    never uses them (the heatmap) does not fail a file over them.
    """
    import h5py

    path = Path(path)
    try:
        fh = h5py.File(path, "r")
    except (OSError, FileNotFoundError) as exc:
        if looks_like_hdf5(path):
            raise StoreError(damaged_message(path, exc)) from None
        raise StoreError(f"{path}: cannot open as HDF5 ({exc}). Fix: pass .h5 feature files made by "
                         "`wsi-milssl features`, TRIDENT or CLAM.") from None
    try:
        with fh:
            return _read_open_file(path, fh, instance_labels=instance_labels)
    except OSError as exc:  # a dataset cut short: the file opened, its data cannot be read
        raise StoreError(damaged_message(path, exc)) from None
    except (RuntimeError, KeyError, ValueError) as exc:  # h5py's words for damaged HDF5 structures (review BW);
        if not _raised_in_h5py(exc):  # the same types from reading what an intact file holds are not damage
            raise
        raise StoreError(damaged_message(path, exc)) from None


def _raised_in_h5py(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside h5py (its last traceback frame is h5py's)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    name = "" if tb is None else tb.tb_frame.f_code.co_filename.replace(os.sep, "/")
    return name.startswith("h5py/") or "/h5py/" in name  # its compiled modules name themselves h5py/h5o.pyx


#: The signature an HDF5 file starts with (at byte 0, or at 512, 1024, ... after a user block).
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def looks_like_hdf5(path: str | os.PathLike) -> bool:
    """Whether ``path`` starts like an HDF5 file (its signature at byte 0, 512, 1024, 2048 or 4096)."""
    try:
        with open(path, "rb") as fh:
            for offset in (0, 512, 1024, 2048, 4096):
                fh.seek(offset)
                if fh.read(len(_HDF5_SIGNATURE)) == _HDF5_SIGNATURE:
                    return True
    except OSError:
        return False
    return False


def damaged_message(path: str | os.PathLike, exc: BaseException) -> str:
    """The error for an HDF5 feature file that cannot be read (cut short by a copy, a full disk or a
    tool killed while writing it), with the fix: delete it and make it again; a process out of file handles
    (EMFILE) gets that fix instead, as the file is fine."""
    from wsi_milssl.store.base import too_many_open_files, too_many_open_files_fix

    if too_many_open_files(exc):
        return f"{path}: cannot be read: too many open files ({exc}). Fix: {too_many_open_files_fix('file')}."
    return (f"{path}: the file looks damaged: an HDF5 file that cannot be read ({exc}), e.g. cut short by a copy, a "
            "full disk or a writer that was killed. Fix: delete it and make it again: `wsi-milssl features` into its "
            "folder embeds that slide alone (the other files are kept), `wsi-milssl run PIPELINE --force features` "
            "remakes a pipeline's feature files; a file of TRIDENT or CLAM, with that tool.")


def schema_version_error(path: str | os.PathLike, attrs: Mapping[str, Any]) -> str | None:
    """The error for a file of this project (root ``schema`` :data:`SCHEMA`) that records another
    ``schema_version`` than :data:`SCHEMA_VERSION` (its layout may mean something else), with the fix;
    None for this version's files and for files of other tools (no ``schema`` attribute)."""
    if _plain(attrs.get("schema")) != SCHEMA or attrs.get("schema_version") is None:
        return None
    version = _first_int(_plain(attrs.get("schema_version")))
    if version == SCHEMA_VERSION:
        return None
    if version is not None and version > SCHEMA_VERSION:
        fix = ("upgrade wsi-milssl to the version that wrote it (its package_version attribute says which), or "
               "make the features again with this version (`wsi-milssl features --overwrite`, or into a new folder "
               "with --out)")
    else:
        fix = ("make the features again with this version (`wsi-milssl features --overwrite`, or into a new folder "
               "with --out)")
    made_by = _plain(attrs.get("package_version"))
    return (f"{path}: feature schema version {_plain(attrs.get('schema_version'))} differs from this package's "
            f"{SCHEMA_VERSION} (written by wsi-milssl {made_by or 'of an unknown version'}), so its datasets and "
            f"attributes may mean something else here. Fix: {fix}.")


def _coords(path: Path, raw: np.ndarray) -> np.ndarray:
    """int64 (N, 2) coordinates from the stored ``coords``: (N, 2), or (N, 1, 2) as some tools write them
    (empty ones of any shape: no patch); floating-point ones rounded to the nearest pixel. Raises StoreError
    naming the file for any other shape (a (2, N) array, one x row and one y row, would pair the wrong values).
    Duplicate rows (two patches on one map cell: one would overwrite the other) are refused where the patches
    are mapped (:func:`_check_duplicates` in :meth:`FeatureFile.grid_layout`), as ``open_store`` refuses a
    store's."""
    if raw.size == 0:
        return np.zeros((0, 2), np.int64)
    if not (raw.ndim == 2 and raw.shape[1] == 2) and not (raw.ndim == 3 and raw.shape[1:] == (1, 2)):
        raise StoreError(f"{path}: 'coords' must be (N, 2), one (x, y) row per patch as CLAM and TRIDENT write it; got "
                         f"shape {raw.shape}. Fix: write the coordinates as (N, 2) level-0 (x, y) rows (a (2, N) "
                         "array: store its transpose).")
    if raw.dtype.kind not in "iuf":  # text or objects: astype would parse or fail with numpy's words
        raise StoreError(f"{path}: 'coords' must hold numbers (level-0 x, y pixels); got {raw.dtype}. Fix: write the "
                         "coordinates as integers.")
    flat = raw.reshape(-1, 2)
    if raw.dtype.kind == "f":  # rounded, as TRIDENT rounds its own (review EL: 2431.9999999 was cut to 2431)
        if not np.isfinite(flat).all():
            raise StoreError(f"{path}: 'coords' holds NaN or infinite values. Fix: write each patch's level-0 (x, y) "
                             "top-left corner as a number (extract the features again).")
        flat = np.rint(flat)
    return flat.astype(np.int64, copy=False)


def _check_duplicates(path: Path, coords: np.ndarray, bag_ids: list[str] | None) -> None:
    """StoreError naming the file when two patches (of one bag, in a file of several) share (x, y)."""
    if len(coords) < 2:
        return
    keys = [coords[:, 1], coords[:, 0]]
    bags = np.unique(np.asarray(bag_ids), return_inverse=True)[1] if bag_ids is not None else np.zeros(len(coords))
    order = np.lexsort((*keys, bags))
    dup = np.flatnonzero((np.diff(coords[order], axis=0) == 0).all(axis=1) & (np.diff(bags[order]) == 0))
    if dup.size:
        x, y = (int(v) for v in coords[order[dup[0]]])
        raise StoreError(f"{path}: 'coords' holds {dup.size} duplicate coordinate(s), e.g. ({x}, {y}), so two "
                         "patches would fall on one map cell. Fix: write each patch once (extract the features "
                         "again).")


def _read_open_file(path: Path, fh, *, instance_labels: bool = True) -> FeatureFile:
    """The contents of the open feature file ``fh`` (:func:`read_feature_file`)."""
    version_error = schema_version_error(path, fh.attrs)
    if version_error is not None:
        raise StoreError(version_error)
    if FEATURES not in fh:
        raise StoreError(f"{path}: no 'features' dataset. Fix: extract features first (`wsi-milssl features`), "
                         "or train on patch stores in image mode.")
    feats = np.asarray(fh[FEATURES][()])
    if feats.ndim == 1 and feats.size == 0:  # TRIDENT's file of a slide without patches
        feats = feats.reshape(0, 0)
    if feats.ndim == 3 and feats.shape[0] == 1:  # (1, N, D): a batch of one slide, as some pipelines save it
        feats = feats[0]
    if feats.ndim != 2:
        raise StoreError(f"{path}: 'features' must be 2-D (N, D); got shape {feats.shape}. Fix: write one row "
                         "per patch.")
    if feats.dtype.kind != "f":
        raise StoreError(f"{path}: 'features' must be floating point; got {feats.dtype}.")
    bad_rows = non_finite_rows(feats)
    if bad_rows.size:
        raise StoreError(f"{path}: 'features' holds NaN or infinite values in {bad_rows.size} of {len(feats)} rows "
                         f"(first: row {int(bad_rows[0])}), so no model can score them. Fix: extract the features "
                         "again (in float32 if a half-precision encoder overflowed).")
    beyond = _beyond_float32_rows(feats)
    if beyond.size:
        raise StoreError(f"{path}: 'features' holds values beyond float32's range (±3.4e+38) in {beyond.size} of "
                         f"{len(feats)} rows (first: row {int(beyond[0])}), which become infinite as float32, the "
                         "precision models read features in. Fix: extract the features again, or write them as "
                         "float32 values within that range.")
    coords = None
    if COORDS in fh:
        coords = _coords(path, np.asarray(fh[COORDS][()]))
        if len(coords) != len(feats):
            raise StoreError(f"{path}: 'coords' has {len(coords)} rows but 'features' {len(feats)}. Fix: "
                             "extract the features again.")
    inst = (_instance_labels(path, np.asarray(fh[INSTANCE_LABEL][()]))
            if instance_labels and INSTANCE_LABEL in fh else None)
    if inst is not None and inst.shape != (len(feats),):
        raise StoreError(f"{path}: 'instance_label' has shape {inst.shape}; expected ({len(feats)},).")
    bag_ids = None
    if BAG_IDS in fh:
        try:
            bag_ids = [b.decode() if isinstance(b, bytes) else str(b) for b in np.asarray(fh[BAG_IDS][()]).tolist()]
        except UnicodeDecodeError as exc:
            raise StoreError(f"{path}: its 'bag_ids' are not UTF-8 text ({exc.object[:40]!r}...). Fix: write the bag "
                             "names as UTF-8 strings.") from None
        if len(bag_ids) != len(feats):
            raise StoreError(f"{path}: 'bag_ids' has {len(bag_ids)} rows but 'features' has {len(feats)}.")
    attrs = {k: _plain(v) for k, v in fh.attrs.items()}
    features_attrs = {k: _plain(v) for k, v in fh[FEATURES].attrs.items()}
    coords_attrs = {k: _plain(v) for k, v in fh[COORDS].attrs.items()} if COORDS in fh else {}
    stem = str(attrs.get("slide_stem") or path.stem)
    from wsi_milssl.cohorts.names import unsafe_stem

    why = unsafe_stem(stem)
    if why is not None:  # (review ES: outputs named after it were written outside --out)
        raise StoreError(f"{path}: its slide_stem attribute {stem[:80]!r} cannot name output files: {why}. Fix: write "
                         "the slide's name there (the slide file's name without its folder and suffix), or delete "
                         "the attribute (the file's name is then the slide's).")
    return FeatureFile(path=path, stem=stem, features=feats, coords=coords, instance_label=inst, bag_ids=bag_ids,
                       attrs=attrs, features_attrs=features_attrs, coords_attrs=coords_attrs)
