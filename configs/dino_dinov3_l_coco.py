"""DINO on a DINOv3 ViT-L/16 backbone with the simple feature pyramid on COCO 2017 (1024 px LSJ).

The backbone is DINOv3's ViT-L/16 as released (Simeoni et al. 2025): width
1024, 24 blocks, 16 heads, GELU MLP x4, LayerScale, a class token and 4
register tokens (kept out of the feature map), 2-D rotary position
embeddings (temperature 100, coordinates normalised to [-1, 1], so any
input size needs no resizing), no qkv bias, LayerNorm eps 1e-5, global
attention in every block as in pretraining. Its stride-16 map goes through
ViTDet's simple feature pyramid (4 levels, strides 8-64, 256 channels) into
the DINO-4scale transformer of configs/dino_r50_coco.py. Everything else is
the ViTDet recipe (configs/common.py vitdet_coco): large-scale jitter
0.1-2.0 to 1024x1024, bf16 compute with float32 parameters, AdamW lr 1e-4,
weight decay 0.1, global batch 64, 12 epochs with a x0.1 step at epoch 11,
and an EMA of the parameters. The backbone is fine-tuned in full with
ViTDet's layer-wise decay 0.8 (block i at 0.8 ** (24 - i)); per-block
rematerialisation keeps the 4,101-token global attention of 24 blocks
within memory.

Memory: 0.30 B backbone parameters + the DINO head; by `detector.plan` on
64 devices see docs/sharding.md. One-key variants: `frozen` (the backbone
gets no gradient and no optimizer state) and `lora` (rank-16 adapters):

  python -m detector.train --config=configs/dino_dinov3_l_coco.py:frozen ...

Weights: timm's vit_large_patch16_dinov3 or transformers' DINOv3ViTModel
state dict, converted once (nothing is downloaded):

  python -m detector.convert_pretrained --input=dinov3_vitl16.safetensors --output=dinov3_l.npz
  python -m detector.train --config=configs/dino_dinov3_l_coco.py --workdir=DIR \
      --config.dataset.data_dir=TFDS_DIR --config.model.backbone.pretrained=dinov3_l.npz
"""

import ml_collections

from configs import common


def get_config(variant: str = "full") -> ml_collections.ConfigDict:
    """`variant`: how the backbone trains, 'full', 'frozen' or 'lora' (model.backbone.training)."""
    return common.dino_vit_coco(common.dinov3_backbone(1024, 24, 16, training=variant), layer_decay=0.8)
