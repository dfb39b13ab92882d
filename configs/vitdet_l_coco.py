"""ViTDet-L RetinaNet on COCO 2017 (ViT-L/16: width 1024, 24 blocks, 16 heads; global attention every 6th).

Same recipe as configs/vitdet_b_coco.py (common.vitdet_coco). At 1024 px the
train state alone (~0.3 B parameters with AdamW moments) is ~4 GB; shard it
with FSDP:

python -m detector.train --config=configs/vitdet_l_coco.py --workdir=DIR \
    --config.dataset.data_dir=TFDS_DIR --config.mesh.fsdp=8
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
    return common.vitdet_coco(common.vit_backbone(1024, 24, 16, global_attention_every=6))
