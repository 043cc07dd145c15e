"""The entropy filter: bits of the 256-bin greyscale histogram, as skimage.measure.shannon_entropy."""

from __future__ import annotations

import numpy as np
import pytest
from skimage.measure import shannon_entropy

from wsi_milssl.slide.entropy import entropy_bits, entropy_bits_batch, grey_uint8


def _patches(rng: np.random.Generator) -> list[np.ndarray]:
    flat = np.full((64, 64, 3), 240, np.uint8)
    noise = np.repeat(rng.integers(0, 256, (64, 64, 1), dtype=np.uint8), 3, axis=2)  # uniform grey levels
    two = np.zeros((64, 64, 3), np.uint8)
    two[:, 32:] = 255
    pale = np.clip(rng.normal(235, 6, (96, 80, 3)), 0, 255).astype(np.uint8)
    stain = np.clip(rng.normal([180, 110, 170], 40, (128, 128, 3)), 0, 255).astype(np.uint8)
    return [flat, noise, two, pale, stain]


def test_entropy_agrees_with_skimage_on_the_greyscale_patch():
    rng = np.random.default_rng(0)
    for patch in _patches(rng):
        grey = grey_uint8(patch)
        assert grey.dtype == np.uint8 and grey.shape == patch.shape[:2]
        expected = shannon_entropy(grey, base=2)
        assert entropy_bits(patch) == pytest.approx(expected, abs=1e-9)
        assert entropy_bits(grey) == pytest.approx(expected, abs=1e-9)


def test_entropy_known_values_and_batch():
    rng = np.random.default_rng(1)
    flat, noise, two, _pale, _stain = _patches(rng)
    assert entropy_bits(flat) == 0.0
    assert entropy_bits(two) == pytest.approx(1.0)
    assert 7.9 < entropy_bits(noise) <= 8.0
    batch = np.stack([flat, noise, two])
    np.testing.assert_allclose(entropy_bits_batch(batch), [entropy_bits(p) for p in batch], atol=1e-12)
    assert entropy_bits_batch(np.zeros((0, 8, 8, 3), np.uint8)).shape == (0,)


def test_entropy_on_real_slide_patches(synth_slides):
    from wsi_milssl.slide import open_slide

    with open_slide(synth_slides["tumor"]) as slide:
        patches = [slide.read_region(x, 1024, 256, target_mpp=0.5) for x in (0, 1024, 2048)]
    for p in patches:
        assert entropy_bits(p) == pytest.approx(shannon_entropy(grey_uint8(p), base=2), abs=1e-9)


def test_entropy_rejects_bad_input():
    with pytest.raises(TypeError, match="uint8"):
        entropy_bits(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(ValueError, match=r"\(h, w, 3\)"):
        entropy_bits(np.zeros((4, 4, 4), np.uint8))
