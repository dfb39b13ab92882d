"""The uint8 transforms against the float reference they replace: pixels within half a grey level.

The reference is the transform as it was before pixels became uint8: the
whole image resized (bilinear, antialiased, TF2 half-pixel centres) in
float32, the window cropped from it, normalised on the host, zero-padded.
The pipeline now resizes only what it needs (a window, or the whole image
with the plain bilinear kernel where that is cheaper), rounds to uint8 and
leaves normalising to the device; after `normalize_images` the two must
agree to half a grey level over the standard deviation. Boxes do not
change: their code is the same, and they are checked against the pixels in
test_transforms.py.

With input.resize_on_device the host ships the source pixels a window needs
and the train step resamples them; after that resample and normalisation
the network sees the host-resized image to half a grey level (the host's
rounding), with the same boxes.
"""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from detector.ops.images import normalize_images, resample_images
from input_pipeline import transforms

MEAN = (123.675, 116.28, 103.53)
STD = (58.395, 57.12, 57.375)
# Half a grey level from rounding to uint8, plus float32 rounding of two different resize kernels.
TOLERANCE_GREY_LEVELS = 0.5 + 1e-2


def _photo(height, width, seed):
    """Smooth colour content with sharp rectangles: both what resizing blurs and what it must keep."""
    rng = np.random.default_rng(seed)
    small = rng.uniform(0, 255, (max(2, height // 40), max(2, width // 40), 3)).astype(np.float32)
    image = tf.image.resize(small, (height, width), method="bicubic").numpy()
    for _ in range(4):
        y0, x0 = rng.integers(0, height - 1), rng.integers(0, width - 1)
        image[y0 : y0 + height // 5, x0 : x0 + width // 5] = rng.uniform(0, 255, 3)
    return np.clip(np.round(image), 0, 255).astype(np.uint8)


def _decoded(image, encoding):
    """The image written as JPEG or PNG and decoded as the pipeline decodes it (uint8, 3 channels)."""
    encoded = tf.io.encode_jpeg(image, quality=90) if encoding == "jpeg" else tf.io.encode_png(image)
    return tf.io.decode_image(encoded, channels=3, dtype=tf.uint8, expand_animations=False)


def _reference_window(image, new_hw, offset_yx, window_hw):
    whole = tf.image.resize(tf.cast(image, tf.float32), new_hw, method="bilinear", antialias=True)
    (y, x), (h, w) = offset_yx, window_hw
    return whole[y : y + h, x : x + w].numpy()


SOURCES = [(480, 640, "jpeg"), (333, 500, "png"), (48, 64, "png"), (900, 300, "jpeg")]


@pytest.mark.parametrize("height, width, encoding", SOURCES)
def test_the_window_resize_equals_resizing_the_whole_image_and_cropping(height, width, encoding):
    image = _decoded(_photo(height, width, seed=height), encoding)
    rng = np.random.default_rng(width)
    branches = set()
    for i, factor in enumerate((0.1, 0.3, 0.8, 1.0, 1.3, 1.9, 2.6, 4.0, 1.1, 1.5)):
        new_hw = np.maximum(np.round(np.array([height, width]) * factor).astype(np.int32), 1)
        # Small windows of a large image, and windows of most of it (where the whole is resized).
        wanted = rng.integers(16, 400, 2) if i % 2 else np.ceil(new_hw * rng.uniform(0.75, 1.0, 2))
        window_hw = np.maximum(np.minimum(new_hw, wanted), 1).astype(np.int32)
        offset_yx = np.array([rng.integers(0, new_hw[i] - window_hw[i] + 1) for i in range(2)], np.int32)
        got = transforms._resize_window(image, tf.constant(new_hw), tf.constant(offset_yx), tf.constant(window_hw))
        want = _reference_window(image, new_hw, offset_yx, window_hw)
        assert got.shape == want.shape
        np.testing.assert_allclose(got.numpy(), want, atol=1e-2, err_msg=f"factor {factor}")
        upscaled = (new_hw >= [height, width]).all()
        branches.add(bool(upscaled and new_hw.prod() <= transforms._WHOLE_RESIZE_MAX_AREA_RATIO * window_hw.prod()))
    assert branches == {True, False}  # both ways of resizing were compared


def test_to_pixels_rounds_to_the_nearest_grey_level():
    values = tf.constant([0.0, 0.49, 0.5, 1.2, 127.5, 254.49, 254.5, 255.0])
    np.testing.assert_array_equal(transforms.to_pixels(values), [0, 0, 1, 1, 128, 254, 255, 255])


def _normalised(out):
    """The transform's uint8 output as the network sees it, through the device's normalisation."""
    return np.asarray(normalize_images(out["image"].numpy()[None], out["image_hw"].numpy()[None], MEAN, STD))[0]


def _reference_normalised(image, new_hw, offset_yx, window_hw, out_hw):
    window = (_reference_window(image, new_hw, offset_yx, window_hw) - np.array(MEAN)) / np.array(STD)
    padded = np.zeros((*out_hw, 3), np.float32)
    padded[: window.shape[0], : window.shape[1]] = window
    return padded


@pytest.mark.parametrize("height, width, encoding", SOURCES)
def test_eval_transform_matches_the_float_reference(height, width, encoding):
    image = _decoded(_photo(height, width, seed=height + 1), encoding)
    example = {"image": image, "boxes": tf.zeros([0, 4]), "labels": tf.zeros([0], tf.int32), "image_id": 1}
    opts = transforms.TransformOptions(image_size=(256, 192), max_boxes=4)
    out = transforms.eval_transform(example, opts)
    new_hw = out["image_hw"].numpy()
    scale = min(256 / height, 192 / width)
    np.testing.assert_array_equal(new_hw, np.minimum(np.round(np.array([height, width]) * scale), [256, 192]))
    want = _reference_normalised(image, new_hw, (0, 0), new_hw, (256, 192))
    np.testing.assert_allclose(_normalised(out), want, atol=TOLERANCE_GREY_LEVELS / min(STD))
    assert not out["image"].numpy()[new_hw[0] :].any() and not out["image"].numpy()[:, new_hw[1] :].any()


@pytest.mark.parametrize("height, width, encoding", SOURCES)
@pytest.mark.parametrize("factor", [0.3, 1.0, 1.7])
def test_train_transform_matches_the_float_reference_where_the_image_fits(height, width, encoding, factor):
    """A fixed jitter factor; where the resized image fits the output there is no crop offset to know."""
    image = _decoded(_photo(height, width, seed=width + 2), encoding)
    example = {"image": image, "boxes": tf.zeros([0, 4]), "labels": tf.zeros([0], tf.int32), "image_id": 1}
    size = (224, 224)
    opts = transforms.TransformOptions(
        image_size=size, max_boxes=4, scale_jitter=(factor, factor), horizontal_flip=False
    )
    out = transforms.train_transform(example, tf.constant([3, 4]), opts)
    new_hw = np.maximum(np.round(np.array([height, width], np.float32) * np.float32(out["scale"])), 1).astype(int)
    window_hw = np.minimum(new_hw, size)
    np.testing.assert_array_equal(out["image_hw"], window_hw)
    if (new_hw <= size).all():
        want = _reference_normalised(image, new_hw, (0, 0), window_hw, size)
        np.testing.assert_allclose(_normalised(out), want, atol=TOLERANCE_GREY_LEVELS / min(STD))


def _on_the_device(out):
    """A transform's output as the train step sees it: resampled (with input.resize_on_device) and normalised."""
    batch = {key: value.numpy()[None] for key, value in out.items()}
    resampled = resample_images(batch["image"], batch["source_hw"], batch["source_to_image"], batch["source_flipped"])
    return np.asarray(normalize_images(resampled, batch["image_hw"], MEAN, STD))[0]


@pytest.mark.parametrize("height, width, encoding", SOURCES)
def test_train_transform_resized_on_the_device_matches_the_host(height, width, encoding):
    image = _decoded(_photo(height, width, seed=height + 3), encoding)
    rng = np.random.default_rng(height)
    corners = np.sort(rng.uniform(0, 1, (6, 2, 2)), axis=1) * [height, width]  # [box, (min, max), (y, x)]
    boxes = corners.reshape(6, 4)
    example = {
        "image": image,
        "boxes": tf.constant(boxes, tf.float32),
        "labels": tf.range(6),
        "image_id": 1,
    }
    size = (384, 384)
    on_host = transforms.TransformOptions(image_size=size, max_boxes=8, scale_jitter=(0.3, 4.0))
    on_device = dataclasses.replace(on_host, resize_on_device=True)
    ways = set()
    for seed in range(8):
        host = transforms.train_transform(example, tf.constant([seed, 5]), on_host)
        device = transforms.train_transform(example, tf.constant([seed, 5]), on_device)
        for key in ("boxes", "labels", "boxes_mask", "image_hw", "scale", "original_size"):
            np.testing.assert_array_equal(host[key], device[key], err_msg=key)
        np.testing.assert_allclose(_on_the_device(device), _on_the_device(host), atol=TOLERANCE_GREY_LEVELS / min(STD))
        ways.add("device" if device["source_to_image"].numpy()[0] != 1.0 else "host")
        assert (device["source_hw"].numpy() <= size).all()
    # Grown windows always fit; a shrunk window of a source larger than the output samples more pixels than the
    # output holds: the host resizes those.
    assert "device" in ways and (("host" in ways) == (max(height, width) > size[0]))


@pytest.mark.slow  # 5-7 s of compiling: the slow tier
def test_a_source_size_larger_than_the_output_moves_shrunk_windows_to_the_device():
    height, width = 900, 300
    image = _decoded(_photo(height, width, seed=11), "jpeg")
    example = {"image": image, "boxes": tf.constant([[10.0, 20.0, 400.0, 250.0]]), "labels": tf.constant([1])}
    example["image_id"] = 1
    on_host = transforms.TransformOptions(image_size=(256, 192), max_boxes=4, scale_jitter=(0.2, 1.2))
    on_device = dataclasses.replace(on_host, resize_on_device=True, source_size=(912, 304))
    for seed in range(4):
        host = transforms.train_transform(example, tf.constant([seed, 1]), on_host)
        device = transforms.train_transform(example, tf.constant([seed, 1]), on_device)
        assert device["image"].shape == (912, 304, 3) and host["image"].shape == (256, 192, 3)
        assert device["source_to_image"].numpy()[0] < 1  # shrunk, and on the device
        np.testing.assert_array_equal(host["boxes"], device["boxes"])
        batch = {key: value.numpy()[None] for key, value in device.items()}
        resampled = resample_images(
            batch["image"], batch["source_hw"], batch["source_to_image"], batch["source_flipped"], (256, 192)
        )
        got = np.asarray(normalize_images(resampled, batch["image_hw"], MEAN, STD))[0]
        np.testing.assert_allclose(got, _on_the_device(host), atol=TOLERANCE_GREY_LEVELS / min(STD))
