"""``wsi-milssl run`` again after the slides were generated anew under the same names: the tile stage
cuts every store from the new slide files instead of keeping the old stores."""

from __future__ import annotations

from wsi_milssl.pipeline import load_pipeline, run_pipeline
from wsi_milssl.store import open_store

SYNTH_AND_TILE = """
[pipeline]
name = "regen"
[data]
generate = true
[synth.train]
n_slides = 2
seed = 0
width_px = 2048
height_px = 2048
[synth.test]
n_slides = 1
seed = 1000
width_px = 2048
height_px = 2048
[tile]
magnification = 10.0
patch_size_px = 32
pixels = "none"
"""


def test_slides_generated_again_into_the_same_folder_are_tiled_again(tmp_path):
    toml = tmp_path / "regen.toml"
    toml.write_text(SYNTH_AND_TILE)
    out = tmp_path / "out"
    run_pipeline(load_pipeline(toml, out_dir=out), until="tile")
    stores = out / "stores" / "train"
    assert sorted(p.name for p in stores.glob("*.h5")) == ["synth_000.h5", "synth_001.h5"]
    outcomes = run_pipeline(load_pipeline(toml, out_dir=out, overrides=["synth.train.seed=7"]), until="tile")
    assert [(o.stage, o.status) for o in outcomes] == [("synth", "ran"), ("tile", "ran")]
    for name in ("synth_000", "synth_001"):
        slide = out / "slides" / "train" / f"{name}.tif"
        with open_store(stores / f"{name}.h5") as store:
            attrs = store.attrs
        st = slide.stat()
        assert (attrs["slide_path"], attrs["slide_size_bytes"], attrs["slide_mtime_ns"]) == (
            str(slide.resolve()), st.st_size, st.st_mtime_ns)
