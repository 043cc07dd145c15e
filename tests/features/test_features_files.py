"""Feature files of TRIDENT and CLAM, written the way their code writes them, are read by `train` as
they are; ours open the way their readers open theirs; grids of foreign files are placed or refused."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from feature_fixtures import write_clam_features, write_trident_features
from wsi_milssl.cli import main
from wsi_milssl.cli.train import detect_mode
from wsi_milssl.errors import ConfigError, StoreError
from wsi_milssl.features import read_feature_file, write_feature_file
from wsi_milssl.mil import read_checkpoint, read_feature_files, read_labels_csv


def _bags(n_bags: int = 6, dim: int = 16, seed: int = 0):
    """Bags of a 10x10 grid at 20x (512 level-0 px at 40x, 256 px patches); odd bags positive with a
    shifted corner of patches."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:10, 0:10]
    coords = np.stack([xs.ravel() * 512, ys.ravel() * 512], axis=1).astype(np.int64)
    out = []
    for b in range(n_bags):
        feats = rng.normal(size=(len(coords), dim)).astype(np.float32)
        if b % 2:
            feats[:20] += 3.0
        out.append((f"slide_{b}", feats, coords, b % 2))
    return out


def _labels(path, bags, extra=()):
    path.write_text("slide,label\n" + "".join(f"{name},{label}\n" for name, _, _, label in bags)
                    + "".join(f"{name},0\n" for name in extra))
    return path


def test_train_reads_trident_feature_files_as_they_are(tmp_path, capsys):
    folder = tmp_path / "trident" / "20x_256px_0px_overlap" / "features_conch_v15"
    bags = _bags()
    for name, feats, coords, _ in bags:
        write_trident_features(folder, name, feats, coords, patch_size=256, src_mag=40, dst_mag=20, width=5120,
                               height=5120)
    # TRIDENT's file of a slide without patches: features of shape (0,)
    write_trident_features(folder, "empty", np.empty((0,), np.float32), np.empty((0, 2), np.int64), patch_size=256,
                           src_mag=40, dst_mag=20, width=5120, height=5120)
    labels = _labels(tmp_path / "labels.csv", bags, extra=["empty"])
    assert detect_mode([folder]) == "features"
    run = tmp_path / "run"
    rc = main(["train", str(folder), "--labels", str(labels), "--out", str(run), "--epochs", "3", "--threads", "1",
               "--no-plots"])
    assert rc == 0, capsys.readouterr().err
    saved = json.loads((run / "config.json").read_text())
    assert saved["data"]["input_mode"] == "features" and saved["model"] == "mlp" and saved["in_features"] == 16
    ckpt = read_checkpoint(run / "last.pt")
    assert ckpt["config"]["store_settings"]["feature_encoder"] == "conch_v15"
    assert sorted(ckpt["config"]["train_bags"]) == [name for name, *_ in bags]  # the empty slide is left out


def test_train_reads_clam_feature_files_as_they_are(tmp_path):
    bags = _bags(seed=1)
    for name, feats, coords, _ in bags:
        write_clam_features(tmp_path / "clam", name, feats, coords)
    with h5py.File(tmp_path / "clam" / "h5_files" / "slide_0.h5") as fh:
        assert fh["coords"].dtype == np.int32 and fh["features"].chunks == (32, 16) and not fh.attrs
    inst = read_feature_files(sorted((tmp_path / "clam" / "h5_files").glob("*.h5")),
                              {name: label for name, _, _, label in bags})
    assert inst.bag_names == [name for name, *_ in bags] and inst.features.shape == (600, 16)
    np.testing.assert_array_equal(inst.features[:100], bags[0][1])
    labels = _labels(tmp_path / "labels.csv", bags)
    assert main(["train", str(tmp_path / "clam" / "h5_files"), "--labels", str(labels), "--out",
                 str(tmp_path / "run"), "--epochs", "2", "--threads", "1", "--no-plots"]) == 0


def test_features_of_two_encoders_are_not_mixed(tmp_path):
    bags = _bags(n_bags=2)
    for (name, feats, coords, _), encoder in zip(bags, ("uni_v1", "conch_v15")):
        write_trident_features(tmp_path, name, feats, coords, patch_size=256, src_mag=40, dst_mag=20, width=5120,
                               height=5120, encoder=encoder)
    with pytest.raises(ConfigError, match=r"slide_0.h5 and .*slide_1.h5 hold features of different encoders "
                                          r"\(uni_v1 .* vs conch_v15"):
        read_feature_files([tmp_path / "slide_0.h5", tmp_path / "slide_1.h5"], {"slide_0": 0, "slide_1": 1})


def test_our_files_open_as_trident_and_clam_read_theirs(tmp_path):
    coords = np.array([[0, 0], [512, 0], [0, 512]], np.int64)
    path = write_feature_file(tmp_path / "s.h5", features=np.ones((3, 4), np.float16), coords=coords,
                              attrs={"slide_stem": "s", "mpp": 0.25, "dimensions_lv0": [2048, 2048]},
                              coords_attrs={"patch_size": 256, "patch_size_level0": 512, "level0_magnification": 40.0,
                                            "target_magnification": 20.0, "overlap": 0},
                              features_attrs={"name": "s", "savetodir": str(tmp_path), "encoder": "resnet50_trunc"})
    with h5py.File(path, "r") as f:  # TRIDENT's read_coords, then the attributes extract_patch_features needs
        attrs = dict(f["coords"].attrs)
        assert None not in (attrs.get("patch_size"), attrs.get("level0_magnification"), attrs.get("target_magnification"))
        features, xy = f["features"][:], f["coords"][:]  # CLAM's Generic_MIL_Dataset with use_h5
        assert f["features"].maxshape == (None, 4)  # resizable, as their writers append
    assert features.dtype == np.float16 and features.shape == (3, 4) and np.array_equal(xy, coords)
    assert not list(tmp_path.glob(".*"))


def test_grids_of_foreign_files_come_from_their_attributes_or_coordinates(tmp_path):
    ys, xs = np.mgrid[0:4, 1:5]
    coords = np.stack([xs.ravel() * 512, ys.ravel() * 512], axis=1)
    feats = np.zeros((len(coords), 8), np.float32)
    trident = read_feature_file(write_trident_features(tmp_path / "t", "a", feats, coords, patch_size=256, src_mag=40,
                                                       dst_mag=20, width=4000, height=3000))
    layout = trident.grid_layout()
    assert layout.stride_lv0 == layout.patch_size_lv0 == 512 and layout.origin_lv0 == (0, 0)
    assert layout.dimensions_lv0 == (4000, 3000) and layout.grid_shape == (5, 7)
    assert layout.mpp == pytest.approx(0.25) and layout.target_mpp == pytest.approx(0.5) and layout.patch_size_px == 256
    clam = read_feature_file(write_clam_features(tmp_path / "c", "b", feats, coords + 7))
    with pytest.raises(StoreError, match=r"b.h5: the level-0 µm/px of the slide is not recorded. Fix: pass the slide"):
        clam.grid_layout()
    layout = clam.grid_layout(slide_mpp=0.5)
    assert layout.stride_lv0 == 512 and layout.origin_lv0 == (7, 7) and layout.grid_shape == (4, 5)
    assert any("inferred from the coordinates" in n for n in layout.notes)
    off = coords.copy()
    off[0] += 100  # a second tissue region gridded on its own
    odd = read_feature_file(write_clam_features(tmp_path / "d", "c", feats, off))
    with pytest.raises(StoreError, match="not on one regular grid"):
        odd.grid_layout(slide_mpp=0.5)


def test_tissue_pieces_gridded_from_corners_a_small_step_apart_are_refused_without_a_patch_size(tmp_path):
    """Review BP, A2: CLAM grids each tissue piece from its own corner, often a multiple of 64 px; two pieces whose
    grids differ by such a step line up on the 64-px grid, and a file without a patch size was mapped with 64-px
    patches (every detection and instance label of its slide then wrong) without a word."""
    ys, xs = np.mgrid[0:4, 0:4]
    left = np.stack([xs.ravel() * 256, ys.ravel() * 256], axis=1)
    coords = np.concatenate([left + np.array([64 * k, 1088 * k]) for k in range(4)])  # four pieces, 64 px apart
    feats = np.zeros((len(coords), 8), np.float32)
    pieces = read_feature_file(write_clam_features(tmp_path / "p", "two", feats, coords))
    with pytest.raises(StoreError, match=r"two.h5: neighbouring patches of a row lie 256 level-0 px apart, but the "
                                         r"positions of all patches line up only on a grid of 64 px"):
        pieces.grid_layout(slide_mpp=0.5)
    one = read_feature_file(write_clam_features(tmp_path / "o", "one", feats[:16], left))
    assert one.grid_layout(slide_mpp=0.5).stride_lv0 == 256  # one piece: its own step
    # review BU: one piece with gaps, where gaps of two cells are the commonest in a row, is no such case: patches
    # of the row's step would overlap there, so the step is the patch
    gapped = {"checker": [(x, y) for y in range(0, 1536, 256) for x in range(0, 2048, 256) if (x + y) // 256 % 2 == 0],
              "biopsy": [(0, 0), (512, 0), (256, 256)],
              "rowgaps": [(x, y) for y in range(0, 1024, 256) for x in (0, 256, 768, 1280, 1792)]}
    for name, xy in gapped.items():
        xy = np.array(xy)
        layout = read_feature_file(write_clam_features(tmp_path / name, name, feats[:1].repeat(len(xy), 0),
                                                       xy)).grid_layout(slide_mpp=0.5)
        assert (layout.stride_lv0, layout.patch_size_lv0) == (256, 256), name


def test_pieces_on_offset_grids_whose_patches_overlap_are_mapped_with_a_warning(tmp_path, caplog):
    """Review CW, A1: two CLAM tissue pieces of 512-px patches gridded from corners half a patch apart, their patches
    overlapping near the join, look like one piece with gaps on a 256-px grid (review BU): the map took 256-px
    patches without a word. The positions alone cannot tell the two apart; the choice is now said, with the fix."""
    import logging

    ys, xs = np.mgrid[0:3, 0:4]
    first = np.stack([xs.ravel() * 512, ys.ravel() * 512], axis=1)
    ys, xs = np.mgrid[0:2, 0:3]
    second = np.stack([1792 + xs.ravel() * 512, 256 + ys.ravel() * 512], axis=1)
    coords = np.concatenate([first, second])
    feats = np.zeros((len(coords), 8), np.float32)
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.features.schema"):
        layout = read_feature_file(write_clam_features(tmp_path / "p", "pieces", feats, coords)).grid_layout(
            slide_mpp=0.5)
    assert (layout.stride_lv0, layout.patch_size_lv0) == (256, 256)
    assert "pieces.h5: neighbouring patches of a row lie 512 level-0 px apart, but their positions line up on a " \
           "grid of 256 px and the file records no patch size: the map takes 256-px patches" in caplog.text
    assert "record the patch size on coords" in caplog.text
    assert any("chosen over the row step 512 px" in n for n in layout.notes)


def test_train_on_clam_s_job_folder_names_its_feature_folder(tmp_path, capsys):
    """Review BP, B2: `train CLAM_DIR` (h5_files/ and pt_files/ inside) said "no patch stores found ... run
    `wsi-milssl tile` first"; it names the folder of feature files to pass."""
    feats = np.zeros((4, 8), np.float32)
    coords = np.arange(8).reshape(4, 2) * 256
    write_clam_features(tmp_path / "clam", "s1", feats, coords)
    (tmp_path / "clam" / "pt_files").mkdir()
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\ns1,1\n")
    said = (f"no patch stores or feature files directly in {tmp_path / 'clam'}, but {tmp_path / 'clam' / 'h5_files'} "
            "holds 1 feature file(s). Fix: pass that folder")
    assert main(["train", str(tmp_path / "clam"), "--labels", str(labels), "--out", str(tmp_path / "run")]) == 1
    assert said in capsys.readouterr().err
    # review CW: with a feature model the same (it was told to use resnet18 for images)
    assert main(["train", str(tmp_path / "clam"), "--labels", str(labels), "--model", "mlp",
                 "--out", str(tmp_path / "run")]) == 1
    assert said in capsys.readouterr().err
    # CLAM's pt_files/ itself: its .pt files are not read, the h5_files/ beside it are
    torch_file = tmp_path / "clam" / "pt_files" / "s1.pt"
    torch_file.write_bytes(b"not read")
    assert main(["train", str(tmp_path / "clam" / "pt_files"), "--labels", str(labels), "--out",
                 str(tmp_path / "run")]) == 1
    assert "holds .pt files (CLAM's pt_files/), which are not read. Fix: pass the h5_files/ folder beside it" \
        in capsys.readouterr().err


def test_a_trident_job_folder_names_its_patch_feature_folder_alone(tmp_path, capsys):
    """Review CW: TRIDENT's job folder holds its patch features two levels down (<mag>x_<size>px_<overlap>px_overlap/
    features_<encoder>/), beside patches/ (coordinates) and slide_features_<encoder>/ (one vector per slide): train
    said to tile, and one level down every .h5 folder was named as one to pass; heatmap --features said nothing."""
    job = tmp_path / "trident"
    run = job / "20x_256px_0px_overlap"
    coords = np.arange(8).reshape(4, 2) * 512
    write_trident_features(run / "features_conch_v15", "s1", np.zeros((4, 8), np.float32), coords, patch_size=256,
                           src_mag=40, dst_mag=20, width=4096, height=4096)
    (run / "patches").mkdir()
    with h5py.File(run / "patches" / "s1_patches.h5", "w") as fh:
        fh["coords"] = coords
    (run / "slide_features_titan").mkdir()
    with h5py.File(run / "slide_features_titan" / "s1.h5", "w") as fh:
        fh["features"] = np.zeros(8, np.float32)
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\ns1,1\n")
    for given in (job, run):
        assert main(["train", str(given), "--labels", str(labels), "--out", str(tmp_path / "out")]) == 1
        err = capsys.readouterr().err
        assert f"but {run / 'features_conch_v15'} holds 1 feature file(s). Fix: pass that folder" in err, err
        assert "patches holds" not in err and "slide_features_titan holds" not in err
    assert main(["heatmap", "--features", str(job), "--model", str(tmp_path / "none.pt"), "--out",
                 str(tmp_path / "maps")]) != 0
    assert f"{run / 'features_conch_v15'} holds 1 feature file(s)" in capsys.readouterr().err


def test_features_saved_as_a_batch_of_one_slide_are_read(tmp_path):
    """Review BP, C3: features of shape (1, N, D) (a batch of one, as some pipelines save them) were refused with a
    general fix; they are the slide's (N, D). Other 3-D shapes are still refused."""
    import h5py

    coords = np.arange(8).reshape(4, 2) * 256
    path = write_clam_features(tmp_path, "one", np.ones((4, 8), np.float32), coords)
    with h5py.File(path, "a") as fh:
        del fh["features"]
        fh["features"] = np.ones((1, 4, 8), np.float32)
    assert read_feature_file(path).features.shape == (4, 8)
    with h5py.File(path, "a") as fh:
        del fh["features"]
        fh["features"] = np.ones((2, 2, 8), np.float32)
    with pytest.raises(StoreError, match=r"'features' must be 2-D \(N, D\); got shape \(2, 2, 8\)"):
        read_feature_file(path)


def test_bags_whose_names_differ_only_in_case_are_refused(tmp_path):
    """Review BP, C2: SYNTH_001.h5 beside synth_001.h5 trained as two bags (one label for both) while evaluate
    refused them as one slide."""
    feats = np.zeros((4, 8), np.float32)
    coords = np.arange(8).reshape(4, 2) * 256
    for stem in ("synth_001", "SYNTH_001", "synth_002"):
        write_clam_features(tmp_path, stem, feats, coords)
    folder = tmp_path / "h5_files"
    (tmp_path / "labels.csv").write_text("slide,label\nsynth_001,1\nsynth_002,0\n")
    labels = read_labels_csv(tmp_path / "labels.csv")  # names matched without case, as every stage reads them
    with pytest.raises(ConfigError, match=r"bag 'synth_001' and bag 'SYNTH_001' \(.*SYNTH_001.h5\) differ only in "
                                          r"letter case"):
        read_feature_files(sorted(folder.glob("*.h5")), labels)
    (folder / "SYNTH_001.h5").unlink()
    assert read_feature_files(sorted(folder.glob("*.h5")), labels).n_bags == 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_feature_file_with_non_finite_values_is_refused_naming_the_rows(tmp_path, capsys, bad):
    """An overflowed half-precision encoder leaves inf in a row: the file is refused where it is read (train,
    heatmap), not passed on as a 'diverged training' or a 'diverged checkpoint'."""
    feats = np.ones((6, 4), np.float32)
    feats[4, 2] = bad
    path = write_clam_features(tmp_path, "s1", feats, np.arange(12).reshape(6, 2) * 256)
    with pytest.raises(StoreError, match=r"s1\.h5: 'features' holds NaN or infinite values in 1 of 6 rows \(first: "
                                         r"row 4\), so no model can score them\. Fix: extract the features again"):
        read_feature_file(path)


def _write_h5(path, features, **datasets):
    """A bare feature file of another tool: ``features`` in the dtype given, coords, and ``datasets`` as given."""
    with h5py.File(path, "w") as fh:
        fh["features"] = features
        fh["coords"] = np.stack([np.arange(len(features)) * 256, np.zeros(len(features))], 1).astype(np.int64)
        for name, value in datasets.items():
            fh[name] = value
    return path


def test_a_float64_feature_beyond_float32s_range_is_refused_naming_the_row(tmp_path, capsys):
    """Was checked in the file's float64 only: 1e39 then became inf in the float32 cast of `train`, and training
    ended in a traceback of the pseudo-label solver ('probs must be finite probabilities')."""
    feats = np.random.default_rng(0).normal(size=(5, 4))
    feats[3, 1] = -1e39
    path = _write_h5(tmp_path / "s1.h5", feats)
    with pytest.raises(StoreError, match=r"s1\.h5: 'features' holds values beyond float32's range \(±3\.4e\+38\) in 1 "
                                         r"of 5 rows \(first: row 3\), which become infinite as float32"):
        read_feature_file(path)
    bags = _bags(n_bags=4, dim=4)
    for name, f, _, _ in bags:
        _write_h5(tmp_path / f"{name}.h5", f.astype(np.float64))
    (tmp_path / "s1.h5").rename(tmp_path / "slide_9.h5")
    labels = _labels(tmp_path / "labels.csv", bags, extra=["slide_9"])
    capsys.readouterr()
    assert main(["train", str(tmp_path), "--labels", str(labels), "--out", str(tmp_path / "run"), "--epochs", "1",
                 "--threads", "1", "--no-plots"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "slide_9.h5: 'features' holds values beyond float32's range" in err
    assert "(first: row 3)" in err
    np.testing.assert_array_equal(read_feature_file(tmp_path / "slide_0.h5").features, bags[0][1].astype(np.float64))


@pytest.mark.parametrize("values, dtype, found", [([0, 1, -1], np.int8, "-1"), ([0, 1, 2], np.uint8, "2"),
                                                  ([1, 0, 0.5], np.float32, "0.5")])
def test_instance_labels_other_than_0_and_1_are_refused_naming_the_values(tmp_path, capsys, values, dtype, found):
    """Were cast to uint8 as they were: -1 ('unknown' in some tools) became 255, counted as tumour by the pseudo-label
    metrics, and the validation instance AUC failed after the first epoch with a traceback of sklearn."""
    label = np.resize(np.asarray(values, dtype), 6)
    path = _write_h5(tmp_path / "s1.h5", np.ones((6, 4), np.float32), instance_label=label)
    with pytest.raises(StoreError, match=rf"s1\.h5: 'instance_label' must hold 0 \(normal\) or 1 \(tumour\); found "
                                         rf"\[{found}\] in 2 of 6 rows \(first: row 2\)\. Fix: "):
        read_feature_file(path)
    good = read_feature_file(_write_h5(tmp_path / "s2.h5", np.ones((3, 4), np.float32),
                                       instance_label=np.array([0, 1, 0], dtype)))
    assert good.instance_label.dtype == np.uint8 and good.instance_label.tolist() == [0, 1, 0]


def test_a_trident_file_of_a_wide_slide_maps_x_to_columns_and_y_to_rows(tmp_path):
    """Review EG (left open): a feature file of a slide wider than tall, TRIDENT's level0_width / level0_height
    read as (width, height): the grid is rows x columns = height x width in patches, and each patch lands on the
    cell its (x, y) names; a transpose shows only on a non-square slide."""
    width, height, step = 7680, 2560, 512  # 15 x 5 patches of 512 level-0 px (256 px at 20x of a 40x slide)
    ys, xs = np.mgrid[0:height // step, 0:width // step]
    coords = np.stack([xs.ravel() * step, ys.ravel() * step], axis=1).astype(np.int64)
    feats = np.random.default_rng(0).normal(size=(len(coords), 8)).astype(np.float32)
    path = write_trident_features(tmp_path, "wide", feats, coords, patch_size=256, src_mag=40, dst_mag=20,
                                  width=width, height=height)
    ff = read_feature_file(path)
    layout = ff.grid_layout()
    assert layout.dimensions_lv0 == (width, height) and layout.grid_shape == (5, 15)
    assert (layout.stride_lv0, layout.patch_size_lv0) == (step, step)
    from wsi_milssl.inference.heatmap import probability_grid

    value = np.arange(len(coords), dtype=np.float32)  # each patch's own number
    grid = probability_grid(ff.coords, value, origin_lv0=layout.origin_lv0, stride_lv0=layout.stride_lv0,
                            shape=layout.grid_shape)
    assert grid.shape == (5, 15)
    for i in (0, 14, 15, 37, len(coords) - 1):  # the patch at (x, y) is in row y / step, column x / step
        x, y = coords[i]
        assert grid[y // step, x // step] == i
