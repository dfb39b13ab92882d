"""Images as the network sees them: uint8 pixels from the input pipeline, resampled and normalised on the device.

The pipeline ships uint8 (a quarter of float32's host-to-device bytes and
none of the host's per-pixel arithmetic); the jitted steps call
`normalize_images` first, so training, prediction and the exported program
all see the same floats. With `input.resize_on_device` the train step first
resizes the shipped source pixels itself (`resample_images`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def normalize_images(
    images: jax.Array, image_hw: jax.Array, mean_rgb: Sequence[float], std_rgb: Sequence[float]
) -> jax.Array:
    """(pixel - mean_rgb) / std_rgb inside each image, 0 (the mean colour) in its padding.

    Args:
      images: uint8 `[B, H, W, 3]` RGB pixels, each image at the top-left.
      image_hw: int32 `[B, 2]` (h, w) of each image in pixels; the rest of
        its `[H, W]` is padding, whatever its bytes hold.
      mean_rgb, std_rgb: per-channel mean and standard deviation, 0-255 units.

    Returns:
      float32 `[B, H, W, 3]`.
    """
    height, width = images.shape[1:3]
    rows = jnp.arange(height)[None, :, None] < image_hw[:, 0, None, None]
    columns = jnp.arange(width)[None, None, :] < image_hw[:, 1, None, None]
    mean = jnp.asarray(mean_rgb, jnp.float32)
    inverse_std = 1.0 / jnp.asarray(std_rgb, jnp.float32)
    normalized = (images.astype(jnp.float32) - mean) * inverse_std
    return jnp.where((rows & columns)[..., None], normalized, 0.0)


def _triangle_weights(
    output_size: int, source_size: int, valid_size: jax.Array, scale: jax.Array, offset: jax.Array, flipped: jax.Array
) -> jax.Array:
    """float32 `[output_size, source_size]` antialiased bilinear weights along one axis of one image.

    Output pixel o samples the source at s = (o + 0.5 - offset) / scale
    (continuous coordinates, pixel i covering [i, i + 1)); source pixel i
    weighs max(0, 1 - |i + 0.5 - s| / support) with support = max(1 / scale,
    1), so a shrink averages every pixel it covers. Only the `valid_size`
    pixels count and each row is normalised over them (TensorFlow's
    ScaleAndTranslate with the antialiased triangle kernel: edge pixels
    repeated); a row that samples no valid pixel is all zeros. `flipped`
    mirrors the valid pixels first.
    """
    sample = (jnp.arange(output_size, dtype=jnp.float32) + 0.5 - offset) / scale
    index = jnp.arange(source_size)
    position = jnp.where(flipped, valid_size - 1 - index, index).astype(jnp.float32) + 0.5
    inverse_support = 1.0 / jnp.maximum(1.0 / scale, 1.0)
    weights = jnp.maximum(0.0, 1.0 - jnp.abs(position[None, :] - sample[:, None]) * inverse_support)
    weights = jnp.where(index[None, :] < valid_size, weights, 0.0)
    total = jnp.sum(weights, axis=1, keepdims=True)
    return jnp.where(total > 0, weights / jnp.where(total > 0, total, 1.0), 0.0)


def resample_images(
    images: jax.Array,
    source_hw: jax.Array,
    source_to_image: jax.Array,
    source_flipped: jax.Array,
    image_size: Sequence[int] | None = None,
) -> jax.Array:
    """Each example's source pixels resized, shifted and mirrored into its network image, on the device.

    With `input.resize_on_device` the pipeline ships the decoded pixels a
    training window needs instead of resizing them on the host (the most
    expensive step of large-scale jitter); this resamples them exactly as
    the host would have (antialiased bilinear, see `_triangle_weights`) as
    two matmuls per image: 2 * H * W * 3 * (H + W) flops, 13 GFLOP at
    1024 x 1024 (about 1% of a ViTDet-B training step's). An example whose
    geometry is the identity (scale 1, offset 0, not flipped) comes back
    unchanged: the host already resized it.

    Args:
      images: uint8 `[B, H, W, 3]`, each source region at the top-left.
      source_hw: int32 `[B, 2]` (h, w) of each source region, pixels; the
        rest of `[H, W]` is padding, whatever its bytes hold.
      source_to_image: float32 `[B, 4]` (scale_y, scale_x, offset_y,
        offset_x): a network-image coordinate is the source coordinate times
        scale plus offset (pixel edges, after the mirroring).
      source_flipped: bool `[B]`, mirror the source region left-right first.
      image_size: (H', W') of the network images (static); default (H, W).

    Returns:
      float32 `[B, H', W', 3]`, 0-255 units; pixels sampling no source pixel are 0.
    """
    source_height, source_width = images.shape[1:3]
    height, width = image_size or (source_height, source_width)

    def one(image, hw, geometry, flipped):
        rows = _triangle_weights(height, source_height, hw[0], geometry[0], geometry[2], False)
        columns = _triangle_weights(width, source_width, hw[1], geometry[1], geometry[3], flipped)
        # HIGH: float32 on a CPU, TF32 tensor cores on a GPU (pixels are exact
        # in TF32's 10-bit mantissa; rounding the weights and the first pass
        # costs under 0.4 of a grey level), three bfloat16 passes on a TPU.
        # A single bfloat16 pass could be a grey level off.
        resized = jnp.einsum("oy,yxc->oxc", rows, image.astype(jnp.float32), precision=jax.lax.Precision.HIGH)
        return jnp.einsum("px,oxc->opc", columns, resized, precision=jax.lax.Precision.HIGH)

    return jax.vmap(one)(images, source_hw, source_to_image, source_flipped)
