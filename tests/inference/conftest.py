"""Fixtures of the heatmap-stage tests: slides with known tumour geometry, an oracle model, checkpoints.

Slides are pyramidal TIFFs at 0.25 µm/px read through OpenSlide. Tissue is pink "stroma" with a
blocky texture (8 level-0 px cells, so it survives the pyramid's averaging and passes the entropy
filter); "tumour" is the same texture in dark purple. Outside the tissue rectangle is glass.

``darkness`` is a fixed-weight model registered for these tests: its logit is
``gain * (fraction of dark pixels - min_fraction)``, so it is positive exactly for patches mostly
covered by tumour texture. A patch read half a patch off the marked cell sees only half of it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from wsi_milssl.mil.checkpoint import save_checkpoint
from wsi_milssl.mil.data import NORMALISATION
from wsi_milssl.mil.models import MODELS, register_model
from wsi_milssl.synth.pyramid import write_pyramidal_tiff

MPP = 0.25
GLASS = np.array([244, 244, 244], np.float32)
STROMA = np.array([228, 150, 196], np.float32)
TUMOUR = np.array([92, 56, 150], np.float32)
TEXTURE_CELL_PX = 8


class DarknessNet(nn.Module):
    """Oracle patch classifier: share of pixels darker than ``luminance`` (in [0, 1] after undoing the
    input normalisation), mapped to logits ``(-z/2, z/2)`` with ``z = gain * (share - min_fraction)``."""

    def __init__(self, *, luminance: float = 0.55, min_fraction: float = 0.75, gain: float = 40.0) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(NORMALISATION["mean"]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(NORMALISATION["std"]).view(1, 3, 1, 1))
        self.luminance = float(luminance)
        self.min_fraction = float(min_fraction)
        self.gain = float(gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.float() * self.std + self.mean
        lum = u.mean(dim=1)
        share = torch.sigmoid((self.luminance - lum) * 80.0).mean(dim=(1, 2))
        z = self.gain * (share - self.min_fraction)
        return torch.stack([-z / 2, z / 2], dim=1)


def _darkness(**kwargs) -> DarknessNet:
    return DarknessNet(**{k: v for k, v in kwargs.items() if k in ("luminance", "min_fraction", "gain")})


if "darkness" not in MODELS:
    register_model("darkness", image=True)(_darkness)


def _hash_noise(cx: np.ndarray, cy: np.ndarray) -> np.ndarray:
    """Deterministic noise in [-1, 1) per integer texture cell (seamless across render blocks)."""
    mask = np.uint64(0xFFFFFFFF)
    h = (cx.astype(np.uint64) * np.uint64(0x9E3779B1) + cy.astype(np.uint64) * np.uint64(0x85EBCA77)) & mask
    h ^= h >> np.uint64(15)
    h = (h * np.uint64(0x2C1B3C6D)) & mask
    h ^= h >> np.uint64(12)
    return (h & np.uint64(0xFFFF)).astype(np.float32) / 32768.0 - 1.0


def make_renderer(width: int, height: int, *, tissue_box: tuple[int, int, int, int], tumour):
    """Render function (x0, y0, x1, y1) -> uint8 RGB for write_pyramidal_tiff.

    ``tissue_box`` = (x0, y0, x1, y1) level-0 rectangle of tissue; ``tumour``: a function
    (xs float (n,), ys float (n,)) -> bool (n,) telling which level-0 pixel centres are tumour.
    """

    def render(x0: int, y0: int, x1: int, y1: int) -> np.ndarray:
        ys, xs = np.mgrid[y0:y1, x0:x1]
        noise = _hash_noise(xs // TEXTURE_CELL_PX, ys // TEXTURE_CELL_PX)[..., None]
        out = np.empty((y1 - y0, x1 - x0, 3), np.float32)
        out[:] = GLASS
        out += (noise + 1.0)  # glass: 0-2 grey levels of noise
        bx0, by0, bx1, by1 = tissue_box
        in_tissue = (xs >= bx0) & (xs < bx1) & (ys >= by0) & (ys < by1)
        stroma = STROMA + noise * 22.0
        out = np.where(in_tissue[..., None], stroma, out)
        is_tumour = tumour((xs + 0.5).ravel().astype(np.float64), (ys + 0.5).ravel().astype(np.float64))
        is_tumour = is_tumour.reshape(xs.shape) & in_tissue
        out = np.where(is_tumour[..., None], TUMOUR + noise * 30.0, out)
        return np.clip(np.round(out), 0, 255).astype(np.uint8)

    return render


def write_slide(path: Path, *, width: int, height: int, tissue_box, tumour) -> Path:
    return write_pyramidal_tiff(path, make_renderer(width, height, tissue_box=tissue_box, tumour=tumour),
                                width=width, height=height, mpp=MPP)


@pytest.fixture(scope="session")
def slide_writer():
    """write_slide(path, *, width, height, tissue_box, tumour) -> path (see make_renderer)."""
    return write_slide


# -- marker slide: exactly one grid cell is tumour ------------------------------------------------
MARKER_SIZE = (4096, 3072)
MARKER_TISSUE = (256, 256, 3840, 2816)


@pytest.fixture(scope="session")
def marker_slide_factory(tmp_path_factory):
    """Function (x_lv0, y_lv0, side_lv0) -> path of a slide whose only tumour is that square (cached)."""
    cache: dict[tuple[int, int, int], Path] = {}
    folder = tmp_path_factory.mktemp("marker")

    def make(x: int, y: int, side: int) -> Path:
        key = (x, y, side)
        if key not in cache:
            def tumour(xs, ys):
                return (xs >= x) & (xs < x + side) & (ys >= y) & (ys < y + side)

            cache[key] = write_slide(folder / f"marker_{x}_{y}_{side}.tif", width=MARKER_SIZE[0],
                                     height=MARKER_SIZE[1], tissue_box=MARKER_TISSUE, tumour=tumour)
        return cache[key]

    return make


# -- tumour slide: two polygons with an ASAP annotation ------------------------------------------
TUMOUR_SIZE = (4096, 4096)
TUMOUR_TISSUE = (128, 128, 3968, 3968)


def tumour_polygons() -> list[np.ndarray]:
    """Two level-0 polygons: an irregular blob and a triangle."""
    t = np.linspace(0, 2 * np.pi, 64, endpoint=False)
    r = 700 + 150 * np.sin(3 * t)
    blob = np.stack([1300 + r * np.cos(t), 1400 + r * np.sin(t)], axis=1)
    tri = np.array([[2500.0, 2300.0], [3600.0, 2500.0], [2800.0, 3600.0]])
    return [blob, tri]


@pytest.fixture(scope="session")
def tumour_slide(tmp_path_factory) -> Path:
    """4096 x 4096 px slide at 0.25 µm/px with the two tumour_polygons(); ASAP XML beside it."""
    import shapely

    from wsi_milssl.annotations.asap import PolygonAnnotation, write_asap_xml

    folder = tmp_path_factory.mktemp("tumourslide")
    polys = tumour_polygons()
    region = shapely.union_all([shapely.Polygon(p) for p in polys])
    shapely.prepare(region)

    def tumour(xs, ys):
        return shapely.contains_xy(region, xs, ys)

    path = write_slide(folder / "tumour.tif", width=TUMOUR_SIZE[0], height=TUMOUR_SIZE[1],
                       tissue_box=TUMOUR_TISSUE, tumour=tumour)
    anns = [PolygonAnnotation(f"Annotation {i}", "_0", p, "#F4FA58") for i, p in enumerate(polys)]
    write_asap_xml(anns, folder / "tumour.xml")
    return path


# -- checkpoints ---------------------------------------------------------------------------------
def make_checkpoint(path: Path, *, model_name: str = "darkness", model_kwargs: dict | None = None,
                    model: nn.Module | None = None, target_mpp: float = 1.0, patch_size_px: int = 32,
                    stride_px: int | None = None, entropy_threshold_bits: float = 3.0, bag_pooling: str = "max",
                    tissue: str = "otsu", min_tissue: float = 0.1, mask_mpp: float = 8.0,
                    normalisation: dict | None = None, drop: tuple[str, ...] = (),
                    tiling_plan: dict | None = None) -> Path:
    """A training checkpoint as ``wsi-milssl train`` writes it, for a fixed-weight or given model.

    ``tiling_plan``: the stores' recorded plan (a dict), which checkpoints of newer stores carry;
    without it only the older separate keys are written."""
    from wsi_milssl.mil.models import create_model

    kwargs = dict(model_kwargs or {})
    model = model if model is not None else create_model(model_name, **kwargs)
    config = {
        "mode": "images", "model": model_name, "bag_pooling": bag_pooling,
        "target_mpp": target_mpp, "patch_size_px": patch_size_px,
        "entropy_threshold_bits": entropy_threshold_bits,
        "store_settings": {"target_mpp": target_mpp, "patch_size_px": patch_size_px,
                           "stride_px": stride_px or patch_size_px, "entropy_threshold_bits": entropy_threshold_bits,
                           "tissue_detector": tissue, "min_tissue": min_tissue, "mask_mpp": mask_mpp},
        "normalisation": normalisation or {k: list(v) for k, v in NORMALISATION.items()},
        "model_name": model_name, "model_kwargs": kwargs,
    }
    if tiling_plan is not None:
        config["tiling_plan"] = dict(tiling_plan)
    for key in drop:
        config.pop(key, None)
        config["store_settings"].pop(key, None)
    ckpt = {"model": model.state_dict(), "optimizer": {}, "epoch": 1, "step": 1, "pseudo_labels": {}, "rng": {},
            "config": config, "model_name": model_name, "model_kwargs": kwargs, "bag_pooling": bag_pooling}
    return save_checkpoint(ckpt, path)


@pytest.fixture(scope="session")
def checkpoint_writer():
    """:func:`make_checkpoint` as a fixture (test modules cannot import conftest reliably: another test
    folder's conftest may be the module named ``conftest`` when they run)."""
    return make_checkpoint


@pytest.fixture
def checkpoint_factory(tmp_path):
    """Function (**make_checkpoint kwargs) -> checkpoint path in a fresh folder."""
    counter = iter(range(1000))

    def make(**kwargs) -> Path:
        return make_checkpoint(tmp_path / f"run{next(counter)}" / "best.pt", **kwargs)

    return make


@pytest.fixture
def predicted(monkeypatch) -> list[str]:
    """The slides the heatmap stage runs the model on (every slide given to ``predict_many``), in order."""
    from wsi_milssl.inference import stage as stage_module

    stems: list[str] = []
    original = stage_module.predict_many

    def counting(inputs, *args, **kwargs):
        stems.extend(item.stem for item in inputs)
        yield from original(inputs, *args, **kwargs)

    monkeypatch.setattr(stage_module, "predict_many", counting)
    return stems


def _write_outline(folder: Path, stem: str, box: tuple[int, int, int, int]) -> Path:
    """An ASAP XML of one tumour rectangle (level-0 x0, y0, x1, y1) for slide ``stem`` in ``folder``."""
    from wsi_milssl.annotations import write_annotations
    from wsi_milssl.annotations.asap import PolygonAnnotation

    x0, y0, x1, y1 = box
    ring = np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], float)
    folder.mkdir(exist_ok=True)
    return write_annotations([PolygonAnnotation("Annotation 0", "_0", ring)], folder / f"{stem}.xml")


@pytest.fixture(scope="session")
def outline_writer():
    """``outline_writer(folder, stem, (x0, y0, x1, y1))``: an ASAP XML of one tumour rectangle."""
    return _write_outline
