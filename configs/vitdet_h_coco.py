"""ViTDet-H RetinaNet on COCO 2017 (ViT-H/16: width 1280, 32 blocks, 16 heads; global attention every 8th).

Same recipe as configs/vitdet_b_coco.py. ~0.65 B parameters: plan the mesh
before launching, e.g. for 64 devices of 80 GB:

python -m detector.plan --config=configs/vitdet_h_coco.py --devices=64
"""

import ml_collections

from configs import vitdet_b_coco
from configs.vitdet_tiny import vit_backbone


def get_config() -> ml_collections.ConfigDict:
    config = vitdet_b_coco.get_config()
    config.model.backbone = vit_backbone(1280, 32, 16, global_attention_every=8)
    return config
