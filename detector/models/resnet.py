"""ResNet backbone (v1.5: stride on the 3x3 conv) returning C2..C5 feature maps.

With frozen BatchNorm (the form torchvision's ImageNet weights take here)
convolutions and the stem's max pool pad symmetrically, as torchvision's
ResNet does, so weights converted by `detector.models.weights` compute the same
features; otherwise they pad 'SAME'. Output shapes are the same either way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from detector.errors import ConfigError
from detector.models.layers import (
    FrozenBatchNorm,
    constrain_activation,
    conv,
    group_norm,
    rematerialized,
    symmetric_padding,
)

# "group": GroupNorm, trained (from-scratch training at a few images per device).
# "frozen_bn": BatchNorm with fixed pretrained statistics and affine (fine-tuning ImageNet weights).
NORMS = ("group", "frozen_bn")
STEM_NORM_NAME = "stem_norm"


def check_norm(norm: str) -> None:
    if norm not in NORMS:
        raise ConfigError(f"model.backbone.norm={norm!r}; use one of {', '.join(NORMS)}")


def resnet_padding(norm: str, kernel_size: int):
    """torchvision's symmetric `kernel_size // 2` padding for its weights (frozen_bn), else 'SAME'.

    Pretrained torchvision weights must see the windows they were trained on.
    From scratch, 'SAME' stays: XLA's spatial partitioning (height split over
    `model`) reproduces single-device gradients to rounding with it, but only
    to ~1e-3 of an update with explicit padding on stride-2 convolutions.
    """
    return symmetric_padding(kernel_size) if norm == "frozen_bn" else "SAME"


def resnet_conv(
    features: int, kernel_size: int, strides: int = 1, *, dtype: Any, norm: str, name: str | None = None
) -> nn.Conv:
    """A bias-free convolution, padded as `resnet_padding` says."""
    return conv(
        features,
        kernel_size,
        strides,
        use_bias=False,
        dtype=dtype,
        padding=resnet_padding(norm, kernel_size),
        name=name,
    )


def norm_layer(norm: str, channels: int, *, dtype: Any, zero_init: bool = False, name: str | None = None) -> nn.Module:
    """The normalisation `norm` names, over `[..., channels]`.

    `zero_init` starts a GroupNorm's scale at 0 (for the last norm of a
    residual branch). Frozen BatchNorm always starts as the identity: its
    scale never trains, so a zero would switch the branch off for good.
    """
    check_norm(norm)
    if norm == "frozen_bn":
        return FrozenBatchNorm(channels, dtype=dtype, name=name)
    scale_init = nn.initializers.zeros if zero_init else nn.initializers.ones
    return group_norm(channels, dtype=dtype, scale_init=scale_init, name=name)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions (ResNet-18/34)."""

    features: int
    strides: int = 1
    dtype: Any = jnp.float32
    norm: str = "group"
    expansion = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        residual = x
        y = resnet_conv(self.features, 3, self.strides, dtype=self.dtype, norm=self.norm)(x)
        y = nn.relu(norm_layer(self.norm, self.features, dtype=self.dtype)(y))
        y = resnet_conv(self.features, 3, dtype=self.dtype, norm=self.norm)(y)
        # Zero-init of the last norm makes every block start as identity, which
        # trains deep stacks from scratch stably (Goyal et al. 2017).
        y = norm_layer(self.norm, self.features, dtype=self.dtype, zero_init=True)(y)
        if residual.shape != y.shape:
            residual = resnet_conv(self.features, 1, self.strides, dtype=self.dtype, norm=self.norm)(residual)
            residual = norm_layer(self.norm, self.features, dtype=self.dtype)(residual)
        return constrain_activation(nn.relu(residual + y))


class BottleneckBlock(nn.Module):
    """1x1 -> 3x3 -> 1x1 bottleneck with 4x expansion (ResNet-50/101)."""

    features: int
    strides: int = 1
    dtype: Any = jnp.float32
    norm: str = "group"
    expansion = 4

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        residual = x
        y = resnet_conv(self.features, 1, dtype=self.dtype, norm=self.norm)(x)
        y = nn.relu(norm_layer(self.norm, self.features, dtype=self.dtype)(y))
        y = resnet_conv(self.features, 3, self.strides, dtype=self.dtype, norm=self.norm)(y)
        y = nn.relu(norm_layer(self.norm, self.features, dtype=self.dtype)(y))
        y = resnet_conv(self.features * 4, 1, dtype=self.dtype, norm=self.norm)(y)
        y = norm_layer(self.norm, self.features * 4, dtype=self.dtype, zero_init=True)(y)
        if residual.shape != y.shape:
            residual = resnet_conv(self.features * 4, 1, self.strides, dtype=self.dtype, norm=self.norm)(residual)
            residual = norm_layer(self.norm, self.features * 4, dtype=self.dtype)(residual)
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
      norm: 'group' (GroupNorm) or 'frozen_bn' (BatchNorm with fixed
        statistics, for pretrained weights); see `NORMS`.
    Returns:
      dict {level: features}, level l in 2..5 at stride 2**l, `[B, H/2**l, W/2**l, C_l]`.
    """

    stage_sizes: Sequence[int]
    width: int = 64
    block: str = "bottleneck"
    remat: str = "none"
    dtype: Any = jnp.float32
    norm: str = "group"

    @nn.compact
    def __call__(self, images: jax.Array) -> dict[int, jax.Array]:
        if self.block not in BLOCKS:
            raise ConfigError(f"model.backbone.block={self.block!r}; use one of {sorted(BLOCKS)}")
        check_norm(self.norm)
        block_cls = rematerialized(BLOCKS[self.block], self.remat)
        x = images.astype(self.dtype)
        x = resnet_conv(self.width, 7, 2, dtype=self.dtype, norm=self.norm, name="stem_conv")(x)
        x = nn.relu(norm_layer(self.norm, self.width, dtype=self.dtype, name=STEM_NORM_NAME)(x))
        # max_pool pads with -inf: on both sides, as torchvision does, for its weights.
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=resnet_padding(self.norm, 3))
        x = constrain_activation(x)
        features = {}
        for stage, num_blocks in enumerate(self.stage_sizes):
            for index in range(num_blocks):
                strides = 2 if stage > 0 and index == 0 else 1
                x = block_cls(
                    self.width * 2**stage,
                    strides,
                    dtype=self.dtype,
                    norm=self.norm,
                    name=f"stage{stage + 1}_block{index + 1}",
                )(x)
            features[stage + 2] = x
        return features


def _stage_of(module_name: str) -> int:
    # 0 for the stem, s for the blocks of stage s ("stage{s}_block{i}").
    if module_name.startswith("stem_"):
        return 0
    return int(module_name[len("stage") :].split("_", 1)[0])


def frozen_parameter_mask(backbone_params, *, norm: str = "group", freeze_stages: int = 0):
    """Which ResNet parameters the optimizer keeps fixed: a tree of bools shaped like `backbone_params`.

    True for every frozen-BatchNorm parameter when `norm == 'frozen_bn'`, and
    for everything in the first `freeze_stages` stages, counting the stem as
    stage 1 (detectron2's FREEZE_AT: 0 trains all, 1 freezes the stem, 2 the
    stem and the first residual stage, ..., 5 the whole ResNet-50).
    `backbone_params` is a ResNet params tree; its leaves may be arrays,
    `jax.ShapeDtypeStruct`s or anything else.
    """
    check_norm(norm)
    flat = traverse_util.flatten_dict(backbone_params)
    num_stages = 1 + len({key[0].split("_", 1)[0] for key in flat if key[0].startswith("stage")})
    if not isinstance(freeze_stages, int) or not 0 <= freeze_stages <= num_stages:
        raise ConfigError(
            f"model.backbone.freeze_stages={freeze_stages!r}; use an integer from 0 (train all) "
            f"to {num_stages} (the stem and all {num_stages - 1} residual stages)"
        )

    def frozen(path: tuple[str, ...]) -> bool:
        if _stage_of(path[0]) < freeze_stages:
            return True
        return norm == "frozen_bn" and (
            path[0] == STEM_NORM_NAME or any(part.startswith(FrozenBatchNorm.__name__) for part in path)
        )

    return traverse_util.unflatten_dict({path: frozen(path) for path in flat})


def frozen_parameters(backbone_config) -> Callable | None:
    """`backbone params -> tree of bools` (True: held fixed) for the ResNet of `config.model.backbone`, or None
    when its `norm` and `freeze_stages` freeze nothing (see `frozen_parameter_mask`)."""
    norm, freeze_stages = backbone_config.norm, backbone_config.freeze_stages
    check_norm(norm)
    if not isinstance(freeze_stages, int) or freeze_stages < 0:
        raise ConfigError(f"model.backbone.freeze_stages={freeze_stages!r}; use an integer >= 0")
    if norm != "frozen_bn" and freeze_stages == 0:
        return None
    return functools.partial(frozen_parameter_mask, norm=norm, freeze_stages=freeze_stages)
