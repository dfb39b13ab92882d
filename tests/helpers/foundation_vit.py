"""DINOv3's ViT options as `ViT` keyword arguments, from the one place that states them (configs/common.py)."""

from __future__ import annotations

import dataclasses

from configs import common
from detector.models.vit import ViT

_VIT_FIELDS = {field.name for field in dataclasses.fields(ViT)} - {"parent", "name"}


def dinov3_options(embed_dim: int, depth: int, num_heads: int, **overrides) -> dict:
    """`ViT(**dinov3_options(...))` is `common.dinov3_backbone(...)`'s backbone, with `overrides` on top."""
    backbone = common.dinov3_backbone(embed_dim, depth, num_heads)
    return {**{key: value for key, value in backbone.items() if key in _VIT_FIELDS}, **overrides}
