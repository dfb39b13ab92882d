"""RetinaNet: ResNet backbone -> FPN -> shared dense classification/box heads."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from detector.backbone import ResNet
from detector.errors import ConfigError
from detector.fpn import FPN
from detector.layers import conv, group_norm


class RetinaNetHead(nn.Module):
    """Class and box towers shared across pyramid levels.

    Returns per-level outputs flattened in anchor order (level, y, x, anchor):
      cls_logits `[B, A, num_classes]` and box_deltas `[B, A, 4]`.
    """

    num_classes: int
    num_anchors: int
    num_convs: int = 4
    features: int = 256
    prior_probability: float = 0.01
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, pyramid: dict[int, jax.Array]) -> tuple[jax.Array, jax.Array]:
        # Modules are created once and applied to every level: shared weights.
        cls_tower = [(conv(self.features, 3, dtype=self.dtype, kernel_init=nn.initializers.normal(0.01),
                           name=f"cls_conv{i}"), group_norm(self.features, dtype=self.dtype, name=f"cls_norm{i}"))
                     for i in range(self.num_convs)]
        box_tower = [(conv(self.features, 3, dtype=self.dtype, kernel_init=nn.initializers.normal(0.01),
                           name=f"box_conv{i}"), group_norm(self.features, dtype=self.dtype, name=f"box_norm{i}"))
                     for i in range(self.num_convs)]
        # The prior bias makes every anchor start as background with p=0.01, so
        # the focal loss of ~100k easy negatives does not swamp the first steps.
        prior_bias = -math.log((1.0 - self.prior_probability) / self.prior_probability)
        cls_out = conv(self.num_anchors * self.num_classes, 3, dtype=self.dtype,
                       kernel_init=nn.initializers.normal(0.01),
                       bias_init=nn.initializers.constant(prior_bias), name="cls_logits")
        box_out = conv(self.num_anchors * 4, 3, dtype=self.dtype,
                       kernel_init=nn.initializers.normal(0.01), name="box_deltas")

        all_logits, all_deltas = [], []
        for level in sorted(pyramid):
            x = pyramid[level]
            batch = x.shape[0]
            c = x
            for conv_layer, norm_layer in cls_tower:
                c = nn.relu(norm_layer(conv_layer(c)))
            b = x
            for conv_layer, norm_layer in box_tower:
                b = nn.relu(norm_layer(conv_layer(b)))
            all_logits.append(cls_out(c).reshape(batch, -1, self.num_classes))
            all_deltas.append(box_out(b).reshape(batch, -1, 4))
        # Losses and post-processing run in float32 whatever the compute dtype.
        return (jnp.concatenate(all_logits, axis=1).astype(jnp.float32),
                jnp.concatenate(all_deltas, axis=1).astype(jnp.float32))


class RetinaNet(nn.Module):
    """The detector. `__call__(images [B,H,W,3] float) -> (cls_logits [B,A,C], box_deltas [B,A,4])`."""

    num_classes: int
    num_anchors: int
    stage_sizes: tuple[int, ...] = (3, 4, 6, 3)
    backbone_width: int = 64
    block: str = "bottleneck"
    fpn_features: int = 256
    head_convs: int = 4
    head_features: int = 256
    min_level: int = 3
    max_level: int = 7
    remat: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, images: jax.Array) -> tuple[jax.Array, jax.Array]:
        features = ResNet(self.stage_sizes, self.backbone_width, self.block, self.remat, self.dtype,
                          name="backbone")(images)
        pyramid = FPN(self.fpn_features, self.min_level, self.max_level, self.dtype, name="fpn")(features)
        return RetinaNetHead(self.num_classes, self.num_anchors, self.head_convs, self.head_features,
                             dtype=self.dtype, name="head")(pyramid)


def create_model(model_config, num_classes: int, num_anchors: int) -> RetinaNet:
    """Builds the detector from `config.model`."""
    dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
    if model_config.dtype not in dtypes:
        raise ConfigError(f"model.dtype={model_config.dtype!r}; use one of {sorted(dtypes)}")
    return RetinaNet(
        num_classes=num_classes,
        num_anchors=num_anchors,
        stage_sizes=tuple(model_config.backbone.stage_sizes),
        backbone_width=model_config.backbone.width,
        block=model_config.backbone.block,
        fpn_features=model_config.fpn_features,
        head_convs=model_config.head_convs,
        head_features=model_config.head_features,
        min_level=model_config.anchors.min_level,
        max_level=model_config.anchors.max_level,
        remat=model_config.remat,
        dtype=dtypes[model_config.dtype],
    )
