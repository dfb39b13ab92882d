"""On-device normalisation of the batch's uint8 images, against numpy."""

import jax
import numpy as np
import pytest

from detector.ops.images import normalize_images

MEAN = (123.675, 116.28, 103.53)
STD = (58.395, 57.12, 57.375)


def test_pixels_are_normalised_inside_each_image_and_zero_in_its_padding():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (3, 6, 8, 3), dtype=np.uint8)  # the padding holds noise too
    image_hw = np.array([[6, 8], [4, 5], [0, 0]], np.int32)  # full, padded, an empty slot
    out = np.asarray(jax.jit(normalize_images, static_argnums=(2, 3))(images, image_hw, MEAN, STD))
    assert out.dtype == np.float32 and out.shape == images.shape
    expected = (images.astype(np.float64) - MEAN) / STD
    np.testing.assert_allclose(out[0], expected[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out[1, :4, :5], expected[1, :4, :5], rtol=1e-6, atol=1e-6)
    assert not out[1, 4:].any() and not out[1, :, 5:].any()
    assert not out[2].any()


@pytest.mark.parametrize("shape", [(1, 1, 1, 3), (2, 5, 3, 3)])
def test_a_mean_coloured_pixel_normalises_to_about_zero(shape):
    images = np.broadcast_to(np.round(MEAN).astype(np.uint8), shape)
    image_hw = np.broadcast_to(shape[1:3], (shape[0], 2)).astype(np.int32)
    out = np.asarray(normalize_images(images, image_hw, MEAN, STD))
    assert np.abs(out).max() < 0.5 / min(STD)  # within half a grey level of the mean
