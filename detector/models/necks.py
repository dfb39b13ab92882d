"""Necks: backbone features -> a feature pyramid P{min_level}..P{max_level}.

- `FPN`: the feature pyramid network (Lin et al. 2017) on ResNet features C2..C5,
  with RetinaNet's P6/P7 extension.
- `SimpleFeaturePyramid`: ViTDet's pyramid (Li et al. 2022) from one stride-16 map.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from detector.errors import ConfigError
from detector.models.layers import constrain_activation, conv, group_norm


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
            level: conv(
                self.features, 1, dtype=self.dtype, kernel_init=nn.initializers.lecun_normal(), name=f"lateral{level}"
            )(backbone_features[level])
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
                conv(
                    self.features,
                    3,
                    dtype=self.dtype,
                    kernel_init=nn.initializers.lecun_normal(),
                    name=f"output{level}",
                )(merged[level])
            )
            for level in fused_levels
        }
        return add_extra_levels(pyramid, self.features, self.max_level, self.dtype)


def add_extra_levels(
    pyramid: dict[int, jax.Array], features: int, max_level: int, dtype: Any = jnp.float32
) -> dict[int, jax.Array]:
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


def deconvolution_upsample(x: jax.Array, steps: int, dtype: Any, name: str) -> jax.Array:
    """ViTDet's upsampling of a ViT map: `steps` 2x2 stride-2 transposed convolutions, each halving the channels.

    Between two of them a channel LayerNorm and GELU. Called inside a compact
    module's method, which owns the layers, named `{name}{i}` and
    `{name}_norm{i}`.

    `[B, h, w, C] -> [B, h * 2**steps, w * 2**steps, C // 2**steps]`.
    """
    for i in range(steps):
        if i:
            x = nn.gelu(
                group_norm(x.shape[-1], num_groups=1, dtype=dtype, name=f"{name}_norm{i}")(x), approximate=False
            )
        x = nn.ConvTranspose(
            x.shape[-1] // 2,
            (2, 2),
            strides=(2, 2),
            padding="VALID",
            dtype=dtype,
            param_dtype=jnp.float32,
            kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), ("kernel_h", "kernel_w", "conv_in", "conv_out")
            ),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("conv_out",)),
            name=f"{name}{i}",
        )(x)
    return x


class SimpleFeaturePyramid(PyramidNeck):
    """P{min_level}..P{max_level} from one stride-16 map (ViTDet's simple pyramid).

    Levels below 4 come from 2x2 stride-2 transposed convolutions, level 4 is
    the map itself, level 5 a 2x2 max-pool; each then gets a 1x1 and a 3x3
    convolution with channel LayerNorm. Levels above 5 are stride-2 convs on
    P5, as in RetinaNet's FPN.

    Returns:
      dict {level: [B, H/2**level, W/2**level, features]}.
    """

    @nn.compact
    def __call__(self, backbone_features: dict[int, jax.Array]) -> dict[int, jax.Array]:
        top_level = max(backbone_features)
        x = backbone_features[top_level]
        if self.min_level < top_level - 2:
            raise ConfigError(
                f"model.anchors.min_level={self.min_level}; the simple feature pyramid "
                f"builds levels {top_level - 2} and up"
            )
        pyramid = {}
        for level in range(self.min_level, min(self.max_level, top_level + 1) + 1):
            y = deconvolution_upsample(x, top_level - level, self.dtype, f"p{level}_up")
            if level > top_level:
                y = nn.max_pool(y, (2, 2), strides=(2, 2), padding="SAME")
            y = conv(self.features, 1, use_bias=False, dtype=self.dtype, name=f"p{level}_lateral")(y)
            y = group_norm(self.features, num_groups=1, dtype=self.dtype, name=f"p{level}_lateral_norm")(y)
            y = conv(self.features, 3, use_bias=False, dtype=self.dtype, name=f"p{level}_output")(y)
            y = group_norm(self.features, num_groups=1, dtype=self.dtype, name=f"p{level}_output_norm")(y)
            pyramid[level] = constrain_activation(y)
        return add_extra_levels(pyramid, self.features, self.max_level, self.dtype)


class ChannelMapper(PyramidNeck):
    """DINO's input projection: backbone levels C{min_level}.. mapped to `features` channels, plus stride-2 levels.

    Each backbone level gets a 1x1 convolution and GroupNorm(32); each level
    above the backbone's top a 3x3 stride-2 convolution and GroupNorm, the
    first on the top backbone map itself, the next on the level below (the
    Deformable DETR / DINO `input_proj`). No top-down fusion: the deformable
    encoder mixes the levels.

    Returns:
      dict {level: [B, ceil(H/2**level), ceil(W/2**level), features]}.
    """

    @nn.compact
    def __call__(self, backbone_features: dict[int, jax.Array]) -> dict[int, jax.Array]:
        top_backbone_level = max(backbone_features)
        if self.min_level not in backbone_features:
            raise ConfigError(
                f"model.dino.min_level={self.min_level}; the backbone gives levels "
                f"{min(backbone_features)}..{top_backbone_level}"
            )
        pyramid = {}
        x = None
        for level in range(self.min_level, self.max_level + 1):
            if level <= top_backbone_level:
                x = backbone_features[level]
            kernel_size, stride = (1, 1) if level <= top_backbone_level else (3, 2)
            y = conv(
                self.features,
                kernel_size,
                stride,
                dtype=self.dtype,
                kernel_init=nn.initializers.xavier_uniform(),
                name=f"input{level}",
            )(x)
            y = group_norm(self.features, num_groups=32, dtype=self.dtype, name=f"input{level}_norm")(y)
            pyramid[level] = constrain_activation(y)
            if level > top_backbone_level:
                x = y
        return pyramid
