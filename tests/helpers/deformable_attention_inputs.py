"""Inputs of multi-scale deformable attention for its tests and its stored torch reference."""

from __future__ import annotations

import numpy as np

# Non-square levels of different sizes, one a single pixel: (h, w) each.
SHAPES = ((5, 7), (3, 4), (2, 1), (1, 1))


def sampling_inputs(rng, batch=2, queries=6, heads=3, points=3, head_dim=5, shapes=SHAPES):
    """(value `[B, S, heads, head_dim]`, locations `[B, Q, heads, levels, points, 2]`, weights `[B, Q, heads,
    levels, points]`), float32: S = sum of h * w over `shapes` (row by row); locations (x, y) as fractions of a
    level's width and height, inside, on the border and outside of every level; weights softmax-normalised."""
    total = sum(h * w for h, w in shapes)
    value = rng.normal(size=(batch, total, heads, head_dim)).astype(np.float32)
    locations = rng.uniform(-0.3, 1.3, size=(batch, queries, heads, len(shapes), points, 2)).astype(np.float32)
    # Exact edges, corners and pixel centres; Deformable DETR's reference points often sit there.
    locations[0, 0, :, :, 0] = [0.0, 0.0]
    locations[0, 0, :, :, 1] = [1.0, 1.0]
    locations[0, 1, :, :, 0] = [0.0, 0.5]
    for level, (height, width) in enumerate(shapes):
        locations[0, 1, :, level, 1] = [0.5 / width, 1.5 / height]
        locations[-1, 0, :, level, 0] = [1.0 - 0.5 / width, 0.5 / height]
    logits = rng.normal(size=(batch, queries, heads, len(shapes) * points))
    weights = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    return value, locations, weights.reshape(locations.shape[:-1]).astype(np.float32)
