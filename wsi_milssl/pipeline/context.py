"""What every stage of ``wsi-milssl run`` is given (:class:`StageContext`: the pipeline, its output folders and
the progress callback), and which files of ``OUT`` belong to a set's slides now (:func:`set_stores`,
:func:`in_set`): stores and feature files of slides a changed list moved out of the set are left out, and kept."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TypeVar

from wsi_milssl.config import config_from_mapping
from wsi_milssl.events import ProgressCallback
from wsi_milssl.pipeline.spec import PipelineSpec

__all__ = ["StageContext", "in_set", "listed_stems", "set_stores", "store_format"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class StageContext:
    def __init__(self, spec: PipelineSpec, progress: ProgressCallback | None) -> None:
        self.spec = spec
        self.out = spec.out_dir
        self.state = spec.out_dir / ".pipeline"
        self.progress = progress
        #: the stage runs because of ``force`` (named, or downstream of a named stage): its work is
        #: redone from scratch (tile, label and heatmap overwrite; train moves its run folders aside)
        self.redo = False
        #: folders whose files of slides no longer in their set (or, as (folder, "format"), whose stores in
        #: another format) were reported: one warning per folder and run
        self.warned_ignored: set = set()

    def stores(self, set_name: str) -> Path:
        return self.out / "stores" / set_name

    def labels_dir(self, set_name: str) -> Path:
        return self.out / "labels" / set_name

    def features_dir(self, set_name: str) -> Path:
        return self.out / "features" / set_name

    @property
    def model_dir(self) -> Path:
        return self.out / "model"

    @property
    def heatmap_dir(self) -> Path:
        return self.out / "heatmaps" / "test"

    @property
    def evaluation_dir(self) -> Path:
        return self.out / "evaluation"


def set_stores(ctx: StageContext, set_name: str, paths: list[Path] | None = None, *, what: str = "store"
                ) -> dict[str, Path]:
    """{stem: path} of the set's current slides among ``paths`` (default: the stores in ``OUT/stores/<set>``
    in the tile stage's format; or the feature files made from them). Those of slides no longer in the set
    (its slide list changed, as when a cohort's split moves slides between train and test, or a slide was
    renamed) and stores in another format (an earlier run's) are left out, and kept on disk; one warning
    per folder and run says which."""
    from wsi_milssl.cohorts import slide_stem
    from wsi_milssl.store import find_stores
    from wsi_milssl.store.schema import store_path

    if paths is None:
        folder = ctx.stores(set_name)
        paths = find_stores([folder])
        fmt = store_format(ctx)
        suffix = store_path(folder, "x", fmt).suffix
        other = sorted(Path(p).name for p in paths if Path(p).suffix != suffix)
        if other and (folder, "format") not in ctx.warned_ignored:
            ctx.warned_ignored.add((folder, "format"))
            log.warning("%s: ignored %d store(s) in another format than [tile] format = %r (%s%s), from an earlier "
                        "run; they are kept, remove them if they are not needed", folder, len(other), fmt,
                        ", ".join(other[:5]), " ..." if len(other) > 5 else "")
        paths = [p for p in paths if Path(p).suffix == suffix]
    stores = {slide_stem(p): p for p in paths}
    return in_set(ctx, set_name, stores, Path(paths[0]).parent if paths else None, what=what)


def store_format(ctx: StageContext) -> str:
    """The store format the tile stage writes (``[tile] format``)."""
    from wsi_milssl.config import TileConfig

    return config_from_mapping(TileConfig, ctx.spec.section("tile"), source=f"{ctx.spec.source} [tile]").format


def listed_stems(ctx: StageContext, set_name: str) -> list[str] | None:
    """The exact stems of the set's slides (its slide list or folder); None without one (every file counts)."""
    from wsi_milssl.cohorts import slide_stem
    from wsi_milssl.tiling import find_slides

    ds = ctx.spec.sets[set_name]
    if ds.slides is None or not Path(ds.slides).exists():
        return None
    return [slide_stem(p) for p in find_slides([ds.slides], keep_missing=True)]


def in_set(ctx: StageContext, set_name: str, found: dict[str, T], folder: Path | None, *, what: str) -> dict[str, T]:
    """The items of ``found`` ({stem: item} of the files in ``folder``) whose slides are now in the set, by
    the exact stem of a listed slide (in Unicode NFC: the store of a slide since renamed, if only in letter
    case, is not the renamed slide's); the others are left out, with one warning per folder and run naming
    them."""
    import unicodedata

    from wsi_milssl.cohorts import stem_key

    listed = listed_stems(ctx, set_name)
    if listed is None:
        return found
    nfc = lambda name: unicodedata.normalize("NFC", name)  # noqa: E731
    wanted = {stem_key(stem): nfc(stem) for stem in listed}
    current = {stem: item for stem, item in found.items() if wanted.get(stem_key(stem)) == nfc(stem)}
    ignored = sorted(stem for stem in found if stem not in current)
    if ignored and folder not in ctx.warned_ignored:
        ctx.warned_ignored.add(folder)
        log.warning("%s: ignored %d %s(s) of slides no longer in the %s set (%s%s); they are kept, remove them "
                    "if they are not needed", folder, len(ignored), what, set_name, ", ".join(ignored[:5]),
                    " ..." if len(ignored) > 5 else "")
    return current

