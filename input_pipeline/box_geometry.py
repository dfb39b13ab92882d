"""Box geometry written once for numpy, jax.numpy and TensorFlow.

Boxes are float ``[..., 4]`` arrays ``(y0, x0, y1, x1)`` ("yxyx") in pixels,
y1/x1 exclusive edges; COCO's ``(x, y, width, height)`` ("xywh") only in the
conversions. Every function takes the array module as ``xp``: ``numpy``
(default), ``jax.numpy`` (detector.ops.box_ops) or ``tensorflow``
(input_pipeline.transforms, inside tf.data graphs). They use only indexing
of the last axis, arithmetic, and ``xp.maximum`` / ``xp.minimum`` /
``xp.stack(..., axis=-1)``, which the three spell alike, so results match
bit for bit across them; shapes broadcast over leading dimensions.

Here rather than in detector.ops because the input pipeline must not import
detector; box_ops builds its IoU and box coding on these.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def area(boxes_yxyx, xp: Any = np):
    """Box areas: float ``[..., 4]`` pixels -> ``[...]`` square pixels; inverted boxes count as empty (0)."""
    height = xp.maximum(boxes_yxyx[..., 2] - boxes_yxyx[..., 0], 0.0)
    width = xp.maximum(boxes_yxyx[..., 3] - boxes_yxyx[..., 1], 0.0)
    return height * width


def intersection_area(boxes1_yxyx, boxes2_yxyx, xp: Any = np):
    """Overlap of aligned boxes: float ``[..., 4]`` x ``[..., 4]`` (broadcast) -> ``[...]`` square pixels, >= 0."""
    y0 = xp.maximum(boxes1_yxyx[..., 0], boxes2_yxyx[..., 0])
    x0 = xp.maximum(boxes1_yxyx[..., 1], boxes2_yxyx[..., 1])
    y1 = xp.minimum(boxes1_yxyx[..., 2], boxes2_yxyx[..., 2])
    x1 = xp.minimum(boxes1_yxyx[..., 3], boxes2_yxyx[..., 3])
    return xp.maximum(y1 - y0, 0.0) * xp.maximum(x1 - x0, 0.0)


def clip(boxes_yxyx, height, width, xp: Any = np):
    """Clips boxes to the image ``[0, height] x [0, width]``.

    Args:
      boxes_yxyx: float ``[..., 4]`` boxes in pixels.
      height: image height in pixels, in the boxes' dtype: a scalar, or an
        array of the same shape as ``width`` that broadcasts against
        ``boxes_yxyx.shape[:-1]`` (one height per image).
      width: image width in pixels, likewise.
      xp: numpy, jax.numpy or tensorflow.

    Returns:
      float ``[..., 4]`` boxes inside the image (a box wholly outside it
      becomes an empty one on its edge).
    """
    upper = xp.stack([height, width, height, width], axis=-1)
    return xp.minimum(xp.maximum(boxes_yxyx, 0.0), upper)


def yxyx_to_xywh(boxes_yxyx, xp: Any = np):
    """``(y0, x0, y1, x1)`` -> COCO ``(x, y, width, height)``, float ``[..., 4]`` pixels."""
    y0, x0, y1, x1 = (boxes_yxyx[..., i] for i in range(4))
    return xp.stack([x0, y0, x1 - x0, y1 - y0], axis=-1)


def xywh_to_yxyx(boxes_xywh, xp: Any = np):
    """COCO ``(x, y, width, height)`` -> ``(y0, x0, y1, x1)``, float ``[..., 4]`` pixels."""
    x, y, w, h = (boxes_xywh[..., i] for i in range(4))
    return xp.stack([y, x, y + h, x + w], axis=-1)
