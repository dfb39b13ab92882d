"""Multi-level anchors and anchor-to-ground-truth assignment.

Anchor order (the dense head's output layout relies on it): levels ascending,
then grid row (y), then grid column (x), then the
``num_scales * len(aspect_ratios)`` anchors of one location, scale-major and
aspect-ratio-minor. A head that emits ``[B, H_l, W_l, num_anchors * K]`` per
level and reshapes to ``[B, H_l * W_l * num_anchors, K]`` before concatenating
the levels in ascending order matches it.

Aspect ratio convention (detectron2's): ``ratio = height / width``, and every
ratio keeps the anchor's area at ``size**2``, so ``h = size * sqrt(ratio)`` and
``w = size / sqrt(ratio)``. With the usual symmetric ratio lists such as
``(0.5, 1.0, 2.0)`` the set of anchors is the same under the other
convention; only the order inside one location differs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from detector.ops import box_ops


def num_anchors_per_location(num_scales: int, aspect_ratios: Sequence[float]) -> int:
    """Number of anchors centred on one grid position of one level."""
    return int(num_scales) * len(aspect_ratios)


def generate_anchors(
    image_height: int,
    image_width: int,
    min_level: int,
    max_level: int,
    num_scales: int,
    aspect_ratios: Sequence[float],
    anchor_size: float,
) -> np.ndarray:
    """All anchors of a feature pyramid, as a config-time numpy constant.

    Level ``l`` has stride ``2**l`` and a ``ceil(H / 2**l) x ceil(W / 2**l)``
    grid; the anchor centres sit at ``((i + 0.5) * stride, (j + 0.5) * stride)``.
    The anchors of one location have sizes ``anchor_size * stride *
    2**(k / num_scales)`` for ``k in range(num_scales)`` and, for each size, one
    box per aspect ratio (see the module docstring for the convention).

    Args:
        image_height: input image height in pixels.
        image_width: input image width in pixels.
        min_level: finest pyramid level (stride ``2**min_level``).
        max_level: coarsest pyramid level, inclusive.
        num_scales: number of sizes per octave.
        aspect_ratios: height / width ratios.
        anchor_size: base anchor size in units of the level's stride.

    Returns:
        float32 ``[A, 4]`` anchors ``(y0, x0, y1, x1)`` in pixels, ordered as in
        the module docstring; ``A = sum_l ceil(H/2**l) * ceil(W/2**l) *
        num_scales * len(aspect_ratios)``. Anchors are not clipped to the image.
    """
    if max_level < min_level:
        raise ValueError(f"max_level {max_level} < min_level {min_level}")
    if num_scales < 1 or not aspect_ratios:
        raise ValueError("need num_scales >= 1 and at least one aspect ratio")
    scales = 2.0 ** (np.arange(num_scales, dtype=np.float64) / num_scales)
    ratios = np.asarray(aspect_ratios, dtype=np.float64)
    # [S, R]: scale-major, ratio-minor once flattened.
    rel_h = scales[:, None] * np.sqrt(ratios)[None, :]
    rel_w = scales[:, None] / np.sqrt(ratios)[None, :]
    rel_h = rel_h.reshape(-1)
    rel_w = rel_w.reshape(-1)

    per_level = []
    for level in range(min_level, max_level + 1):
        stride = 2.0**level
        grid_h = math.ceil(image_height / stride)
        grid_w = math.ceil(image_width / stride)
        cy = (np.arange(grid_h, dtype=np.float64) + 0.5) * stride
        cx = (np.arange(grid_w, dtype=np.float64) + 0.5) * stride
        half_h = 0.5 * anchor_size * stride * rel_h  # [S*R]
        half_w = 0.5 * anchor_size * stride * rel_w
        # Broadcast to [grid_h, grid_w, S*R] so the flattening order is y, x, anchor.
        cy = cy[:, None, None]
        cx = cx[None, :, None]
        boxes = np.stack(np.broadcast_arrays(cy - half_h, cx - half_w, cy + half_h, cx + half_w), axis=-1)
        per_level.append(boxes.reshape(-1, 4))
    return np.concatenate(per_level, axis=0).astype(np.float32)


def assign_targets(
    anchors_yxyx,
    gt_boxes_yxyx,
    gt_labels,
    gt_mask,
    positive_iou: float = 0.5,
    negative_iou: float = 0.4,
    allow_low_quality_matches: bool = True,
    box_coder_weights: Sequence[float] = (1.0, 1.0, 1.0, 1.0),
):
    """Matches the anchors of ONE image to its ground-truth boxes (vmap for a batch).

    Each anchor is matched to the valid gt of highest IoU (the first one on
    ties). It is positive when that IoU is ``>= positive_iou``, ignored when it
    lies in ``[negative_iou, positive_iou)``, background otherwise. With
    ``allow_low_quality_matches`` (detectron2's ``Matcher`` semantics) every
    valid gt also turns positive the anchor(s) with its highest IoU, ties
    included, when that IoU is > 0; such an anchor keeps its own best gt as the
    match, which is this gt unless another gt overlaps the anchor more.

    Args:
        anchors_yxyx: float ``[A, 4]`` anchors in pixels.
        gt_boxes_yxyx: float ``[M, 4]`` ground-truth boxes in pixels, padded.
        gt_labels: int32 ``[M]`` class ids.
        gt_mask: bool ``[M]``; False marks padding, which never matches.
        positive_iou: IoU at or above which an anchor is positive.
        negative_iou: IoU below which an anchor is background.
        allow_low_quality_matches: see above.
        box_coder_weights: ``(wy, wx, wh, ww)`` for :func:`box_ops.encode_boxes`.

    Returns:
        dict with
            ``labels``: int32 ``[A]``, matched class id for positives, -1 otherwise.
            ``box_targets``: float32 ``[A, 4]`` encoded deltas of the matched gt,
                zeros where not positive.
            ``positive``: bool ``[A]``.
            ``ignore``: bool ``[A]``, not positive and best IoU in
                ``[negative_iou, positive_iou)``; to be left out of the classification
                loss.
            ``matched_gt_boxes``: float32 ``[A, 4]`` matched gt boxes in pixels,
                zeros where not positive.
            ``max_iou``: float32 ``[A]`` best IoU with any valid gt (-1 when there is
                none).
    """
    anchors_yxyx = jnp.asarray(anchors_yxyx, jnp.float32)
    gt_boxes_yxyx = jnp.asarray(gt_boxes_yxyx, jnp.float32)
    gt_labels = jnp.asarray(gt_labels, jnp.int32)
    gt_mask = jnp.asarray(gt_mask, bool)
    num_anchors = anchors_yxyx.shape[0]

    if gt_boxes_yxyx.shape[0] == 0:
        # No gt slots at all (a static shape): everything is background.
        zeros4 = jnp.zeros((num_anchors, 4), jnp.float32)
        return {
            "labels": jnp.full((num_anchors,), -1, jnp.int32),
            "box_targets": zeros4,
            "positive": jnp.zeros((num_anchors,), bool),
            "ignore": jnp.zeros((num_anchors,), bool),
            "matched_gt_boxes": zeros4,
            "max_iou": jnp.full((num_anchors,), -1.0, jnp.float32),
        }

    # -1 is below any real IoU, so padded gts lose every argmax and never pass
    # a threshold.
    iou = box_ops.pairwise_iou(anchors_yxyx, gt_boxes_yxyx)  # [A, M]
    iou = jnp.where(gt_mask[None, :], iou, -1.0)
    matched = jnp.argmax(iou, axis=1)  # [A]
    max_iou = jnp.max(iou, axis=1)  # [A]

    positive = max_iou >= positive_iou
    if allow_low_quality_matches:
        best_per_gt = jnp.max(iou, axis=0)  # [M]
        is_best = (iou == best_per_gt[None, :]) & (best_per_gt[None, :] > 0.0)
        is_best = is_best & gt_mask[None, :]
        positive = positive | jnp.any(is_best, axis=1)
    ignore = (~positive) & (max_iou >= negative_iou)

    matched_boxes = gt_boxes_yxyx[matched]  # [A, 4]
    matched_boxes = jnp.where(positive[:, None], matched_boxes, 0.0)
    # Non-positives encode against their own anchor, which yields exact zeros.
    encode_from = jnp.where(positive[:, None], matched_boxes, anchors_yxyx)
    box_targets = box_ops.encode_boxes(encode_from, anchors_yxyx, box_coder_weights)
    box_targets = jnp.where(positive[:, None], box_targets, 0.0)
    labels = jnp.where(positive, gt_labels[matched], -1)
    return {
        "labels": labels.astype(jnp.int32),
        "box_targets": box_targets.astype(jnp.float32),
        "positive": positive,
        "ignore": ignore,
        "matched_gt_boxes": matched_boxes.astype(jnp.float32),
        "max_iou": max_iou.astype(jnp.float32),
    }
