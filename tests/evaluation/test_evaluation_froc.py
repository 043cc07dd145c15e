"""CAMELYON16 FROC on hand-built level-5 masks, with the expected numbers worked out by hand.

Geometry used throughout (unless a test says otherwise): mpp 0.25 µm/px, so one level-5 pixel is
32 * 0.25 = 8 µm; the margin is 75 µm / 2 = 37.5 µm = 4.6875 level-5 px, so a pixel 4 px from tumour
(32 µm) joins the region and one 5 px away (40 µm) does not; the ITC limit is 275 µm = 34.375 px.
A detection at level-0 (x, y) falls on level-5 pixel (x // 32, y // 32).
"""

from __future__ import annotations

import numpy as np
import pytest

from wsi_milssl.evaluation.froc import (
    FP_RATES,
    evaluation_mask,
    froc_curve,
    froc_score,
    interpolate_sensitivity,
    match_detections,
)

DS = 32


def lv0(row: int, col: int, *, dx: int = DS // 2, dy: int = DS // 2) -> tuple[float, float]:
    """Level-0 (x, y) inside level-5 pixel (row, col), at offset (dx, dy) within it."""
    return float(col * DS + dx), float(row * DS + dy)


def block_mask(shape, *blocks) -> np.ndarray:
    mask = np.zeros(shape, dtype=bool)
    for r0, r1, c0, c1 in blocks:  # inclusive bounds
        mask[r0 : r1 + 1, c0 : c1 + 1] = True
    return mask


def dets(*rows):
    """rows of (prob, (x, y)) -> (probs, xs, ys)."""
    probs = np.array([p for p, _ in rows], dtype=float)
    xs = np.array([xy[0] for _, xy in rows], dtype=float)
    ys = np.array([xy[1] for _, xy in rows], dtype=float)
    return probs, xs, ys


# Tumour slide T1: lesion A (40x40 px block), lesion B (40x40), ITC C (3x3 block).
A = (20, 59, 20, 59)
B = (80, 119, 20, 59)
C = (20, 22, 90, 92)
# Tumour slide T2: lesion D.
D = (40, 89, 40, 89)


def scenario():
    """The five-slide scenario; returns the matches and a dict naming the T1 detections."""
    t1 = evaluation_mask(block_mask((128, 128), A, B, C), mpp=0.25)
    t2 = evaluation_mask(block_mask((128, 128), D), mpp=0.25)
    named = {
        "A centre": (0.9, lv0(40, 40)),
        "A again": (0.6, lv0(30, 50)),
        "on ITC C": (0.95, lv0(21, 91)),
        # B's right edge is column 59: column 63 is 4 px = 32 µm away (inside the 37.5 µm margin);
        # x = 63*32 + 31 is the last level-0 pixel of column 63.
        "just inside B": (0.5, (63 * DS + 31.0, 100 * DS + 16.0)),
        # A's right edge is column 59: column 64 is 5 px = 40 µm away (outside); x = 64*32 is the
        # first level-0 pixel of column 64, one level-0 pixel right of the detection above.
        "just outside A": (0.5, (64 * DS + 0.0, 40 * DS + 16.0)),
    }
    m_t1 = match_detections(*dets(*named.values()), mask=t1, stem="T1")
    m_t2 = match_detections(*dets(), mask=t2, stem="T2")  # tumour slide without detections
    m_n1 = match_detections(*dets((0.85, (100.0, 100.0)), (0.4, (5000.0, 9000.0))), mask=None, stem="N1")
    m_n2 = match_detections(*dets(), mask=None, stem="N2")  # normal slide without detections
    m_n3 = match_detections(*dets((0.3, (10.0, 20.0))), mask=None, stem="N3")
    return [m_t1, m_t2, m_n1, m_n2, m_n3], list(named)


def test_mask_regions_margin_and_itc():
    mask = evaluation_mask(block_mask((128, 128), A, B, C), mpp=0.25)
    assert mask.margin_px == pytest.approx(4.6875)
    assert mask.n_regions == 3 and mask.n_lesions == 2 and mask.n_itc == 1
    # straight out from A's right edge (col 59) along row 40: 4 px inside, 5 px outside
    labels = mask.full_labels()
    assert labels.shape == (128, 128)
    row = labels[40]
    assert row[63] == row[40] != 0 and row[64] == 0
    # diagonal from A's corner (59, 59): (+3, +3) is 4.24 px (inside), (+4, +3) is 5 px (outside)
    assert labels[62, 62] == row[40] and labels[63, 62] == 0
    itc_label = labels[21, 91]
    assert mask.itc_labels == {int(itc_label)}
    # the 3x3 block grows to a disc about 11 px across: ~88 µm, far under 275 µm
    assert mask.major_axis_um[itc_label - 1] < 275.0
    assert mask.major_axis_um[row[40] - 1] > 275.0


def test_scenario_outcomes_per_detection():
    matches, names = scenario()
    t1 = matches[0]
    outcome = dict(zip(names, t1.outcome))
    assert outcome == {
        "A centre": "tp", "A again": "repeat", "on ITC C": "itc", "just inside B": "tp", "just outside A": "fp",
    }
    assert t1.n_lesions == 2 and t1.n_detected == 2 and t1.n_itc == 1
    np.testing.assert_array_equal(t1.fp_probs, [0.5])
    np.testing.assert_array_equal(np.sort(t1.lesion_probs), [0.5, 0.9])
    t2 = matches[1]
    assert t2.n_lesions == 1 and t2.n_detected == 0 and np.isnan(t2.lesion_probs).all()
    assert [m.n_fp for m in matches[2:]] == [2, 0, 1]


def test_scenario_froc_by_hand():
    """Lesions A, B (T1) and D (T2): 3. Slides: 5. TP best hits: A 0.9, B 0.5; D missed.
    FPs: 0.85, 0.4 (N1), 0.5 (just outside A), 0.3 (N3). The repeat hit on A (0.6) and the ITC hit
    (0.95) are neither.

    threshold  TP  FP  FP/slide  sensitivity
    0.9        1   0   0.0       1/3
    0.85       1   1   0.2       1/3
    0.5        2   2   0.4       2/3
    0.4        2   3   0.6       2/3
    0.3        2   4   0.8       2/3

    At 1/4 FP/slide: between (0.2, 1/3) and (0.4, 2/3): 1/3 + (0.05 / 0.2) * (1/3) = 5/12.
    At 1/2: between (0.4, 2/3) and (0.6, 2/3): 2/3. At 1, 2, 4, 8: past the last point: 2/3.
    FROC = (5/12 + 5 * 2/3) / 6 = 45/72 = 0.625.
    """
    matches, _ = scenario()
    curve = froc_curve(matches)
    assert curve.n_slides == 5 and curve.n_lesions == 3
    np.testing.assert_allclose(curve.thresholds[1:], [0.9, 0.85, 0.5, 0.4, 0.3])
    np.testing.assert_allclose(curve.fp_per_slide, [0, 0, 0.2, 0.4, 0.6, 0.8])
    np.testing.assert_allclose(curve.sensitivity, [0, 1 / 3, 1 / 3, 2 / 3, 2 / 3, 2 / 3])
    score, sens = froc_score(curve)
    np.testing.assert_allclose(sens, [5 / 12, 2 / 3, 2 / 3, 2 / 3, 2 / 3, 2 / 3], rtol=0, atol=1e-12)
    assert score == pytest.approx(0.625, abs=1e-12)


def test_each_rule_changes_the_score():
    """The scenario's score moves if any single rule were applied differently (so the test above
    can fail for each rule)."""
    matches, _ = scenario()
    base = froc_score(froc_curve(matches))[0]
    # drop the normal slide without detections: FP/slide denominators become 4
    fewer = [m for m in matches if m.stem != "N2"]
    assert froc_score(froc_curve(fewer))[0] != pytest.approx(base)
    # a tumour slide without detections still counts its lesion: without T2 sensitivity rises
    no_t2 = [m for m in matches if m.stem != "T2"]
    assert froc_score(froc_curve(no_t2))[0] > base


def test_twice_on_same_lesion_counts_once_at_highest_probability():
    mask = evaluation_mask(block_mask((64, 64), (10, 49, 10, 49)), mpp=0.25)
    m = match_detections(*dets((0.3, lv0(20, 20)), (0.8, lv0(30, 30)), (0.8, lv0(40, 40))), mask=mask)
    assert list(m.outcome) == ["repeat", "tp", "repeat"]  # the first of equal best probabilities wins
    np.testing.assert_array_equal(m.lesion_probs, [0.8])
    assert m.n_fp == 0
    # one slide, one lesion found at 0.8, no FP: sensitivity 1 at every FP rate
    score, sens = froc_score(froc_curve([m]))
    assert score == 1.0 and list(sens) == [1.0] * 6


def test_itc_detection_is_neither_tp_nor_fp():
    """A slide whose only region is an ITC: it has no lesion, and a hit on it is not an FP. With a
    second slide holding one lesion found at 0.7 and one FP at 0.6: curve (0,0), (0,1) at 0.7,
    (0.5, 1) at 0.6 -> FROC 1. Were the ITC hit (0.9) an FP, the first point would be (0.5, 0)."""
    itc_only = evaluation_mask(block_mask((64, 64), (30, 31, 30, 31)), mpp=0.25)
    assert itc_only.n_lesions == 0 and itc_only.n_itc == 1
    m1 = match_detections(*dets((0.9, lv0(30, 30))), mask=itc_only)
    assert list(m1.outcome) == ["itc"] and m1.n_fp == 0 and m1.n_lesions == 0
    lesion = evaluation_mask(block_mask((64, 64), (10, 49, 10, 49)), mpp=0.25)
    m2 = match_detections(*dets((0.7, lv0(20, 20)), (0.6, lv0(60, 60))), mask=lesion)
    assert list(m2.outcome) == ["tp", "fp"]
    curve = froc_curve([m1, m2])
    np.testing.assert_allclose(curve.fp_per_slide, [0, 0, 0.5])
    np.testing.assert_allclose(curve.sensitivity, [0, 1, 1])
    assert froc_score(curve)[0] == 1.0


def test_itc_threshold_is_275_um_major_axis():
    """mpp 2 µm/px: a level-5 px is 64 µm, the margin 37.5 µm = 0.59 px (no growth), the ITC limit
    275 µm = 4.30 px. A 1-px-wide line of L pixels has major axis 4*sqrt((L^2 - 1)/12):
    L = 3 -> 3.27 px = 209 µm (ITC); L = 4 -> 4.47 px = 286 µm (lesion)."""
    three = evaluation_mask(block_mask((16, 16), (5, 5, 5, 7)), mpp=2.0)
    four = evaluation_mask(block_mask((16, 16), (5, 5, 5, 8)), mpp=2.0)
    assert three.major_axis_um[0] == pytest.approx(4 * np.sqrt(8 / 12) * 64)
    assert four.major_axis_um[0] == pytest.approx(4 * np.sqrt(15 / 12) * 64)
    assert three.n_itc == 1 and three.n_lesions == 0
    assert four.n_itc == 0 and four.n_lesions == 1


@pytest.mark.parametrize("mpp", [0.243, 0.25, 0.3, 0.5])
@pytest.mark.parametrize("distance_px", [2, 3, 4, 5])
def test_margin_uses_the_slides_own_mpp(mpp, distance_px):
    """A detection ``distance_px`` level-5 pixels right of the tumour edge hits the lesion exactly
    when distance_px * 32 * mpp < 37.5 µm."""
    mask = evaluation_mask(block_mask((64, 64), (10, 49, 10, 39)), mpp=mpp)
    m = match_detections(*dets((0.5, lv0(30, 39 + distance_px))), mask=mask)
    inside = distance_px * 32 * mpp < 37.5
    assert m.outcome[0] == ("tp" if inside else "fp")


def test_holes_are_filled_and_regions_are_8_connected():
    # a ring of tumour 6 px thick around a 20x20 hole: the hole (far from tumour) joins the region
    ring = block_mask((64, 64), (10, 45, 10, 45))
    ring[16:40, 16:40] = False
    mask = evaluation_mask(ring, mpp=0.25)
    labels = mask.full_labels()
    assert mask.n_regions == 1 and labels[28, 28] == labels[12, 12] != 0
    # mpp 2: no growth; two blocks touching only at a corner form one region (8-connectivity)
    diag = evaluation_mask(block_mask((32, 32), (0, 9, 0, 9), (10, 19, 10, 19)), mpp=2.0)
    assert diag.n_regions == 1
    apart = evaluation_mask(block_mask((32, 32), (0, 9, 0, 9), (11, 19, 11, 19)), mpp=2.0)
    assert apart.n_regions == 2


def test_detections_on_normal_slides_are_all_false_positives():
    m = match_detections(*dets((0.9, (0.0, 0.0)), (0.2, (1e6, 1e6))), mask=None, stem="N")
    assert list(m.outcome) == ["fp", "fp"] and m.n_lesions == 0
    np.testing.assert_array_equal(m.fp_probs, [0.9, 0.2])


def test_detection_outside_the_mask_is_a_false_positive(caplog):
    mask = evaluation_mask(block_mask((8, 8), (0, 7, 0, 7)), mpp=0.25)
    m = match_detections(*dets((0.5, (8 * DS + 1.0, 10.0)), (0.4, (-1.0, 10.0))), mask=mask, stem="S")
    assert list(m.outcome) == ["fp", "fp"] and m.n_outside_mask == 2
    assert "outside the slide's evaluation mask" in caplog.text


def test_no_detections_anywhere_scores_zero():
    mask = evaluation_mask(block_mask((64, 64), (10, 49, 10, 49)), mpp=0.25)
    curve = froc_curve([match_detections(*dets(), mask=mask), match_detections(*dets(), mask=None)])
    assert curve.n_lesions == 1
    np.testing.assert_array_equal(curve.fp_per_slide, [0.0])
    score, sens = froc_score(curve)
    assert score == 0.0 and list(sens) == [0.0] * 6


def test_no_lesions_gives_nan_sensitivity():
    curve = froc_curve([match_detections(*dets((0.5, (1.0, 1.0))), mask=None)])
    score, sens = froc_score(curve)
    assert curve.n_lesions == 0 and np.isnan(score) and np.isnan(sens).all()


def test_vertical_step_takes_the_higher_sensitivity():
    """4 slides, two lesions found at 0.8 and 0.6, one FP at 0.7: points (0, 0), (0, 1/2) at 0.8,
    (1/4, 1/2) at 0.7, (1/4, 1) at 0.6. At exactly 1/4 FP/slide the curve is vertical: 1 counts,
    so every rate gives 1 and FROC = 1."""
    mask = evaluation_mask(block_mask((128, 128), (10, 49, 10, 49), (70, 109, 70, 109)), mpp=0.25)
    m = match_detections(*dets((0.8, lv0(20, 20)), (0.6, lv0(90, 90)), (0.7, lv0(5, 120))), mask=mask)
    empty = [match_detections(*dets(), mask=None) for _ in range(3)]
    curve = froc_curve([m, *empty])
    np.testing.assert_allclose(curve.fp_per_slide, [0, 0, 0.25, 0.25])
    np.testing.assert_allclose(curve.sensitivity, [0, 0.5, 0.5, 1.0])
    assert froc_score(curve)[0] == 1.0


def test_interpolation_matches_numpy_interp_on_random_curves():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 12))
        fp = np.concatenate([[0.0], np.sort(rng.integers(0, 40, n) / 4.0)])
        sens = np.concatenate([[0.0], np.sort(rng.integers(0, 6, n) / 5.0)])
        ours = interpolate_sensitivity(fp, sens, FP_RATES)
        np.testing.assert_allclose(ours, np.interp(FP_RATES, fp, sens), atol=1e-12)


def _brute_force_froc(matches) -> float:
    """An independent, literal reading of the protocol: for every distinct probability t, TP = lesions
    whose best hit is >= t, FP = false positives >= t; then linear interpolation via np.interp on the
    curve with the (0, 0) point."""
    tp = [p for m in matches for p in m.lesion_probs if not np.isnan(p)]
    fp = [p for m in matches for p in m.fp_probs]
    n_lesions = sum(m.n_lesions for m in matches)
    points = [(0.0, 0.0)]
    for t in sorted(set(tp + fp), reverse=True):
        points.append((sum(p >= t for p in fp) / len(matches), sum(p >= t for p in tp) / n_lesions))
    xs, ys = zip(*points)
    return float(np.mean(np.interp(FP_RATES, xs, ys)))


def test_froc_matches_a_brute_force_count_on_random_slides():
    rng = np.random.default_rng(1)
    base = block_mask((128, 128), A, B, C, D)
    mask = evaluation_mask(base, mpp=0.25)
    for trial in range(30):
        matches = []
        for s in range(int(rng.integers(1, 6))):
            n = int(rng.integers(0, 15))
            probs = np.round(rng.random(n), 2)  # ties on purpose
            xs, ys = rng.integers(0, 128 * DS, n).astype(float), rng.integers(0, 128 * DS, n).astype(float)
            matches.append(match_detections(probs, xs, ys, mask=mask if s % 2 == 0 else None))
        score, _ = froc_score(froc_curve(matches))
        assert score == pytest.approx(_brute_force_froc(matches), abs=1e-12), trial


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="mpp must be a positive"):
        evaluation_mask(np.zeros((4, 4), bool), mpp=0.0)
    with pytest.raises(ValueError, match="2-D array"):
        evaluation_mask(np.zeros(4, bool), mpp=0.25)
    with pytest.raises(ValueError, match="finite"):
        match_detections(np.array([np.nan]), np.array([0.0]), np.array([0.0]), mask=None)
    with pytest.raises(ValueError, match="at least one evaluated slide"):
        froc_curve([])


def test_window_gives_the_same_regions_as_the_whole_mask():
    """The mask is processed in a window around the tumour; the result equals a whole-array
    computation (distance transform, hole filling and 8-connected labelling on the full array)."""
    from scipy import ndimage
    from skimage import measure

    rng = np.random.default_rng(3)
    for trial in range(20):
        mask = np.zeros((90, 70), dtype=bool)
        for _ in range(int(rng.integers(1, 6))):
            r, c, h, w = rng.integers(0, 90), rng.integers(0, 70), rng.integers(1, 20), rng.integers(1, 20)
            mask[r : r + h, c : c + w] = True
        mpp = float(rng.choice([0.243, 0.25, 0.5, 1.0]))
        em = evaluation_mask(mask, mpp=mpp)
        near = ndimage.distance_transform_edt(~mask) < 75 / (2 * 32 * mpp)
        full = measure.label(ndimage.binary_fill_holes(near), connectivity=2)
        np.testing.assert_array_equal(em.full_labels(), full, err_msg=str(trial))
    empty = evaluation_mask(np.zeros((5, 5), bool), mpp=0.25)
    assert empty.n_regions == 0 and empty.full_labels().shape == (5, 5)
    assert empty.label_at(np.array([40.0]), np.array([40.0]))[0] == 0


def test_margin_zero_is_the_tumour_itself():
    """margin_um = 0: the evaluation regions are the tumour pixels themselves (holes filled), not
    nothing: every tumour pixel has distance 0, which is not under a margin of 0 px. A detection on the
    tumour is a TP; one a pixel beside it an FP."""
    ring = block_mask((64, 64), (10, 45, 10, 45))
    ring[16:40, 16:40] = False
    mask = evaluation_mask(ring, mpp=0.25, margin_um=0.0)
    filled = block_mask((64, 64), (10, 45, 10, 45))
    np.testing.assert_array_equal(mask.full_labels() > 0, filled)
    assert mask.n_lesions == 1 and mask.margin_px == 0.0
    m = match_detections(*dets((0.9, lv0(12, 12)), (0.5, lv0(12, 46))), mask=mask)
    assert list(m.outcome) == ["tp", "fp"]


@pytest.mark.parametrize("margin_um", [1.0, 8.0, 75.0, 200.0])
def test_positive_margins_are_the_challenge_scripts_regions(margin_um):
    """Any margin above 0 gives the challenge script's regions bit for bit (its computeEvaluationMask:
    ``binary_fill_holes(distance < threshold)`` on the whole mask, 8-connected labels)."""
    from scipy import ndimage
    from skimage import measure

    rng = np.random.default_rng(7)
    for trial in range(10):
        mask = np.zeros((60, 50), dtype=bool)
        for _ in range(int(rng.integers(1, 5))):
            r, c, h, w = rng.integers(0, 60), rng.integers(0, 50), rng.integers(1, 12), rng.integers(1, 12)
            mask[r : r + h, c : c + w] = True
        em = evaluation_mask(mask, mpp=0.243, margin_um=margin_um)
        near = ndimage.distance_transform_edt(~mask) < margin_um / (2 * 32 * 0.243)
        full = measure.label(ndimage.binary_fill_holes(near), connectivity=2)
        np.testing.assert_array_equal(em.full_labels(), full, err_msg=str(trial))
