"""The tiny DINO of configs/dino_tiny.py on a tiny DINOv3-style ViT: the 7B recipe's architecture on a laptop CPU.

The backbone has every part of configs/dino_dinov3_7b_coco.py's ViT at
width 64 (4 heads of 16) and depth 4: SwiGLU MLP, LayerScale, a class token
and 4 registers (kept out of the feature map), 2-D rotary position
embeddings, no qkv bias, global attention in every block; its stride-16 map
(8x8 tokens at 128 px) goes through the simple feature pyramid. Randomly
initialised (no DINOv3 weights this small exist), so it learns less than
dino_tiny's ResNet in the same time: it is the end-to-end check of the
foundation-backbone path (train, evaluate, predict, export) and of the three
ways to train a backbone, chosen by the config argument:

  python -m detector.train --config=configs/dino_dinov3_tiny.py --workdir=runs/dinov3_tiny
  python -m detector.train --config=configs/dino_dinov3_tiny.py:lora --workdir=runs/dinov3_tiny_lora
"""

import ml_collections

from configs import common


def get_config(variant: str = "full") -> ml_collections.ConfigDict:
    """`variant`: how the backbone trains, 'full', 'frozen' or 'lora' (model.backbone.training)."""
    config = common.tiny_dino()
    config.model.backbone = common.dinov3_backbone(64, 4, 4, mlp="swiglu", mlp_hidden=128, training=variant)
    config.optimizer.learning_rate = 1e-3
    config.optimizer.weight_decay = 0.05
    return config
