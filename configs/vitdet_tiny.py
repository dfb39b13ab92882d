"""A tiny ViTDet-style detector on the embedded synthetic-shapes dataset (laptop CPU).

The same model family as configs/vitdet_{b,l,h}_coco.py (plain ViT, windowed
attention with global blocks, simple feature pyramid, RetinaNet head) at a
size that trains in minutes on a CPU.

python -m detector.train --config=configs/vitdet_tiny.py --workdir=runs/vitdet_tiny
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
    config = common.base_config()
    config.model.backbone = common.vit_backbone(
        64, 4, 4, window_size=4, global_attention_every=2, pretrain_image_size=128
    )
    config.model.fpn_features = 64
    config.model.head_features = 64
    config.optimizer.learning_rate = 1e-3
    config.optimizer.weight_decay = 0.05
    return config
