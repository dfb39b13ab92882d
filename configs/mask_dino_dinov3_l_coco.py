"""Mask DINO on a DINOv3 ViT-L/16 backbone on COCO 2017 instance segmentation (1024 px LSJ, 12 epochs).

configs/dino_dinov3_l_coco.py (DINOv3's ViT-L/16 as released, ViTDet's
simple feature pyramid, the DINO-4scale transformer, ViTDet's recipe: LSJ
0.1-2.0 to 1024 x 1024, bf16 compute, AdamW lr 1e-4, layer decay 0.8,
global batch 64, EMA, per-block rematerialisation, FSDP over 8) with Mask
DINO's instance settings (`configs/common.py` mask_dino_coco). A ViT has no
stride-4 features: the mask branch brings its stride-16 map to stride 4 by
ViTDet's two transposed convolutions (as its pyramid's P2) before adding
the encoder's finest level.

Memory: by `detector.plan` on 8 and 64 devices in docs/detectors.md,
against Mask DINO Swin-L's ~60 GB per GPU at batch 2. Variants as
configs/dino_dinov3_l_coco.py's (`:frozen`, `:lora`):
  python -m detector.train --config=configs/mask_dino_dinov3_l_coco.py --workdir=DIR \\
      --config.dataset.train_json=... --config.dataset.train_images=... \\
      --config.dataset.eval_json=... --config.dataset.eval_images=... \\
      --config.model.backbone.pretrained=dinov3_l.npz
"""

import ml_collections

from configs import common


def get_config(variant: str = "full") -> ml_collections.ConfigDict:
    """`variant`: how the backbone trains, 'full', 'frozen' or 'lora' (model.backbone.training)."""
    backbone = common.dinov3_backbone(1024, 24, 16, training=variant)
    return common.mask_dino_coco(common.dino_vit_coco(backbone, layer_decay=0.8))
