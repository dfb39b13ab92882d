"""Post-processing with static shapes: top-k, box decoding and greedy NMS."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from detector.ops import box_ops


def non_max_suppression(boxes_yxyx, scores, iou_threshold: float, max_output_size: int, classes=None):
    """Greedy non-maximum suppression for one set of boxes, static shapes.

    Same selection rule as ``tf.image.non_max_suppression``: visit boxes in
    descending score order, keep a box unless its IoU with an already kept box
    exceeds ``iou_threshold``. Boxes with score ``-inf`` are never kept, which
    is how callers drop candidates without changing shapes.

    Cost: a ``max_output_size``-step sequential loop of O(K) work: each step
    keeps the best box not yet suppressed and suppresses what it overlaps (its
    IoU row with every candidate), which is greedy NMS's selection read in the
    order it is made (100 steps for 1000 candidates where visiting every
    candidate takes 1000).

    Args:
        boxes_yxyx: float ``[K, 4]`` boxes in pixels.
        scores: float ``[K]``.
        iou_threshold: a kept box suppresses boxes with IoU strictly above this.
        max_output_size: static number of output slots.
        classes: optional int ``[K]``; when given, boxes only suppress boxes of
            the same class (class-aware NMS in one call).

    Returns:
        ``(indices, valid)``: int32 ``[max_output_size]`` indices into the K
        inputs in descending score order, and bool ``[max_output_size]``; unused
        slots hold index 0 and valid False (all of them for K = 0).
    """
    boxes_yxyx = jnp.asarray(boxes_yxyx, jnp.float32)
    scores = jnp.asarray(scores, jnp.float32)
    num_boxes = boxes_yxyx.shape[0]
    if num_boxes == 0:
        # Nothing to keep (torchvision returns an empty index list); the loop
        # below would index its empty matrices even for zero iterations.
        return jnp.zeros((max_output_size,), jnp.int32), jnp.zeros((max_output_size,), bool)
    order = jnp.argsort(-scores, stable=True)
    sorted_boxes = boxes_yxyx[order]
    candidate = scores[order] > -jnp.inf
    sorted_classes = None if classes is None else jnp.asarray(classes)[order]

    def overlapped_by(best):
        # The kept box's IoU row only: max_output_size rows of K, not the K x K matrix (a tenth of it for
        # 100 of 1000), which a runtime that does not fuse elementwise ops (ONNX Runtime) writes out op by op.
        overlaps = box_ops.pairwise_iou(sorted_boxes[best][None], sorted_boxes)[0] > iou_threshold
        return overlaps if sorted_classes is None else overlaps & (sorted_classes == sorted_classes[best])

    slots = jnp.arange(max_output_size)
    # A rank that falls with the sorted position: the best remaining box is its argmax.
    rank = num_boxes - jnp.arange(num_boxes)

    def body(slot, state):
        remaining, kept_pos, valid = state
        best = jnp.argmax(jnp.where(remaining, rank, 0))
        found = remaining[best]
        kept_pos = jnp.where(slots == slot, jnp.where(found, best, 0), kept_pos)
        valid = valid | ((slots == slot) & found)
        remaining = remaining & ~overlapped_by(best) & (jnp.arange(num_boxes) != best)
        return remaining, kept_pos, valid

    init = (candidate, jnp.zeros((max_output_size,), jnp.int32), jnp.zeros((max_output_size,), bool))
    _, kept_pos, valid = jax.lax.fori_loop(0, max_output_size, body, init)
    indices = jnp.where(valid, order[kept_pos], 0).astype(jnp.int32)
    return indices, valid


def _detect_one(
    cls_logits,
    box_deltas,
    anchors_yxyx,
    image_height,
    image_width,
    *,
    pre_nms_top_k,
    score_threshold,
    iou_threshold,
    max_detections,
    box_coder_weights,
):
    num_anchors, num_classes = cls_logits.shape
    scores = jax.nn.sigmoid(cls_logits.astype(jnp.float32)).reshape(-1)
    top_k = min(pre_nms_top_k, num_anchors * num_classes)
    top_scores, flat_idx = jax.lax.top_k(scores, top_k)
    anchor_idx = flat_idx // num_classes
    classes = (flat_idx % num_classes).astype(jnp.int32)
    top_scores = jnp.where(top_scores > score_threshold, top_scores, -jnp.inf)

    boxes = box_ops.decode_boxes(
        box_deltas[anchor_idx].astype(jnp.float32), anchors_yxyx[anchor_idx], box_coder_weights
    )
    boxes = box_ops.clip_boxes(boxes, image_height, image_width)
    return _class_aware_nms(boxes, top_scores, classes, iou_threshold, max_detections)


def _class_aware_nms(
    boxes_yxyx, scores, classes, iou_threshold: float, max_detections: int, queries=None
) -> dict[str, jax.Array]:
    """One image's candidates `[K, 4]`, `[K]` (-inf: dropped), `[K]` -> the detections dict of `detect`
    (with `queries` `[K]`, each kept candidate's too)."""
    # Masking the IoU matrix by class equality rather than offsetting boxes
    # per class keeps IoUs exact (large offsets cost float32 precision).
    keep, valid = non_max_suppression(boxes_yxyx, scores, iou_threshold, max_detections, classes=classes)
    kept = {
        "boxes": jnp.where(valid[:, None], boxes_yxyx[keep], 0.0),
        "scores": jnp.where(valid, scores[keep], 0.0),
        "classes": jnp.where(valid, classes[keep], 0),
        "valid": valid,
    }
    if queries is not None:
        kept["queries"] = jnp.where(valid, queries[keep], 0)
    return kept


def detect(
    cls_logits,
    box_deltas,
    anchors_yxyx,
    image_height,
    image_width,
    *,
    pre_nms_top_k: int = 1000,
    score_threshold: float = 0.05,
    iou_threshold: float = 0.5,
    max_detections: int = 100,
    box_coder_weights: Sequence[float] = (1.0, 1.0, 1.0, 1.0),
):
    """Turns dense head outputs into at most ``max_detections`` boxes per image.

    Per image: sigmoid scores over all (anchor, class) pairs, the top
    ``pre_nms_top_k`` of them (clamped to A*C), candidates not above
    ``score_threshold`` dropped, boxes decoded and clipped to the image, and
    class-aware greedy NMS (boxes of different classes never suppress each
    other). Static shapes throughout; jit-able.

    Args:
        cls_logits: ``[B, A, C]`` class logits.
        box_deltas: ``[B, A, 4]`` predicted deltas.
        anchors_yxyx: float ``[A, 4]`` anchors in pixels.
        image_height: image height in pixels, a Python number or an array ``[B]``
            (e.g. each image's size before padding).
        image_width: image width in pixels, same rules as ``image_height``.
        pre_nms_top_k: candidates per image entering NMS.
        score_threshold: a detection's sigmoid score must exceed this.
        iou_threshold: NMS IoU threshold (within one class).
        max_detections: D, output slots per image.
        box_coder_weights: ``(wy, wx, wh, ww)`` of the box coding.

    Returns:
        dict with ``boxes`` float32 ``[B, D, 4]`` yxyx pixels clipped to the
        image, ``scores`` float32 ``[B, D]`` (descending), ``classes`` int32
        ``[B, D]`` in ``[0, C)``, ``valid`` bool ``[B, D]``. Invalid slots hold
        zeros (class 0): always read them through ``valid``.
    """
    batch = cls_logits.shape[0]
    anchors_yxyx = jnp.asarray(anchors_yxyx, jnp.float32)
    height = jnp.broadcast_to(jnp.asarray(image_height, jnp.float32), (batch,))
    width = jnp.broadcast_to(jnp.asarray(image_width, jnp.float32), (batch,))

    def one(logits, deltas, h, w):
        return _detect_one(
            logits,
            deltas,
            anchors_yxyx,
            h,
            w,
            pre_nms_top_k=pre_nms_top_k,
            score_threshold=score_threshold,
            iou_threshold=iou_threshold,
            max_detections=max_detections,
            box_coder_weights=box_coder_weights,
        )

    return jax.vmap(one)(cls_logits, box_deltas, height, width)


def detect_from_queries(
    logits,
    boxes_cxcywh,
    image_height: int,
    image_width: int,
    *,
    max_detections: int,
    score_threshold: float = 0.0,
    nms_iou_threshold: float = 0.0,
    pre_nms_top_k: int = 1000,
    return_queries: bool = False,
) -> dict[str, jax.Array]:
    """Detections of a set predictor (DETR family): the top scores over queries x classes, NMS optional.

    Each query may give several detections (one per class), as DINO and
    Deformable DETR evaluate: the `max_detections` highest sigmoid scores
    of all `N * C` (query, class) pairs. With `nms_iou_threshold` > 0 (the
    reference DINO's `nms_iou_threshold` option, off there by default too),
    the `pre_nms_top_k` best pairs go through class-aware greedy NMS first,
    which removes the duplicates a briefly trained set predictor still makes.

    Args:
        logits: float ``[B, N, C]`` per-class sigmoid logits of N queries.
        boxes_cxcywh: float ``[B, N, 4]`` boxes, (cx, cy, w, h) normalised to the network input.
        image_height, image_width: the network input in pixels.
        max_detections: D, static; at most N * C.
        score_threshold: detections scoring at or below it are marked invalid.
        nms_iou_threshold: 0: no NMS; else a kept detection suppresses the
            lower-scoring ones of its class whose IoU with it exceeds this.
        pre_nms_top_k: with NMS, the (query, class) pairs it considers (at most N * C).
        return_queries: also return queries int32 ``[B, D]``, the query each
            detection comes from (what its mask or other per-query output is).

    Returns:
        dict: boxes float32 ``[B, D, 4]`` yxyx in network-input pixels clipped
        to the image, scores float32 ``[B, D]`` descending, classes int32
        ``[B, D]``, valid bool ``[B, D]`` (and queries).
    """
    logits = jnp.asarray(logits, jnp.float32)
    batch, num_queries, num_classes = logits.shape
    pairs = num_queries * num_classes
    candidates = min(pre_nms_top_k, pairs) if nms_iou_threshold > 0 else max_detections
    scores, flat_index = jax.lax.top_k(jax.nn.sigmoid(logits).reshape(batch, pairs), candidates)
    query = flat_index // num_classes
    classes = (flat_index % num_classes).astype(jnp.int32)
    boxes = jnp.take_along_axis(box_ops.cxcywh_to_yxyx(jnp.asarray(boxes_cxcywh, jnp.float32)), query[..., None], 1)
    size = jnp.asarray([image_height, image_width, image_height, image_width], jnp.float32)
    boxes = jnp.clip(boxes * size, 0.0, size)
    if nms_iou_threshold <= 0:
        detections = {"boxes": boxes, "scores": scores, "classes": classes, "valid": scores > score_threshold}
        if return_queries:
            detections["queries"] = query.astype(jnp.int32)
        return detections

    scores = jnp.where(scores > score_threshold, scores, -jnp.inf)
    queries = query.astype(jnp.int32) if return_queries else None
    return jax.vmap(lambda b, s, c, q: _class_aware_nms(b, s, c, nms_iou_threshold, max_detections, q))(
        boxes, scores, classes, queries
    )
