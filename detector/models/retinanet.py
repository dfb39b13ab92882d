"""RetinaNet: a ResNet-FPN or ViT-simple-pyramid trunk -> shared dense classification/box heads."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from detector.errors import ConfigError
from detector.models import backbones, level_packing
from detector.models.layers import constrain_activation, conv, group_norm
from detector.models.necks import FPN, SimpleFeaturePyramid


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
    norm: str = "group"  # one of HEAD_NORMS
    # Run each conv once on a canvas of all levels (see level_packing) instead
    # of once per level; the parameters are the same either way.
    pack_levels: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, pyramid: dict[int, jax.Array]) -> tuple[jax.Array, jax.Array]:
        if self.norm not in HEAD_NORMS:
            raise ConfigError(f"model.head_norm={self.norm!r}; use one of {', '.join(HEAD_NORMS)}")

        def tower_layers(prefix):
            # Modules are created once and applied to every level: shared weights.
            return [
                (
                    conv(
                        self.features,
                        3,
                        dtype=self.dtype,
                        kernel_init=nn.initializers.normal(0.01),
                        name=f"{prefix}_conv{i}",
                    ),
                    group_norm(self.features, dtype=self.dtype, name=f"{prefix}_norm{i}")
                    if self.norm == "group"
                    else None,
                )
                for i in range(self.num_convs)
            ]

        cls_tower, box_tower = tower_layers("cls"), tower_layers("box")
        # The prior bias makes every anchor start as background with p=0.01, so
        # the focal loss of ~100k easy negatives does not swamp the first steps.
        prior_bias = -math.log((1.0 - self.prior_probability) / self.prior_probability)
        cls_out = conv(
            self.num_anchors * self.num_classes,
            3,
            dtype=self.dtype,
            kernel_init=nn.initializers.normal(0.01),
            bias_init=nn.initializers.constant(prior_bias),
            name="cls_logits",
        )
        box_out = conv(
            self.num_anchors * 4, 3, dtype=self.dtype, kernel_init=nn.initializers.normal(0.01), name="box_deltas"
        )

        if self.pack_levels:
            logits, deltas = self._packed(pyramid, cls_tower, box_tower, cls_out, box_out)
        else:
            logits, deltas = self._level_by_level(pyramid, cls_tower, box_tower, cls_out, box_out)
        batch = next(iter(pyramid.values())).shape[0]
        all_logits = [logits[level].reshape(batch, -1, self.num_classes) for level in sorted(pyramid)]
        all_deltas = [deltas[level].reshape(batch, -1, 4) for level in sorted(pyramid)]
        # Losses and post-processing run in float32 whatever the compute dtype.
        return (
            jnp.concatenate(all_logits, axis=1).astype(jnp.float32),
            jnp.concatenate(all_deltas, axis=1).astype(jnp.float32),
        )

    def _packed(self, pyramid, cls_tower, box_tower, cls_out, box_out):
        """Both towers on one canvas of all levels: `{level: [B, h_l, w_l, A*C]}`, `{level: [B, h_l, w_l, A*4]}`."""
        # One kernel-gradient reduction per conv instead of one per level
        # (see level_packing); GroupNorm keeps per-level statistics, as in the paper.
        layout = level_packing.plan_layout({level: x.shape[1:3] for level, x in pyramid.items()})
        canvas = constrain_activation(level_packing.pack(pyramid, layout))
        in_regions = jnp.asarray(level_packing.region_mask(layout), self.dtype)

        def tower(layers):
            x = canvas
            for conv_layer, norm_layer in layers:
                if norm_layer is None:
                    # Zeroing the gaps (biases and neighbours leak into them)
                    # keeps every level's next conv equal to its own.
                    x = constrain_activation(nn.relu(conv_layer(x)) * in_regions)
                    continue
                levels = level_packing.unpack(conv_layer(x), layout)
                x = constrain_activation(
                    level_packing.pack({level: nn.relu(norm_layer(y)) for level, y in levels.items()}, layout)
                )
            return x

        logits = level_packing.unpack(cls_out(tower(cls_tower)), layout)
        deltas = level_packing.unpack(box_out(tower(box_tower)), layout)
        return logits, deltas

    def _level_by_level(self, pyramid, cls_tower, box_tower, cls_out, box_out):
        """Both towers on each level alone, the same modules (shared weights); outputs as `_packed`'s."""

        def tower(layers):
            xs = pyramid
            for conv_layer, norm_layer in layers:
                xs = {
                    level: constrain_activation(
                        nn.relu(conv_layer(x) if norm_layer is None else norm_layer(conv_layer(x)))
                    )
                    for level, x in xs.items()
                }
            return xs

        logits = {level: cls_out(x) for level, x in tower(cls_tower).items()}
        deltas = {level: box_out(x) for level, x in tower(box_tower).items()}
        return logits, deltas


class RetinaNet(nn.Module):
    """The detector: backbone -> neck (feature pyramid) -> shared dense head.

    `__call__(images [B,H,W,3] float) -> (cls_logits [B,A,C], box_deltas [B,A,4])`.
    """

    backbone: nn.Module  # images -> {level: features}
    neck: nn.Module  # {level: features} -> {level: [B, H/2**l, W/2**l, F]}
    head: RetinaNetHead

    def __call__(self, images: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.head(self.neck(self.backbone(images)))


HEAD_NORMS = ("group", "none")
HEAD_LEVEL_PACKINGS = ("auto", "always", "never")


def packs_head_levels(model_config, data_parallel_devices: int = 1) -> bool:
    """Whether the head runs its convs on one canvas of all levels: `model.head_level_packing` resolved.

    `data_parallel_devices`: how many devices the batch is split over, and so
    the kernel gradients reduced across (1 where nothing is differentiated,
    e.g. prediction). "auto" packs only where that is more than one: packing
    saves one reduction per level and conv there, but costs ~14% more pixels
    and copies, a pure loss on one device.
    """
    choice = model_config.head_level_packing
    if choice not in HEAD_LEVEL_PACKINGS:
        raise ConfigError(f"model.head_level_packing={choice!r}; use one of {', '.join(HEAD_LEVEL_PACKINGS)}")
    if choice == "auto":
        return data_parallel_devices > 1
    return choice == "always"


def create_model(model_config, num_classes: int, num_anchors: int, *, data_parallel_devices: int = 1) -> RetinaNet:
    """Builds the RetinaNet from `config.model`.

    `model.backbone.name` picks the trunk (`backbones.BACKBONES`): one with
    several levels gets an FPN neck (a ResNet), one with a single stride-16
    map ViTDet's simple feature pyramid (a ViT). `model.dtype` is the compute dtype;
    parameters, optimizer state and losses stay float32. `data_parallel_devices`
    decides `model.head_level_packing="auto"` (see `packs_head_levels`).
    """
    dtype = backbones.compute_dtype(model_config)
    backbone = backbones.create_backbone(model_config, dtype)
    levels = dict(min_level=model_config.anchors.min_level, max_level=model_config.anchors.max_level)
    if backbones.backbone_kind(model_config.backbone).multi_level:
        neck = FPN(model_config.fpn_features, **levels, dtype=dtype)
    else:
        neck = SimpleFeaturePyramid(model_config.fpn_features, **levels, dtype=dtype)
    head = RetinaNetHead(
        num_classes,
        num_anchors,
        model_config.head_convs,
        model_config.head_features,
        norm=model_config.head_norm,
        pack_levels=packs_head_levels(model_config, data_parallel_devices),
        dtype=dtype,
    )
    return RetinaNet(backbone=backbone, neck=neck, head=head)
