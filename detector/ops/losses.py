"""Detection losses: focal, varifocal and matchability-aware class losses, smooth L1, RetinaNet and set losses."""

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


def _weighted_bce(logits, soft_targets, weight):
    """`weight * BCE(sigmoid(logits), soft_targets)` elementwise, from log-sigmoids (exact for large |logits|)."""
    ce = -(soft_targets * jax.nn.log_sigmoid(logits) + (1.0 - soft_targets) * jax.nn.log_sigmoid(-logits))
    return weight * ce


def varifocal_loss(logits, targets, quality, alpha: float = 0.75, gamma: float = 2.0):
    """Elementwise varifocal loss (Zhang et al. 2021, VarifocalNet; RT-DETR's and D-FINE's class loss).

    A positive (``targets`` 1) is pulled towards its quality q, the IoU of
    its box with the ground truth, and weighted by q; a negative towards 0,
    weighted ``alpha * p**gamma`` as in the focal loss. Score and quality
    are constants of the weights (no gradient through them), as in RT-DETR.

    Args:
        logits: float ``[..., C]`` raw scores.
        targets: ``[..., C]`` 0/1 (one-hot) positives.
        quality: float broadcastable to ``[..., C]`` (e.g. ``[..., 1]``), in [0, 1].
        alpha, gamma: the negatives' weight and focusing exponent.

    Returns:
        float ``[..., C]`` per-element loss, not reduced.
    """
    logits = jnp.asarray(logits, jnp.float32)
    targets = jnp.asarray(targets, jnp.float32)
    score = jax.lax.stop_gradient(jax.nn.sigmoid(logits))
    soft_targets = targets * jax.lax.stop_gradient(jnp.asarray(quality, jnp.float32))
    weight = alpha * score**gamma * (1.0 - targets) + soft_targets
    return _weighted_bce(logits, soft_targets, weight)


def matchability_aware_loss(logits, targets, quality, gamma: float = 1.5, alpha: float = 1.0):
    """Elementwise Matchability-Aware Loss (DEIM, Huang et al. 2025).

    Like `varifocal_loss`, but a positive's target is ``q**gamma`` and its
    weight 1, so a positive matched with a low IoU (as dense matching
    brings many) still counts in full, with a lowered target; negatives are
    weighted ``alpha * p**gamma`` (DEIM's default alpha: none, i.e. 1).

    Args and returns as `varifocal_loss`.
    """
    logits = jnp.asarray(logits, jnp.float32)
    targets = jnp.asarray(targets, jnp.float32)
    score = jax.lax.stop_gradient(jax.nn.sigmoid(logits))
    soft_targets = targets * jax.lax.stop_gradient(jnp.asarray(quality, jnp.float32)) ** gamma
    weight = alpha * score**gamma * (1.0 - targets) + targets
    return _weighted_bce(logits, soft_targets, weight)


# The class losses `set_prediction_loss` takes.
CLASS_LOSSES = ("focal", "varifocal", "mal")


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


def set_prediction_loss(
    pred_logits,
    pred_boxes_cxcywh,
    gt_labels,
    gt_boxes_cxcywh,
    query_to_gt,
    *,
    num_boxes,
    query_weight=None,
    focal_alpha: float = 0.25,
    focal_gamma: float = 2.0,
    class_weight: float = 1.0,
    l1_weight: float = 5.0,
    giou_weight: float = 2.0,
    class_loss: str = "focal",
    varifocal_alpha: float = 0.75,
    varifocal_gamma: float = 2.0,
    mal_gamma: float = 1.5,
):
    """DETR-family loss of one set of predictions given its assignment: class, L1 and GIoU box terms.

    What DINO computes for each decoder layer, the encoder proposals and the
    denoising groups: every query's sigmoid focal loss against the one-hot
    label of the ground truth it is assigned to (all zeros when unassigned:
    "no object"), plus L1 and 1 - GIoU between assigned pairs. Each term is a
    sum divided by `num_boxes`, the number of ground-truth boxes in the whole
    global batch, as Deformable DETR and DINO normalise.

    Args:
        pred_logits: float ``[B, N, C]`` class logits of N queries.
        pred_boxes_cxcywh: float ``[B, N, 4]`` boxes, (cx, cy, w, h) normalised to [0, 1].
        gt_labels: int32 ``[B, M]`` contiguous labels of the (padded) ground truth.
        gt_boxes_cxcywh: float ``[B, M, 4]`` normalised like the predictions.
        query_to_gt: int32 ``[B, N]`` the ground-truth slot each query is assigned to, -1 for none.
        num_boxes: scalar, the normaliser (at least 1 is used).
        query_weight: optional float or bool ``[B, N]``, each query's weight in every term; 0 (False)
            removes it (invalid denoising copies); DINO weighs an image's G denoising groups 1 / G each.
        focal_alpha, focal_gamma: see `sigmoid_focal_loss`.
        class_weight, l1_weight, giou_weight: DINO's 1, 5 and 2 by default.
        class_loss: "focal" (DINO's), or a quality-aware loss whose positive
            target is the IoU of the query's box with its ground truth (no
            gradient through it): "varifocal" (`varifocal_loss`, with
            ``varifocal_alpha``, ``varifocal_gamma``) or "mal"
            (`matchability_aware_loss`, with ``mal_gamma``).

    Returns:
        ``(total, terms)``: total = the weighted sum; terms ``cls_loss``, ``l1_loss``,
        ``giou_loss`` (weighted) as float32 scalars.
    """
    pred_logits = jnp.asarray(pred_logits, jnp.float32)
    pred_boxes = jnp.asarray(pred_boxes_cxcywh, jnp.float32)
    num_classes = pred_logits.shape[-1]
    keep = jnp.ones(query_to_gt.shape, jnp.float32) if query_weight is None else jnp.asarray(query_weight, jnp.float32)
    assigned = (query_to_gt >= 0) & (keep > 0)
    index = jnp.maximum(query_to_gt, 0)
    labels = jnp.take_along_axis(jnp.asarray(gt_labels, jnp.int32), index, axis=1)
    targets = jax.nn.one_hot(labels, num_classes, dtype=jnp.float32) * assigned[..., None]
    boxes = jnp.take_along_axis(jnp.asarray(gt_boxes_cxcywh, jnp.float32), index[..., None], axis=1)
    normalizer = jnp.maximum(jnp.asarray(num_boxes, jnp.float32), 1.0)

    pred_yxyx, gt_yxyx = box_ops.cxcywh_to_yxyx(pred_boxes), box_ops.cxcywh_to_yxyx(boxes)
    if class_loss == "focal":
        per_class = sigmoid_focal_loss(pred_logits, targets, focal_alpha, focal_gamma)
    else:
        # Unassigned queries' boxes may be anything; their targets are 0, so their quality is never read.
        quality = jnp.where(assigned, box_ops.elementwise_iou(pred_yxyx, gt_yxyx), 0.0)[..., None]
        if class_loss == "varifocal":
            per_class = varifocal_loss(pred_logits, targets, quality, varifocal_alpha, varifocal_gamma)
        elif class_loss == "mal":
            per_class = matchability_aware_loss(pred_logits, targets, quality, mal_gamma)
        else:
            raise ValueError(f"class_loss={class_loss!r}; use one of {', '.join(CLASS_LOSSES)}")
    cls_loss = jnp.sum(per_class * keep[..., None]) / normalizer
    l1 = jnp.sum(jnp.abs(pred_boxes - boxes), axis=-1)
    giou = 1.0 - box_ops.generalized_iou(pred_yxyx, gt_yxyx)
    # where, not a product: unassigned queries' boxes may be anything (0 * nan = nan).
    l1_loss = jnp.sum(jnp.where(assigned, l1 * keep, 0.0)) / normalizer
    giou_loss = jnp.sum(jnp.where(assigned, giou * keep, 0.0)) / normalizer
    terms = {
        "cls_loss": class_weight * cls_loss,
        "l1_loss": l1_weight * l1_loss,
        "giou_loss": giou_weight * giou_loss,
    }
    return terms["cls_loss"] + terms["l1_loss"] + terms["giou_loss"], terms
