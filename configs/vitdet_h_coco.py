"""ViTDet-H RetinaNet on COCO 2017 (ViT-H/16: width 1280, 32 blocks, 16 heads; global attention every 8th).

Same recipe as configs/vitdet_b_coco.py (common.vitdet_coco). ~0.65 B
parameters: plan the mesh before launching, e.g. for 64 devices of 80 GB:

python -m detector.plan --config=configs/vitdet_h_coco.py --devices=64
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
    return common.vitdet_coco(common.vit_backbone(1280, 32, 16, global_attention_every=8))
