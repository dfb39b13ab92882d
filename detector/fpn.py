"""Feature pyramid network (Lin et al. 2017) with RetinaNet's P6/P7 extension."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from detector.layers import constrain_activation, conv


def _upsample_to(x: jax.Array, height: int, width: int) -> jax.Array:
    """Nearest-neighbour 2x upsampling, cropped to the target size (odd inputs)."""
    x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
    return x[:, :height, :width, :]


class PyramidNeck(nn.Module):
    """What every neck is: backbone features -> P{min_level}..P{max_level}, each `features` wide."""

    features: int = 256
    min_level: int = 3
    max_level: int = 7
    dtype: Any = jnp.float32


class FPN(PyramidNeck):
    """Builds P{min_level}..P{max_level} from backbone features C2..C5.

    Levels above 5 are made by stride-2 3x3 convolutions on P5 (the
    torchvision/detectron2 RetinaNet variant: "p5" input).

    Returns:
      dict {level: [B, ceil(H/2**level), ceil(W/2**level), features]}.
    """

    @nn.compact
    def __call__(self, backbone_features: dict[int, jax.Array]) -> dict[int, jax.Array]:
        top_backbone_level = max(backbone_features)
        fused_levels = range(self.min_level, min(self.max_level, top_backbone_level) + 1)
        laterals = {
            level: conv(self.features, 1, dtype=self.dtype, kernel_init=nn.initializers.lecun_normal(),
                        name=f"lateral{level}")(backbone_features[level])
            for level in fused_levels
        }
        merged = {}
        for level in reversed(fused_levels):
            x = laterals[level]
            if level + 1 in merged:
                x = x + _upsample_to(merged[level + 1], x.shape[1], x.shape[2])
            merged[level] = x
        pyramid = {
            level: constrain_activation(
                conv(self.features, 3, dtype=self.dtype, kernel_init=nn.initializers.lecun_normal(),
                     name=f"output{level}")(merged[level]))
            for level in fused_levels
        }
        return add_extra_levels(pyramid, self.features, self.max_level, self.dtype)


def add_extra_levels(pyramid: dict[int, jax.Array], features: int, max_level: int,
                     dtype: Any = jnp.float32) -> dict[int, jax.Array]:
    """Adds levels up to `max_level` by stride-2 3x3 convs on the top level (RetinaNet's P6/P7).

    Call from a compact `__call__`: the convs become the caller's submodules
    `extra{level}`. ReLU precedes every extra conv but the first.
    """
    first_extra = max(pyramid) + 1
    x = pyramid[max(pyramid)]
    for level in range(first_extra, max_level + 1):
        x = x if level == first_extra else nn.relu(x)
        x = conv(features, 3, 2, dtype=dtype, kernel_init=nn.initializers.lecun_normal(), name=f"extra{level}")(x)
        pyramid[level] = constrain_activation(x)
    return pyramid
