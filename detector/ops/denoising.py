"""Contrastive denoising queries (DINO, Zhang et al. 2022) with static shapes, and their groups' attention mask.

During training DINO feeds the decoder, besides its N matching queries,
noised copies of the ground truth: in each of G groups, a *positive* copy of
every ground-truth box (corners moved by less than `box_noise_scale` half
sizes: reconstruct the box) and a *negative* one (moved by 1 to 2 half
sizes: predict "no object"). Labels are flipped to a random class with
probability `label_noise_ratio / 2`. The groups must not see each other
(`group_attention_mask`) and the matching queries must not see any of them,
or the matching part would learn from the answers (the decoder's whole mask:
`detector.models.query_layout`).

The number of groups follows DINO's `dn_number`: a budget of P
positive-negative pairs per image, filled with as many whole groups as fit,
G = P // n for an image of n boxes (at least one): an image with 5 boxes
gets 20 groups of a budget of 100, one with 100 boxes one. DINO takes n over
the batch; here each image takes its own, so an image's queries do not depend
on which images share its batch, micro-batch or device.

Static shapes: every image gets D = 2 max(P, M) denoising query slots for M
padded ground-truth slots (`input.max_boxes`), in the order group, then the
positive (n) and negative (n) copies of the image's real boxes; the slots
left over are invalid (masked out of attention as keys and out of the
losses), so images with few or no boxes cost the same program as full ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def num_denoising_queries(denoising_pairs: int, max_boxes: int) -> int:
    """D = 2 max(P, M) query slots per image: P pairs, room for one group of all M slots (0 when P is 0)."""
    return 2 * max(denoising_pairs, max_boxes) if denoising_pairs else 0


def contrastive_denoising_queries(
    rng: jax.Array,
    gt_boxes_cxcywh: jax.Array,
    gt_labels: jax.Array,
    gt_mask: jax.Array,
    *,
    denoising_pairs: int,
    num_classes: int,
    label_noise_ratio: float = 0.5,
    box_noise_scale: float = 1.0,
) -> dict[str, jax.Array]:
    """Noised positive and negative copies of the ground truth, as many groups per image as the budget holds.

    Args:
      rng: a PRNG key.
      gt_boxes_cxcywh: float `[B, M, 4]` (cx, cy, w, h) normalised to [0, 1] by the image size.
      gt_labels: int32 `[B, M]` contiguous class labels (any value at padding).
      gt_mask: bool `[B, M]`, False for padding slots (anywhere among the M).
      denoising_pairs: P, DINO's `dn_number`: each image's n boxes get P // n groups (at least one).
      num_classes: C; flipped labels are drawn uniformly from [0, C).
      label_noise_ratio: a label is replaced by a random one with probability half of this (DINO's rule).
      box_noise_scale: corner displacement in units of the box's half width/height: positives move by
        [0, scale), negatives by [scale, 2 scale).

    Returns a dict with D = `num_denoising_queries(P, M)` entries per image:
      labels: int32 `[B, D]` noised labels (the decoder's content input).
      boxes_cxcywh: float32 `[B, D, 4]` noised boxes clipped to [0, 1] (its positional input).
      valid: bool `[B, D]` the slot holds a copy of a real ground-truth box.
      positive: bool `[B, D]` reconstruct the box (True) or predict no object (False).
      gt_index: int32 `[B, D]` the ground-truth slot each query is a copy of.
      group: int32 `[B, D]` the slot's group, -1 where invalid.
      num_groups: int32 `[B]` G of each image (0 without boxes).
    """
    batch, max_boxes = gt_labels.shape
    slots = num_denoising_queries(denoising_pairs, max_boxes)
    label_key, flip_key, sign_key, magnitude_key = jax.random.split(rng, 4)
    gt_mask = jnp.asarray(gt_mask, bool)
    count = jnp.sum(gt_mask, axis=1, dtype=jnp.int32)  # [B] n
    num_groups = jnp.where(count > 0, (slots // 2) // jnp.maximum(count, 1), 0)
    # The real boxes' slots first, in slot order (a stable sort of padding last).
    real_slots = jnp.argsort(~gt_mask, axis=1, stable=True).astype(jnp.int32)  # [B, M]
    n = jnp.maximum(count, 1)[:, None]
    slot = jnp.arange(slots, dtype=jnp.int32)[None, :]  # [1, D]
    group = slot // (2 * n)
    within = slot % (2 * n)
    positive = within < n
    valid = group < num_groups[:, None]
    gt_index = jnp.take_along_axis(real_slots, within % n, axis=1)
    shape = (batch, slots)

    labels = jnp.take_along_axis(jnp.asarray(gt_labels, jnp.int32), gt_index, axis=1)
    flip = jax.random.uniform(flip_key, shape) < label_noise_ratio * 0.5
    labels = jnp.where(flip, jax.random.randint(label_key, shape, 0, num_classes, dtype=jnp.int32), labels)

    boxes = jnp.take_along_axis(jnp.asarray(gt_boxes_cxcywh, jnp.float32), gt_index[..., None], axis=1)  # [B, D, 4]
    half_size = jnp.concatenate([boxes[..., 2:] / 2, boxes[..., 2:] / 2], axis=-1)  # per corner coordinate
    corners = jnp.concatenate([boxes[..., :2] - boxes[..., 2:] / 2, boxes[..., :2] + boxes[..., 2:] / 2], axis=-1)
    sign = jnp.where(jax.random.bernoulli(sign_key, 0.5, (*shape, 4)), 1.0, -1.0)
    magnitude = jax.random.uniform(magnitude_key, (*shape, 4)) + jnp.where(positive[..., None], 0.0, 1.0)
    corners = jnp.clip(corners + sign * magnitude * half_size * box_noise_scale, 0.0, 1.0)
    noised = jnp.concatenate([(corners[..., :2] + corners[..., 2:]) / 2, corners[..., 2:] - corners[..., :2]], -1)

    return {
        "labels": labels,
        "boxes_cxcywh": noised,
        "valid": valid,
        "positive": positive,
        "gt_index": gt_index,
        "group": jnp.where(valid, group, -1),
        "num_groups": num_groups,
    }


def group_attention_mask(group: jax.Array) -> jax.Array:
    """Which denoising queries may attend to which: bool `[B, D, D]`, True = may attend.

    Rows are the attending queries, columns the attended ones. A valid query
    sees its own group; an invalid slot (`group` -1) is seen by no other and
    sees only itself, so no softmax row is empty. Where the denoising
    queries sit among the decoder's others, and what they see of those:
    `detector.models.query_layout`.

    Args:
      group: int32 `[B, D]` from `contrastive_denoising_queries`.
    """
    # Invalid slots get a row id that matches no column (not even their own -1).
    row_group = jnp.where(group >= 0, group, -3)
    same_group = row_group[:, :, None] == group[:, None, :]
    return same_group | jnp.eye(group.shape[1], dtype=bool)[None]
