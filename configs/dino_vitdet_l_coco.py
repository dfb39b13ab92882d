"""DINO with a ViT-L backbone and the simple feature pyramid on COCO 2017 (ViTDet-style, 1024 px LSJ).

The DINO-4scale transformer of configs/dino_r50_coco.py on ViTDet's plain
ViT-L/16 (width 1024, 24 blocks, 16 heads, 14x14 windows with global
attention in every 6th block) whose stride-16 map the simple feature pyramid
turns into 4 levels (strides 8-64, 256 channels). Large-scale jitter (scale
0.1-2.0, crop/pad to 1024x1024), bf16 compute with float32 parameters,
AdamW lr 1e-4 with weight decay 0.1 (ViTDet's) and gradient clipping at
0.1, backbone at x0.1, an EMA of the parameters (decay 0.9999) for
evaluation, global batch 64 for 12 epochs (22,200 steps) with a x0.1 step
at epoch 11, and per-block rematerialisation (by `detector.plan` on 64
devices, mesh (8, 8, 1): 7.0 GB per device, 19.0 GB without it, for 26% more
FLOPs).

It starts from MAE's ViT-L weights, converted once (see
configs/common.py's `vitdet_coco`):

  python -m detector.convert_pretrained --input=mae_pretrain_vit_large.pth --output=vit_l_mae.npz
  python -m detector.plan --config=configs/dino_vitdet_l_coco.py --devices=64
  python -m detector.train --config=configs/dino_vitdet_l_coco.py --workdir=DIR \
      --config.dataset.data_dir=TFDS_DIR --config.model.backbone.pretrained=vit_l_mae.npz
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
    # ~0.34 B parameters with AdamW moments and the EMA: FSDP over 8 (common.dino_vit_coco).
    backbone = common.vit_backbone(1024, 24, 16, global_attention_every=6)
    return common.dino_vit_coco(backbone, backbone_lr_multiplier=0.1)
