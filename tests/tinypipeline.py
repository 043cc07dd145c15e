"""The tables of generated data that the pipeline tests share: 4 training and 2 test slides of
2,048 x 2,048 px, tiled at 10x into 32-px patches (the smallest run that goes through every stage).
A test's pipeline is its [pipeline] table, then these, then its own stage tables ([tile] comes last
here, so a test may add keys to it)."""

GENERATED_SLIDES = """
[data]
generate = true
val_fraction = 0.34
[synth.train]
n_slides = 4
seed = 0
width_px = 2048
height_px = 2048
[synth.test]
n_slides = 2
seed = 1000
width_px = 2048
height_px = 2048
[tile]
magnification = 10.0
patch_size_px = 32
entropy_threshold_bits = 4.0
min_tissue = 0.5
"""


def feature_bags(folder, n: int, seed: int) -> None:
    """``n`` HDF5 feature bags of 20 instances x 8 features in ``folder`` (created) with ``labels.csv``: bag b is
    positive when b is odd, its first 4 instances shifted by 3."""
    import h5py
    import numpy as np

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    lines = ["slide,label"]
    for b in range(n):
        x = rng.normal(size=(20, 8)).astype(np.float32)
        x[:4] += 3.0 * (b % 2)
        with h5py.File(folder / f"bag_{b:02d}.h5", "w") as fh:
            fh["features"] = x
        lines.append(f"bag_{b:02d},{b % 2}")
    (folder / "labels.csv").write_text("\n".join(lines) + "\n")
