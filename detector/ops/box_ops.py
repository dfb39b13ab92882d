"""Box geometry and box coding.

Every box in this project is a float32 ``[..., 4]`` array in absolute pixels,
ordered ``(y0, x0, y1, x1)`` ("yxyx"). Only :func:`yxyx_to_xywh` and
:func:`xywh_to_yxyx` deal in COCO's ``(x, y, width, height)``.

All functions are pure ``jax.numpy``: they broadcast over leading dimensions,
have static output shapes and work under ``jit``, ``vmap`` and ``grad``. The
geometry the input pipeline shares (area, overlap, clipping, conversions)
is input_pipeline.box_geometry, called here with ``xp=jnp``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp

from input_pipeline import box_geometry

# detectron2's bound on exp() of the size deltas: a box may grow at most
# 1000/16 times its anchor, which keeps exp() finite for wild early predictions.
DEFAULT_MAX_LOG_SCALE = math.log(1000.0 / 16)

# Guards divisions and logs against zero-sized boxes (padding, degenerate gts)
# without visibly changing any box of at least a thousandth of a pixel.
_EPS = 1e-6

BoxCoderWeights = Sequence[float]


def _split(boxes_yxyx):
    return (boxes_yxyx[..., 0], boxes_yxyx[..., 1], boxes_yxyx[..., 2], boxes_yxyx[..., 3])


def _safe_div(num, den):
    """num / den, 0 where den == 0, with finite gradients on both branches."""
    nonzero = den > 0
    return jnp.where(nonzero, num / jnp.where(nonzero, den, 1.0), 0.0)


def area(boxes_yxyx):
    """Box areas.

    Args:
        boxes_yxyx: float ``[..., 4]`` boxes in pixels.

    Returns:
        float ``[...]`` areas in square pixels; boxes with y1 < y0 or x1 < x0
        count as empty (area 0) rather than negative.
    """
    return box_geometry.area(boxes_yxyx, xp=jnp)


def _aligned_iou_and_union(boxes1_yxyx, boxes2_yxyx):
    inter = box_geometry.intersection_area(boxes1_yxyx, boxes2_yxyx, xp=jnp)
    union = area(boxes1_yxyx) + area(boxes2_yxyx) - inter
    return _safe_div(inter, union), union


def pairwise_iou(boxes1_yxyx, boxes2_yxyx):
    """IoU of every box in one set with every box in another.

    Args:
        boxes1_yxyx: float ``[..., N, 4]`` boxes in pixels.
        boxes2_yxyx: float ``[..., M, 4]`` boxes in pixels; leading dims broadcast
            with those of ``boxes1_yxyx``.

    Returns:
        float ``[..., N, M]`` IoU in [0, 1]; 0 where the union is empty (two
        degenerate boxes).
    """
    iou, _ = _aligned_iou_and_union(boxes1_yxyx[..., :, None, :], boxes2_yxyx[..., None, :, :])
    return iou


def elementwise_iou(boxes1_yxyx, boxes2_yxyx):
    """IoU of aligned boxes, ``[..., 4] x [..., 4] -> [...]`` (0 for empty union)."""
    iou, _ = _aligned_iou_and_union(boxes1_yxyx, boxes2_yxyx)
    return iou


def generalized_iou(boxes1_yxyx, boxes2_yxyx):
    """Generalized IoU (Rezatofighi et al. 2019) of aligned boxes.

    GIoU = IoU - (C - U) / C with C the area of the smallest enclosing box and
    U the union. It is 1 for identical boxes and tends to -1 as the boxes move
    apart, so ``1 - GIoU`` still has a gradient for disjoint boxes.

    Args:
        boxes1_yxyx: float ``[..., 4]`` boxes in pixels.
        boxes2_yxyx: float ``[..., 4]`` boxes in pixels (broadcastable).

    Returns:
        float ``[...]`` in [-1, 1].
    """
    iou, union = _aligned_iou_and_union(boxes1_yxyx, boxes2_yxyx)
    y0 = jnp.minimum(boxes1_yxyx[..., 0], boxes2_yxyx[..., 0])
    x0 = jnp.minimum(boxes1_yxyx[..., 1], boxes2_yxyx[..., 1])
    y1 = jnp.maximum(boxes1_yxyx[..., 2], boxes2_yxyx[..., 2])
    x1 = jnp.maximum(boxes1_yxyx[..., 3], boxes2_yxyx[..., 3])
    enclosing = jnp.maximum(y1 - y0, 0.0) * jnp.maximum(x1 - x0, 0.0)
    return iou - _safe_div(enclosing - union, enclosing)


def _centre_size(boxes_yxyx):
    y0, x0, y1, x1 = _split(boxes_yxyx)
    h = y1 - y0
    w = x1 - x0
    return y0 + 0.5 * h, x0 + 0.5 * w, h, w


def encode_boxes(boxes_yxyx, anchors_yxyx, weights: BoxCoderWeights = (1.0, 1.0, 1.0, 1.0)):
    """Encodes boxes as regression deltas relative to anchors.

    The Faster R-CNN / RetinaNet coding on box centres and sizes:
    ``(ty, tx, th, tw) = (wy*dy/ha, wx*dx/wa, wh*log(h/ha), ww*log(w/wa))``.

    Args:
        boxes_yxyx: float ``[..., 4]`` target boxes in pixels.
        anchors_yxyx: float ``[..., 4]`` anchors in pixels (broadcastable).
        weights: ``(wy, wx, wh, ww)`` multipliers (detectron2's
            ``BBOX_REG_WEIGHTS``).

    Returns:
        float ``[..., 4]`` deltas ``(ty, tx, th, tw)``, dimensionless. Sizes below
        a tiny epsilon are clamped to it so degenerate boxes give finite deltas.
    """
    wy, wx, wh, ww = weights
    cy, cx, h, w = _centre_size(boxes_yxyx)
    acy, acx, ah, aw = _centre_size(anchors_yxyx)
    ah = jnp.maximum(ah, _EPS)
    aw = jnp.maximum(aw, _EPS)
    ty = wy * (cy - acy) / ah
    tx = wx * (cx - acx) / aw
    th = wh * jnp.log(jnp.maximum(h, _EPS) / ah)
    tw = ww * jnp.log(jnp.maximum(w, _EPS) / aw)
    return jnp.stack([ty, tx, th, tw], axis=-1)


def decode_boxes(
    deltas, anchors_yxyx, weights: BoxCoderWeights = (1.0, 1.0, 1.0, 1.0), max_log_scale: float = DEFAULT_MAX_LOG_SCALE
):
    """Inverse of :func:`encode_boxes`.

    Args:
        deltas: float ``[..., 4]`` deltas ``(ty, tx, th, tw)``.
        anchors_yxyx: float ``[..., 4]`` anchors in pixels (broadcastable).
        weights: the ``(wy, wx, wh, ww)`` used for encoding.
        max_log_scale: upper bound on ``th/wh`` and ``tw/ww`` before ``exp`` so
            a box grows at most ``exp(max_log_scale)`` times its anchor.

    Returns:
        float ``[..., 4]`` boxes in pixels (not clipped to any image).
    """
    wy, wx, wh, ww = weights
    acy, acx, ah, aw = _centre_size(anchors_yxyx)
    dy = deltas[..., 0] / wy
    dx = deltas[..., 1] / wx
    dh = jnp.minimum(deltas[..., 2] / wh, max_log_scale)
    dw = jnp.minimum(deltas[..., 3] / ww, max_log_scale)
    cy = dy * ah + acy
    cx = dx * aw + acx
    h = jnp.exp(dh) * ah
    w = jnp.exp(dw) * aw
    return jnp.stack([cy - 0.5 * h, cx - 0.5 * w, cy + 0.5 * h, cx + 0.5 * w], axis=-1)


def clip_boxes(boxes_yxyx, height, width):
    """Clips boxes to the image ``[0, height] x [0, width]``.

    Args:
        boxes_yxyx: float ``[..., 4]`` boxes in pixels.
        height: image height in pixels; a Python number or an array broadcastable
            to ``boxes_yxyx.shape[:-1]`` (e.g. one height per image).
        width: image width in pixels, same rules as ``height``.

    Returns:
        float ``[..., 4]`` clipped boxes.
    """
    dtype = boxes_yxyx.dtype
    height, width = jnp.broadcast_arrays(jnp.asarray(height, dtype), jnp.asarray(width, dtype))
    return box_geometry.clip(boxes_yxyx, height, width, xp=jnp)


def yxyx_to_xywh(boxes_yxyx):
    """``(y0, x0, y1, x1)`` -> COCO ``(x, y, width, height)``, ``[..., 4]``."""
    return box_geometry.yxyx_to_xywh(boxes_yxyx, xp=jnp)


def xywh_to_yxyx(boxes_xywh):
    """COCO ``(x, y, width, height)`` -> ``(y0, x0, y1, x1)``, ``[..., 4]``."""
    return box_geometry.xywh_to_yxyx(boxes_xywh, xp=jnp)


def cxcywh_to_yxyx(boxes_cxcywh):
    """DETR's ``(cx, cy, w, h)`` -> ``(y0, x0, y1, x1)`` in the same units, float ``[..., 4]``."""
    cx, cy, w, h = (boxes_cxcywh[..., i] for i in range(4))
    return jnp.stack([cy - h / 2, cx - w / 2, cy + h / 2, cx + w / 2], axis=-1)


def mask_boxes_cxcywh(masks):
    """The tight box of each mask, as DETR's normalised ``(cx, cy, w, h)`` over the mask's grid.

    Args:
      masks: bool ``[..., H, W]``; a cell spans [i / H, (i + 1) / H) of the height.
    Returns:
      (float32 ``[..., 4]`` boxes, bool ``[...]`` whether the mask has a cell; an empty one's box is zeros).
    """
    height, width = masks.shape[-2:]
    rows, columns = jnp.any(masks, axis=-1), jnp.any(masks, axis=-2)
    nonempty = jnp.any(rows, axis=-1)
    # First set cell from each end; an empty mask gives 0 and the size, zeroed below.
    y0, y1 = jnp.argmax(rows, axis=-1), height - jnp.argmax(rows[..., ::-1], axis=-1)
    x0, x1 = jnp.argmax(columns, axis=-1), width - jnp.argmax(columns[..., ::-1], axis=-1)
    y0, y1 = y0.astype(jnp.float32) / height, y1.astype(jnp.float32) / height
    x0, x1 = x0.astype(jnp.float32) / width, x1.astype(jnp.float32) / width
    boxes = jnp.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], axis=-1)
    return jnp.where(nonempty[..., None], boxes, 0.0), nonempty
