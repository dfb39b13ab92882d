"""ResNet backbone (v1.5: stride on the 3x3 conv) returning C2..C5 feature maps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from detector.errors import ConfigError
from detector.layers import constrain_activation, conv, group_norm, rematerialized


class BasicBlock(nn.Module):
    """Two 3x3 convolutions (ResNet-18/34)."""

    features: int
    strides: int = 1
    dtype: Any = jnp.float32
    expansion = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        residual = x
        y = conv(self.features, 3, self.strides, use_bias=False, dtype=self.dtype)(x)
        y = nn.relu(group_norm(self.features, dtype=self.dtype)(y))
        y = conv(self.features, 3, use_bias=False, dtype=self.dtype)(y)
        # Zero-init of the last norm makes every block start as identity, which
        # trains deep stacks from scratch stably (Goyal et al. 2017).
        y = group_norm(self.features, dtype=self.dtype, scale_init=nn.initializers.zeros)(y)
        if residual.shape != y.shape:
            residual = conv(self.features, 1, self.strides, use_bias=False, dtype=self.dtype)(residual)
            residual = group_norm(self.features, dtype=self.dtype)(residual)
        return constrain_activation(nn.relu(residual + y))


class BottleneckBlock(nn.Module):
    """1x1 -> 3x3 -> 1x1 bottleneck with 4x expansion (ResNet-50/101)."""

    features: int
    strides: int = 1
    dtype: Any = jnp.float32
    expansion = 4

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        residual = x
        y = conv(self.features, 1, use_bias=False, dtype=self.dtype)(x)
        y = nn.relu(group_norm(self.features, dtype=self.dtype)(y))
        y = conv(self.features, 3, self.strides, use_bias=False, dtype=self.dtype)(y)
        y = nn.relu(group_norm(self.features, dtype=self.dtype)(y))
        y = conv(self.features * 4, 1, use_bias=False, dtype=self.dtype)(y)
        y = group_norm(self.features * 4, dtype=self.dtype, scale_init=nn.initializers.zeros)(y)
        if residual.shape != y.shape:
            residual = conv(self.features * 4, 1, self.strides, use_bias=False, dtype=self.dtype)(residual)
            residual = group_norm(self.features * 4, dtype=self.dtype)(residual)
        return constrain_activation(nn.relu(residual + y))


BLOCKS = {"basic": BasicBlock, "bottleneck": BottleneckBlock}


class ResNet(nn.Module):
    """ResNet trunk.

    Attributes:
      stage_sizes: blocks per stage, e.g. (3, 4, 6, 3) for ResNet-50.
      width: channels of the first stage (64 for the standard ResNets); stage i
        has width * 2**i (times 4 for bottleneck outputs).
      block: 'basic' or 'bottleneck'.
      remat: rematerialisation policy per block: 'none', 'full' or 'dots'.
    Returns:
      dict {level: features}, level l in 2..5 at stride 2**l, `[B, H/2**l, W/2**l, C_l]`.
    """

    stage_sizes: Sequence[int]
    width: int = 64
    block: str = "bottleneck"
    remat: str = "none"
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, images: jax.Array) -> dict[int, jax.Array]:
        if self.block not in BLOCKS:
            raise ConfigError(f"model.backbone.block={self.block!r}; use one of {sorted(BLOCKS)}")
        block_cls = rematerialized(BLOCKS[self.block], self.remat)
        x = images.astype(self.dtype)
        x = conv(self.width, 7, 2, use_bias=False, dtype=self.dtype, name="stem_conv")(x)
        x = nn.relu(group_norm(self.width, dtype=self.dtype, name="stem_norm")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        x = constrain_activation(x)
        features = {}
        for stage, num_blocks in enumerate(self.stage_sizes):
            for index in range(num_blocks):
                strides = 2 if stage > 0 and index == 0 else 1
                x = block_cls(self.width * 2**stage, strides, dtype=self.dtype,
                              name=f"stage{stage + 1}_block{index + 1}")(x)
            features[stage + 2] = x
        return features
