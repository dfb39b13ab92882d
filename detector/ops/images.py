"""Images as the network sees them: uint8 pixels from the input pipeline, normalised on the device.

The pipeline ships uint8 (a quarter of float32's host-to-device bytes and
none of the host's per-pixel arithmetic); the jitted steps call
`normalize_images` first, so training, prediction and the exported program
all see the same floats.
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
