"""Digit bags: the paper's normal- and hard-bag protocols from real handwritten digits."""

from __future__ import annotations

import numpy as np
import pytest

from wsi_milssl.errors import ConfigError
from wsi_milssl.benchmark.digits import (
    DigitImages,
    hard_protocol,
    load_digit_images,
    make_bags,
    normal_protocol,
    positives_per_bag,
    split_images,
)


@pytest.fixture(scope="module")
def digits() -> DigitImages:
    return load_digit_images()


def test_sklearn_digits_are_real_8x8_images_in_unit_range(digits):
    assert digits.images.shape == (1797, 8, 8) and digits.images.dtype == np.float32
    assert digits.images.min() == 0.0 and digits.images.max() == 1.0
    assert np.bincount(digits.labels).tolist()[9] == 180
    assert digits.image_shape == (8, 8) and len(digits) == 1797


@pytest.mark.parametrize(("ratio", "size", "expected"), [(0.01, 20, 1), (0.05, 20, 1), (0.1, 20, 2), (0.2, 20, 4),
                                                          (0.5, 20, 10), (0.7, 20, 14), (0.01, 100, 1), (0.05, 50, 3)])
def test_positives_per_bag_rounds_and_keeps_at_least_one(ratio, size, expected):
    assert positives_per_bag(ratio, size) == expected


def test_positives_per_bag_rejects_a_bag_without_negatives():
    with pytest.raises(ConfigError, match="leaves no negative"):
        positives_per_bag(0.98, 20)
    with pytest.raises(ConfigError, match=r"in \(0, 1\)"):
        positives_per_bag(1.5, 20)


def test_normal_bags_follow_the_paper_construction(digits):
    idx = np.arange(len(digits))
    bags = make_bags(digits, idx, positive_digits=(9,), ratio=0.1, bag_size=20, seed=3, name="t")
    a = bags.positives_per_bag
    assert a == 2 and bags.realised_ratio == 0.1
    # alternate positive / negative bags, equal numbers, every bag full
    assert bags.bag_labels.tolist() == [1, 0] * (bags.n_bags // 2)
    assert np.bincount(bags.bag_ids).tolist() == [20] * bags.n_bags
    per_bag_pos = np.bincount(bags.bag_ids, weights=bags.instance_labels, minlength=bags.n_bags)
    assert per_bag_pos[bags.bag_labels == 1].tolist() == [a] * bags.n_positive_bags
    assert per_bag_pos[bags.bag_labels == 0].sum() == 0
    # without replacement, until the negatives run out (each pair takes 2*20 - a negatives)
    assert np.unique(bags.image_index).size == len(bags)
    assert bags.n_bags // 2 == min(180 // a, 1617 // (40 - a))
    assert np.array_equal(bags.instance_labels, (bags.digits == 9).astype(np.uint8))
    assert np.array_equal(bags.features, digits.images[bags.image_index].reshape(-1, 64))
    assert bags.bag_matrix().shape == (bags.n_bags, 20, 64)


def test_positive_instances_are_placed_at_random_in_their_bag(digits):
    bags = make_bags(digits, np.arange(len(digits)), positive_digits=(9,), ratio=0.2, bag_size=20, seed=0)
    slots = np.flatnonzero(bags.instance_labels) % 20
    assert len(set(slots.tolist())) > 10  # not always the first a slots


def test_passes_reuse_images_in_other_bags_but_never_twice_in_one(digits):
    one = make_bags(digits, np.arange(len(digits)), positive_digits=(9,), ratio=0.5, bag_size=20, seed=1)
    three = make_bags(digits, np.arange(len(digits)), positive_digits=(9,), ratio=0.5, bag_size=20, seed=1, passes=3)
    assert three.n_bags == 3 * one.n_bags
    assert np.bincount(three.image_index).max() <= 3
    for b in range(three.n_bags):
        members = three.image_index[three.bag_ids == b]
        assert np.unique(members).size == members.size


def test_split_is_stratified_disjoint_and_seeded(digits):
    tr, te = split_images(digits.labels, test_fraction=0.3, seed=5)
    assert np.intersect1d(tr, te).size == 0 and tr.size + te.size == len(digits)
    assert abs(np.mean(digits.labels[te] == 9) - 0.1) < 0.01
    tr2, te2 = split_images(digits.labels, test_fraction=0.3, seed=5)
    assert np.array_equal(te, te2)
    assert not np.array_equal(te, split_images(digits.labels, test_fraction=0.3, seed=6)[1])


def test_normal_protocol_uses_disjoint_pools_and_is_reproducible(digits):
    train, test = normal_protocol(digits, ratio=0.2, bag_size=20, seed=2)
    assert np.intersect1d(train.image_index, test.image_index).size == 0
    assert train.name == "normal-20%-train" and test.n_bags >= 10 and train.n_bags > test.n_bags
    again, _ = normal_protocol(digits, ratio=0.2, bag_size=20, seed=2)
    assert np.array_equal(train.image_index, again.image_index)
    other, _ = normal_protocol(digits, ratio=0.2, bag_size=20, seed=3)
    assert not np.array_equal(train.image_index, other.image_index)


def test_hard_protocol_mixes_0_and_8_in_training_and_separates_them_in_tests(digits):
    train, tests = hard_protocol(digits, bag_size=20, seed=0)
    assert set(tests) == {"test-normal", "test-pos0", "test-pos8"}
    assert train.positives_per_bag == 2 and set(train.positive_digits) == {0, 8}
    pos = train.digits[train.instance_labels == 1]
    assert set(pos.tolist()) == {0, 8} and 0.35 < np.mean(pos == 0) < 0.65
    # both digits appear independently: some positive bags hold a 0 and an 8, some two of one kind
    kinds = {tuple(sorted(train.digits[(train.bag_ids == b) & (train.instance_labels == 1)].tolist()))
             for b in np.flatnonzero(train.bag_labels == 1)}
    assert {(0, 8)} < kinds
    assert set(train.digits[train.instance_labels == 0].tolist()).isdisjoint({0, 8})
    assert set(tests["test-pos0"].digits.tolist()) & {0, 8} == {0}
    assert set(tests["test-pos8"].digits.tolist()) & {0, 8} == {8}
    assert set(tests["test-normal"].digits.tolist()) & {0, 8} == {0, 8}
    for t in tests.values():
        assert np.intersect1d(t.image_index, train.image_index).size == 0
        assert t.bag_labels.sum() * 2 == t.n_bags


def test_too_few_images_for_a_bag_says_what_to_change(digits):
    idx = np.flatnonzero(digits.labels != 9)[:30]
    idx = np.concatenate([idx, np.flatnonzero(digits.labels == 9)[:2]])
    with pytest.raises(ConfigError, match="cannot fill one positive bag.*smaller bag size"):
        make_bags(digits, idx, positive_digits=(9,), ratio=0.1, bag_size=20, seed=0, name="tiny")


def test_bag_arguments_are_validated(digits):
    idx = np.arange(len(digits))
    with pytest.raises(ConfigError, match="bag_size must be an integer >= 2"):
        make_bags(digits, idx, positive_digits=(9,), ratio=0.1, bag_size=1, seed=0)
    with pytest.raises(ConfigError, match="passes must be"):
        make_bags(digits, idx, positive_digits=(9,), ratio=0.1, bag_size=20, seed=0, passes=0)
    with pytest.raises(ConfigError, match="subset of positive_digits"):
        make_bags(digits, idx, positive_digits=(0, 8), present_digits=(3,), ratio=0.1, bag_size=20, seed=0)
