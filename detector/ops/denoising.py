"""Contrastive denoising queries (DINO, Zhang et al. 2022) with static shapes, and their attention mask.

During training DINO feeds the decoder, besides its N matching queries,
noised copies of the ground truth: in each of G groups, a *positive* copy of
every ground-truth box (corners moved by less than `box_noise_scale` half
sizes: reconstruct the box) and a *negative* one (moved by 1 to 2 half
sizes: predict "no object"). Labels are flipped to a random class with
probability `label_noise_ratio / 2`. The groups must not see each other
and the matching queries must not see any of them, or the matching part
would learn from the answers: `denoising_attention_mask` builds that mask.

Static shapes: every image gets 2 * G * M denoising queries for M padded
ground-truth slots (`input.max_boxes`), in the order group, then positive
(M) and negative (M) halves; the copies of padding slots are invalid (masked
out of attention as keys and out of the losses), so images with few or no
boxes cost the same program as full ones. Queries are laid out denoising
first, then the N matching queries, as in DINO.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def num_denoising_queries(num_groups: int, max_boxes: int) -> int:
    """2 * G * M: a positive and a negative copy of every ground-truth slot per group."""
    return 2 * num_groups * max_boxes


def contrastive_denoising_queries(
    rng: jax.Array,
    gt_boxes_cxcywh: jax.Array,
    gt_labels: jax.Array,
    gt_mask: jax.Array,
    *,
    num_groups: int,
    num_classes: int,
    label_noise_ratio: float = 0.5,
    box_noise_scale: float = 1.0,
) -> dict[str, jax.Array]:
    """Noised positive and negative copies of the ground truth, G groups per image.

    Args:
      rng: a PRNG key.
      gt_boxes_cxcywh: float `[B, M, 4]` (cx, cy, w, h) normalised to [0, 1] by the image size.
      gt_labels: int32 `[B, M]` contiguous class labels (any value at padding).
      gt_mask: bool `[B, M]`, False for padding slots.
      num_groups: G.
      num_classes: C; flipped labels are drawn uniformly from [0, C).
      label_noise_ratio: a label is replaced by a random one with probability half of this (DINO's rule).
      box_noise_scale: corner displacement in units of the box's half width/height: positives move by
        [0, scale), negatives by [scale, 2 scale).

    Returns a dict with D = 2 G M entries per image:
      labels: int32 `[B, D]` noised labels (the decoder's content input).
      boxes_cxcywh: float32 `[B, D, 4]` noised boxes clipped to [0, 1] (its positional input).
      valid: bool `[B, D]` the copy stands for a real ground-truth box.
      positive: bool `[B, D]` reconstruct the box (True) or predict no object (False).
      gt_index: int32 `[B, D]` the ground-truth slot each query is a copy of.
    """
    batch, max_boxes = gt_labels.shape
    copies = 2 * num_groups
    label_key, flip_key, sign_key, magnitude_key = jax.random.split(rng, 4)
    gt_index = jnp.tile(jnp.arange(max_boxes, dtype=jnp.int32), copies)  # [D]
    positive = jnp.tile(jnp.repeat(jnp.array([True, False]), max_boxes), num_groups)  # [D]
    shape = (batch, copies * max_boxes)

    labels = jnp.asarray(gt_labels, jnp.int32)[:, gt_index]
    flip = jax.random.uniform(flip_key, shape) < label_noise_ratio * 0.5
    labels = jnp.where(flip, jax.random.randint(label_key, shape, 0, num_classes, dtype=jnp.int32), labels)

    boxes = jnp.asarray(gt_boxes_cxcywh, jnp.float32)[:, gt_index]  # [B, D, 4]
    half_size = jnp.concatenate([boxes[..., 2:] / 2, boxes[..., 2:] / 2], axis=-1)  # per corner coordinate
    corners = jnp.concatenate([boxes[..., :2] - boxes[..., 2:] / 2, boxes[..., :2] + boxes[..., 2:] / 2], axis=-1)
    sign = jnp.where(jax.random.bernoulli(sign_key, 0.5, (*shape, 4)), 1.0, -1.0)
    magnitude = jax.random.uniform(magnitude_key, (*shape, 4)) + jnp.where(positive[None, :, None], 0.0, 1.0)
    corners = jnp.clip(corners + sign * magnitude * half_size * box_noise_scale, 0.0, 1.0)
    noised = jnp.concatenate([(corners[..., :2] + corners[..., 2:]) / 2, corners[..., 2:] - corners[..., :2]], -1)

    return {
        "labels": labels,
        "boxes_cxcywh": noised,
        "valid": jnp.asarray(gt_mask, bool)[:, gt_index],
        "positive": jnp.broadcast_to(positive, shape),
        "gt_index": jnp.broadcast_to(gt_index, shape),
    }


def denoising_attention_mask(num_groups: int, max_boxes: int, num_queries: int, valid: jax.Array) -> jax.Array:
    """Which decoder queries may attend to which: bool `[B, D + N, D + N]`, True = may attend.

    Rows are the attending queries, columns the attended ones; the D = 2 G M
    denoising queries come first, then the N matching queries.
      * Matching queries see every matching query and no denoising one.
      * A denoising query sees its own group and every matching query.
      * Invalid denoising queries (copies of padding slots, `valid` False)
        are seen by no one; each still sees itself, so no softmax row is empty.

    Args:
      num_groups: G.
      max_boxes: M.
      num_queries: N matching queries.
      valid: bool `[B, D]` from `contrastive_denoising_queries`.
    """
    denoising = num_denoising_queries(num_groups, max_boxes)
    total = denoising + num_queries
    group = jnp.concatenate(
        [jnp.repeat(jnp.arange(num_groups), 2 * max_boxes), jnp.full((num_queries,), -1)]
    )  # -1: matching queries
    same_group = group[:, None] == group[None, :]
    sees_matching = (group == -1)[None, :]  # every query sees the matching ones
    allowed = same_group | sees_matching  # [T, T]; matching rows: same_group covers the matching columns only
    key_valid = jnp.concatenate([jnp.asarray(valid, bool), jnp.ones((valid.shape[0], num_queries), bool)], -1)
    allowed = allowed[None] & key_valid[:, None, :]
    return allowed | jnp.eye(total, dtype=bool)[None]
