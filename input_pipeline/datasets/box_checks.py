"""Checks every source applies to images and boxes while converting.

Host-side, run once per image at conversion; the count keys they return are
stored with the prepared split and reported by the trainer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def conversion_key(mode: str, image_format: str | None) -> str | None:
    """The converted_* count key of an image the decoder turns into 8-bit RGB.

    One key per image, the first that applies in the order 16bit, alpha,
    cmyk, palette, grayscale: the earlier ones lose more information (a 16-bit
    or an 'LA' image is also grayscale, but its bit depth or alpha is what the
    conversion throws away).

    Args:
      mode: PIL mode of the image header.
      image_format: PIL format ('PNG', 'JPEG', ...), or None.

    Returns:
      'converted_16bit', 'converted_alpha', 'converted_cmyk',
      'converted_palette', 'converted_grayscale', or None for 8-bit RGB.
    """
    # PIL reports a 16-bit grayscale PNG as 'I;16' (Pillow >= 10.4 or so) or
    # 'I' (older); PNG has no 32-bit samples, so an 'I' PNG is 16-bit.
    if mode.startswith("I;16") or (mode == "I" and image_format == "PNG"):
        return "converted_16bit"
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        return "converted_alpha"
    if mode == "CMYK":
        return "converted_cmyk"
    if mode == "P":
        return "converted_palette"
    if mode in ("1", "L", "I", "F"):
        return "converted_grayscale"
    return None


def is_number(value, *, finite: bool) -> bool:
    """A real int or float (not bool, not text), never NaN; with finite=True also not infinite.

    An int beyond float range counts as infinite.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        return False
    try:
        return math.isfinite(value) if finite else not math.isnan(value)
    except OverflowError:
        return not finite


def clip_box_yxyx(corners: Sequence[float], height: int, width: int) -> tuple[str | None, np.ndarray | None]:
    """Checks one box of a height x width image and clips it to the image.

    Args:
      corners: y0, x0, y1, x1 in pixels.
      height, width: image size, pixels.

    Returns:
      (key, box): box is float32 [4] y0, x0, y1, x1 clipped to the image, or
      None when dropped; key counts what happened: 'invalid_box' (a coordinate
      that is NaN or no number: dropped), 'empty_box' (height or width <= 0:
      dropped), 'outside_box' (nothing left inside the image: dropped),
      'clipped_box' (partly outside: clipped, kept), None (kept unchanged).
    """
    if len(corners) != 4 or not all(is_number(v, finite=False) for v in corners):
        return "invalid_box", None
    # Infinite corners are allowed: they clip (a finite x + w can overflow).
    y0, x0, y1, x1 = (float(v) for v in corners)
    if y1 <= y0 or x1 <= x0:
        return "empty_box", None
    clipped = (max(y0, 0.0), max(x0, 0.0), min(y1, float(height)), min(x1, float(width)))
    was_clipped = clipped != (y0, x0, y1, x1)
    if not (clipped[2] > clipped[0] and clipped[3] > clipped[1]):
        return "outside_box", None  # Only clipping can empty a box with positive size.
    box = np.array(clipped, np.float32)
    # Checked again after the float32 cast: a sliver thinner than float32
    # resolution would otherwise reach training as a zero-area box.
    if not (box[2] > box[0] and box[3] > box[1]):
        return ("outside_box" if was_clipped else "empty_box"), None
    return ("clipped_box" if was_clipped else None), box
