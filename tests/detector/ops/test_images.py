"""On-device normalisation of the uint8 images against numpy, and the on-device resample against TensorFlow's."""

import jax
import numpy as np
import pytest
import tensorflow as tf

from detector.ops.images import normalize_images, resample_images

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


def _tf_scale_and_translate(image, size, scale, translation):
    """TensorFlow's antialiased triangle (bilinear) resample: what the host pipeline computes."""
    return tf.raw_ops.ScaleAndTranslate(
        images=image[None],
        size=size,
        scale=np.float32(scale),
        translation=np.float32(translation),
        kernel_type="triangle",
        antialias=True,
    )[0].numpy()


# (scale_y, scale_x, offset_y, offset_x, flipped): grown, shrunk (antialiased), mixed; offsets <= 0, as a
# crop window starts at or after the top-left of the resized image.
GEOMETRIES = [
    (1.7, 1.7, -5.0, -3.0, False),
    (0.4, 0.35, 0.0, 0.0, True),
    (2.5, 2.2, -20.0, -40.0, True),
    (0.9, 1.3, -2.0, 0.0, False),
    (0.13, 0.2, -0.5, -1.5, True),
    (1.0, 1.0, -7.0, -2.0, False),
]


def test_resample_matches_tensorflow_inside_the_image_whatever_the_padding_holds():
    rng = np.random.default_rng(0)
    source = rng.integers(0, 256, (37, 53, 3), np.uint8)
    canvas = np.full((4, 64, 72, 3), 0, np.uint8)
    canvas[:] = rng.integers(0, 256, canvas.shape[1:], np.uint8)  # noise where the source ends
    for start in range(0, len(GEOMETRIES), 4):
        geometries = GEOMETRIES[start : start + 4]
        geometries += [GEOMETRIES[0]] * (4 - len(geometries))
        images = canvas.copy()
        images[:, :37, :53] = source
        got = np.asarray(
            jax.jit(resample_images)(
                images,
                np.full((4, 2), (37, 53), np.int32),
                np.array([g[:4] for g in geometries], np.float32),
                np.array([g[4] for g in geometries]),
            )
        )
        assert got.dtype == np.float32 and got.shape == (4, 64, 72, 3)
        for out, (scale_y, scale_x, offset_y, offset_x, flipped) in zip(got, geometries):
            mirrored = source[:, ::-1] if flipped else source
            want = _tf_scale_and_translate(mirrored, (64, 72), (scale_y, scale_x), (offset_y, offset_x))
            # The resized image's pixels (outside them TensorFlow extrapolates; the batch masks them).
            height = min(64, int(37 * scale_y + offset_y))
            width = min(72, int(53 * scale_x + offset_x))
            np.testing.assert_allclose(out[:height, :width], want[:height, :width], atol=2e-3, rtol=0)


def test_the_identity_geometry_returns_the_pixels_exactly():
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (2, 24, 32, 3), np.uint8)
    out = np.asarray(
        resample_images(
            images,
            np.array([[24, 32], [10, 7]], np.int32),
            np.tile(np.float32([1, 1, 0, 0]), (2, 1)),
            np.zeros(2, bool),
        )
    )
    np.testing.assert_array_equal(out[0], images[0])
    np.testing.assert_array_equal(out[1, :10, :7], images[1, :10, :7])
    assert not out[1, 10:].any() and not out[1, :, 7:].any()  # samples no source pixel: 0


def test_an_empty_example_resamples_to_zeros():
    """What the pipeline puts in place of an undecodable image: no source pixels, geometry all ones."""
    out = resample_images(
        np.full((1, 8, 8, 3), 255, np.uint8), np.zeros((1, 2), np.int32), np.ones((1, 4), np.float32), np.zeros(1, bool)
    )
    assert np.isfinite(out).all() and not np.asarray(out).any()
