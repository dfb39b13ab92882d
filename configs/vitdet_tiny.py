"""A tiny ViTDet-style detector on the embedded synthetic-shapes dataset (laptop CPU).

The same model family as configs/vitdet_{b,l,h}_coco.py (plain ViT, windowed
attention with global blocks, simple feature pyramid, RetinaNet head) at a
size that trains in minutes on a CPU.

python -m detector.train --config=configs/vitdet_tiny.py --workdir=runs/vitdet_tiny
"""

import ml_collections

from configs import default


def vit_backbone(
    embed_dim: int,
    depth: int,
    num_heads: int,
    *,
    window_size: int = 14,
    global_attention_every: int,
    pretrain_image_size: int = 224,
) -> ml_collections.ConfigDict:
    """`config.model.backbone` for a plain ViT at patch 16 (4 global blocks for the ViTDet sizes)."""
    return ml_collections.ConfigDict(
        dict(
            name="vit",
            patch_size=16,
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=4.0,
            window_size=window_size,
            global_attention_every=global_attention_every,
            pretrain_image_size=pretrain_image_size,
            scan=True,
        )
    )


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.model.backbone = vit_backbone(64, 4, 4, window_size=4, global_attention_every=2, pretrain_image_size=128)
    config.model.fpn_features = 64
    config.model.head_features = 64
    config.optimizer.learning_rate = 1e-3
    config.optimizer.weight_decay = 0.05
    return config
