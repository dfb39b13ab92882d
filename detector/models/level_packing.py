"""Packing the levels of a feature pyramid into one canvas, so a shared conv runs once.

A detection head applies the same 3x3 convolutions to every pyramid level.
Run level by level, each level's kernel gradient is a separate contraction
over the (sharded) batch, and XLA reduces each one across data-parallel
devices on its own: the head's gradients then cross the network once per
level. Running each conv once on a canvas that holds all levels, separated
by zero gaps, gives the same outputs (a zero gap is exactly the 'SAME'
padding each level would see alone), one kernel-gradient contraction, one
reduction, and fewer, larger convolutions.

Layout: the largest level sits at the top-left; the others are stacked in
columns to its right, each region followed by a one-pixel zero gap. For
P3-P7 the canvas is ~13% larger than the levels themselves.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# Zero pixels between regions: enough for one 3x3 convolution. Callers re-pack
# after every conv so the gaps are zero again before the next one.
GAP = 1


@dataclasses.dataclass(frozen=True)
class CanvasLayout:
    """Static placement of each level: `{level: (y, x, height, width)}` on a `height x width` canvas."""

    regions: dict[int, tuple[int, int, int, int]]
    height: int
    width: int


def plan_layout(level_shapes: dict[int, tuple[int, int]]) -> CanvasLayout:
    """Places levels `{level: (height, width)}`, largest first, in columns of the largest's height."""
    levels = sorted(level_shapes, key=lambda level: level_shapes[level][0] * level_shapes[level][1], reverse=True)
    canvas_height = level_shapes[levels[0]][0]
    regions = {}
    x, y, column_width = 0, 0, 0
    for level in levels:
        h, w = level_shapes[level]
        if y and y + h > canvas_height:  # start the next column
            x, y, column_width = x + column_width + GAP, 0, 0
        regions[level] = (y, x, h, w)
        if not y and not x:  # the largest level fills its own column
            x, column_width = w + GAP, 0
            continue
        y += h + GAP
        column_width = max(column_width, w)
    width = max(rx + rw for _, rx, _, rw in regions.values())
    return CanvasLayout(regions=regions, height=canvas_height, width=width)


def pack(features: dict[int, jax.Array], layout: CanvasLayout) -> jax.Array:
    """`{level: [B, h_l, w_l, C]}` -> `[B, height, width, C]` with zeros outside the regions."""
    first = next(iter(features.values()))
    canvas = jnp.zeros((first.shape[0], layout.height, layout.width, first.shape[-1]), first.dtype)
    for level, (y, x, _, _) in layout.regions.items():
        canvas = jax.lax.dynamic_update_slice(canvas, features[level], (0, y, x, 0))
    return canvas


def region_mask(layout: CanvasLayout) -> np.ndarray:
    """`[1, height, width, 1]` float32: 1 inside the levels' regions, 0 in the gaps."""
    mask = np.zeros((1, layout.height, layout.width, 1), np.float32)
    for y, x, h, w in layout.regions.values():
        mask[:, y : y + h, x : x + w] = 1.0
    return mask


def unpack(canvas: jax.Array, layout: CanvasLayout) -> dict[int, jax.Array]:
    """`[B, height, width, C]` -> `{level: [B, h_l, w_l, C]}` (static slices)."""
    return {level: canvas[:, y : y + h, x : x + w, :] for level, (y, x, h, w) in layout.regions.items()}
