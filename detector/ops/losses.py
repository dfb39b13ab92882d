"""Detection losses: sigmoid focal loss, smooth L1, and the RetinaNet loss."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from detector.errors import ConfigError
from detector.ops import anchors as anchors_lib
from detector.ops import box_ops


def sigmoid_focal_loss(logits, targets, alpha: float = 0.25, gamma: float = 2.0):
    """Elementwise sigmoid focal loss (Lin et al. 2017), torchvision's definition.

    ``loss = alpha_t * (1 - p_t)**gamma * BCE(logits, targets)``, with
    ``p_t = p*t + (1-p)*(1-t)`` and ``alpha_t = alpha*t + (1-alpha)*(1-t)``.

    Args:
        logits: float ``[..., C]`` raw scores.
        targets: float ``[..., C]`` 0/1 targets (soft targets also work).
        alpha: weight of the positive class; a negative value disables the
            alpha weighting (``alpha_t = 1``), as in torchvision.
        gamma: focusing exponent; 0 gives plain (alpha-weighted) BCE.

    Returns:
        float ``[..., C]`` per-element loss in nats, not reduced.
    """
    logits = jnp.asarray(logits, jnp.float32)
    targets = jnp.asarray(targets, jnp.float32)
    # log-sigmoid and sigmoid(-x) instead of log(p) and 1 - p: exact for large
    # |logits|, where the naive forms give log(0) or lose all precision.
    log_p = jax.nn.log_sigmoid(logits)
    log_not_p = jax.nn.log_sigmoid(-logits)
    ce = -(targets * log_p + (1.0 - targets) * log_not_p)
    if gamma == 0:
        loss = ce
    else:
        one_minus_p_t = targets * jax.nn.sigmoid(-logits) + (1.0 - targets) * jax.nn.sigmoid(logits)
        loss = ce * jnp.power(one_minus_p_t, gamma)
    if alpha >= 0:
        alpha_t = alpha * targets + (1.0 - alpha) * (1.0 - targets)
        loss = alpha_t * loss
    return loss


def huber_loss(pred, target, delta: float):
    """Elementwise smooth L1 loss, detectron2's definition with ``beta = delta``.

    ``0.5 * x**2 / delta`` where ``|x| < delta``, else ``|x| - 0.5 * delta``,
    with ``x = pred - target``. This is ``1 / delta`` times the textbook Huber
    loss, so its gradient is bounded by 1 for every delta; ``delta = 0`` gives L1.

    Args:
        pred: float ``[...]``.
        target: float ``[...]`` (broadcastable).
        delta: non-negative Python float, the switch point (static).

    Returns:
        float ``[...]`` loss, in the units of ``pred``.
    """
    x = jnp.abs(jnp.asarray(pred, jnp.float32) - jnp.asarray(target, jnp.float32))
    if delta < 1e-5:
        # The quadratic branch would divide by ~0 for a region of width ~0.
        return x
    return jnp.where(x < delta, 0.5 * x * x / delta, x - 0.5 * delta)


def retinanet_loss(
    cls_logits,
    box_deltas,
    anchors_yxyx,
    gt_boxes_yxyx,
    gt_labels,
    gt_mask,
    *,
    num_classes: int,
    positive_iou: float = 0.5,
    negative_iou: float = 0.4,
    allow_low_quality_matches: bool = True,
    focal_alpha: float = 0.25,
    focal_gamma: float = 2.0,
    box_loss: str = "huber",
    huber_delta: float = 0.1,
    box_loss_weight: float = 1.0,
    box_coder_weights: Sequence[float] = (1.0, 1.0, 1.0, 1.0),
    example_mask=None,
    normalizer=None,
):
    """RetinaNet loss for a batch: focal classification + box regression.

    Both terms are sums over the batch divided by the number of positive
    anchors in the whole batch (at least 1), as in RetinaNet, so every positive
    anchor weighs the same whatever image it is in.

    Args:
        cls_logits: ``[B, A, C]`` class logits (any float dtype; computed in f32).
        box_deltas: ``[B, A, 4]`` predicted deltas ``(ty, tx, th, tw)``.
        anchors_yxyx: float ``[A, 4]`` anchors in pixels.
        gt_boxes_yxyx: float ``[B, M, 4]`` padded ground-truth boxes in pixels.
        gt_labels: int32 ``[B, M]`` class ids in ``[0, num_classes)``.
        gt_mask: bool ``[B, M]``, False for padding.
        num_classes: C.
        positive_iou, negative_iou, allow_low_quality_matches: matching rules of
            :func:`detector.ops.anchors.assign_targets`.
        focal_alpha, focal_gamma: see :func:`sigmoid_focal_loss`.
        box_loss: ``'huber'`` (smooth L1 on the encoded deltas, summed over the 4
            coordinates) or ``'giou'`` (``1 - GIoU`` of the decoded boxes).
        huber_delta: smooth L1 switch point, in delta units.
        box_loss_weight: multiplier of the box term.
        box_coder_weights: ``(wy, wx, wh, ww)`` of the box coding.
        example_mask: optional ``[B]`` bool/float; 0 removes a (padding) example
            from every term and from the positive count.
        normalizer: what both terms are divided by; default the positive
            count of this batch (at least 1). Gradient accumulation passes 1
            to get sums, and divides the sums of all micro-batches by the
            positive count of the whole global batch.

    Returns:
        ``(total_loss, terms)``: ``total_loss`` a f32 scalar equal to
        ``terms['cls_loss'] + terms['box_loss']``; ``terms['box_loss']`` already
        includes ``box_loss_weight``; ``terms['num_positives']`` is the f32 count
        of positive anchors in the (unmasked) batch.
    """
    if box_loss not in ("huber", "giou"):
        raise ConfigError(f"loss.box_loss={box_loss!r} is not known; use 'huber' or 'giou'")
    cls_logits = jnp.asarray(cls_logits, jnp.float32)
    box_deltas = jnp.asarray(box_deltas, jnp.float32)
    anchors_yxyx = jnp.asarray(anchors_yxyx, jnp.float32)
    gt_boxes_yxyx = jnp.asarray(gt_boxes_yxyx, jnp.float32)
    batch = cls_logits.shape[0]
    if cls_logits.shape[-1] != num_classes:
        raise ValueError(f"cls_logits has {cls_logits.shape[-1]} classes, expected num_classes={num_classes}")

    assign = jax.vmap(
        lambda boxes, labels, mask: anchors_lib.assign_targets(
            anchors_yxyx,
            boxes,
            labels,
            mask,
            positive_iou=positive_iou,
            negative_iou=negative_iou,
            allow_low_quality_matches=allow_low_quality_matches,
            box_coder_weights=box_coder_weights,
        )
    )
    targets = assign(gt_boxes_yxyx, gt_labels, gt_mask)
    # Gradients never flow into the matching.
    targets = jax.lax.stop_gradient(targets)

    if example_mask is None:
        example_weight = jnp.ones((batch,), jnp.float32)
    else:
        example_weight = jnp.asarray(example_mask).astype(jnp.float32)
    positive = targets["positive"].astype(jnp.float32) * example_weight[:, None]
    num_positives = jnp.sum(positive)
    if normalizer is None:
        normalizer = jnp.maximum(num_positives, 1.0)

    # one_hot(-1) is all zeros: background anchors get an all-negative target.
    cls_targets = jax.nn.one_hot(targets["labels"], num_classes, dtype=jnp.float32)
    cls_weight = (~targets["ignore"]).astype(jnp.float32) * example_weight[:, None]
    focal = sigmoid_focal_loss(cls_logits, cls_targets, focal_alpha, focal_gamma)
    cls_loss = jnp.sum(focal * cls_weight[..., None]) / normalizer

    if box_loss == "huber":
        per_anchor = jnp.sum(huber_loss(box_deltas, targets["box_targets"], huber_delta), axis=-1)
    else:
        pred_boxes = box_ops.decode_boxes(box_deltas, anchors_yxyx[None], box_coder_weights)
        per_anchor = 1.0 - box_ops.generalized_iou(pred_boxes, targets["matched_gt_boxes"])
    # where, not a product: a non-finite value at a non-positive anchor must not
    # leak into the sum (0 * inf = nan).
    box_sum = jnp.sum(jnp.where(positive > 0, per_anchor * positive, 0.0))
    weighted_box_loss = box_loss_weight * box_sum / normalizer

    total = cls_loss + weighted_box_loss
    return total, {
        "cls_loss": cls_loss,
        "box_loss": weighted_box_loss,
        "num_positives": num_positives,
    }
