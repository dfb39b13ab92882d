"""ViTDet-B RetinaNet on COCO 2017: plain ViT-B/16 backbone, simple feature pyramid.

The ViTDet recipe of common.vitdet_coco (window attention 14x14, global
attention in blocks 2, 5, 8, 11; AdamW, batch 64, 184k steps, bf16 compute).

python -m detector.train --config=configs/vitdet_b_coco.py --workdir=DIR \
    --config.dataset.data_dir=TFDS_DIR --config.mesh.fsdp=8

ViT-S (width 384, 6 heads) is the same recipe with
--config.model.backbone.embed_dim=384 --config.model.backbone.num_heads=6.
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
    return common.vitdet_coco(common.vit_backbone(768, 12, 12, global_attention_every=3))
