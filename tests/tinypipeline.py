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


#: a feature pipeline's tables (after its [pipeline] table) on ``bags/train`` and ``bags/test`` of :func:`feature_bags`
FEATURE_BAGS = """
[data]
mode = "features"
train_features = "bags/train"
train_labels = "bags/train/labels.csv"
test_features = "bags/test"
test_labels = "bags/test/labels.csv"
val_fraction = 0.25
[train]
model = "linear"
epochs = 3
batch_size = 32
plots = false
"""

#: the [data] and [tile] tables of a cohort of slide lists (``{root}/train_slides.csv``, ``{root}/test_slides.csv``),
#: label files beside them and one annotations folder for both sets (``{root}/slides``): ``.format(root=...)``
LISTED_COHORT = """
[data]
train_slides = "{root}/train_slides.csv"
train_labels = "{root}/train_labels.csv"
train_annotations = "{root}/slides"
test_slides = "{root}/test_slides.csv"
test_labels = "{root}/test_labels.csv"
test_annotations = "{root}/slides"
val_fraction = 0.0
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
