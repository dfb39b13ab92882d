"""DINO-4scale ResNet-50 on COCO 2017, 12 epochs (the DINO paper's 49.0 AP recipe, detrex's 49.2).

The model: ResNet-50 C3-C5 plus one stride-2 level (4 scales, 256 channels
each), a 6-layer deformable encoder and 6-layer decoder (8 heads, FFN 2048,
4 points per head and level), two-stage mixed query selection with 900
queries, contrastive denoising (DINO's 100 positive-negative pairs per
image: 100 // n groups for an image's n boxes, in 200 query slots),
Hungarian matching on the device (focal 2, L1 5, GIoU 2) and set losses
(focal 1, L1 5, GIoU 2) on every decoder layer, the encoder proposals and
the denoising groups, top-100 over queries x classes at test
time without NMS.

The recipe: AdamW lr 1e-4, weight decay 1e-4, gradient clipping at 0.1,
backbone at x0.1, global batch 16 for 12 epochs (88,700 steps) with a x0.1
step at epoch 11; inputs padded to a static 1024x1024 with flips and scale
jitter (the paper's multi-scale 480-800 px resize is a dynamic shape).

Training options this recipe leaves at DINO's until measured on COCO (each
lost AP per wall second on the tiny DINO, see configs/dino_tiny.py): H-DETR's
one-to-many branch (`--config.model.dino.one_to_many_queries=1500`, 6
repeats: +1.5-2.5 AP at 12 epochs in its paper), DEIM's mosaics
(`--config.input.mosaic_probability=0.5`) and quality-aware class losses
(`--config.loss.set_prediction.class_loss=mal` or `varifocal`).

DINO fine-tunes ImageNet weights with frozen BatchNorm and a frozen stem and
first stage (detectron2's FREEZE_AT=2); the recipe does, and the weights come
from one offline conversion of torchvision's ResNet-50:

  python -m detector.convert_pretrained --input=resnet50-0676ba61.pth --output=resnet50.npz
  python -m detector.train --config=configs/dino_r50_coco.py --workdir=DIR \
      --config.dataset.data_dir=TFDS_DIR --config.model.backbone.pretrained=resnet50.npz
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
    return common.dino_r50_coco()
