"""DINO on the DINOv3 ViT-7B/16 backbone on COCO 2017 (1024 px LSJ): full fine-tuning, frozen or LoRA.

The backbone is DINOv3's 7B ViT as released (Simeoni et al. 2025): width
4096, 40 blocks, 32 heads of 128, SwiGLU MLP of 8192 hidden units,
LayerScale, a class token and 4 registers, 2-D rotary position embeddings
(temperature 100), no qkv bias, LayerNorm eps 1e-5, global attention in
every block: 6.7 B parameters. Its stride-16 map (64x64 tokens at 1024 px)
goes through the simple feature pyramid into the DINO-4scale transformer of
configs/dino_r50_coco.py; the rest is configs/dino_dinov3_l_coco.py's recipe
(LSJ 1024, bf16 compute, float32 parameters, AdamW, EMA, global batch 64,
12 epochs).

Three ways to train it, one key (`model.backbone.training`), chosen with the
config argument:

  full    (default) every weight trained, layer-wise decay 0.9: 6.7 B float32
          parameters, their AdamW moments, gradients and the EMA are 134 GB
          before activations, so the run shards parameters over `fsdp`, splits
          heads and the MLP over `model` (the Megatron layout: 2 all-reduces
          per block) and rematerialises every block: mesh (data 8, fsdp 4,
          model 2) on 64 GPUs of 80 GB, 31.7 GB per device by `detector.plan`
          (8 GPUs would need 118 GB each).
  frozen  the 7B gets no gradient, optimizer state or EMA copy, and keeps no
          activations for backward: 8 GPUs of 80 GB, its weights sharded over
          fsdp 8, 40.1 GB per device (DINOv3's own detector keeps the 7B
          frozen).
  lora    rank-16 adapters on qkv, the out-projection and both MLP matrices
          (37 M, 0.55% of the backbone's parameters) trained with the detector,
          merged into the weights on export: 8 GPUs of 80 GB with 2
          micro-batches per step (40.9 GB per device; 74.7 GB in one pass).

The plans of these and of other meshes: docs/sharding.md.

  python -m detector.plan --config=configs/dino_dinov3_7b_coco.py --devices=64
  python -m detector.plan --config=configs/dino_dinov3_7b_coco.py:frozen --devices=8
  python -m detector.convert_pretrained --input=dinov3_vit7b16.safetensors --output=dinov3_7b.npz
  python -m detector.train --config=configs/dino_dinov3_7b_coco.py:lora --workdir=DIR \
      --config.dataset.data_dir=TFDS_DIR --config.model.backbone.pretrained=dinov3_7b.npz
"""

import ml_collections

from configs import common

# Devices each variant is planned for (docs/sharding.md).
DEVICES = {"full": 64, "frozen": 8, "lora": 8}


def get_config(variant: str = "full") -> ml_collections.ConfigDict:
    """`variant`: how the backbone trains, 'full', 'frozen' or 'lora' (model.backbone.training)."""
    backbone = common.dinov3_backbone(4096, 40, 32, mlp="swiglu", mlp_hidden=8192, training=variant)
    config = common.dino_vit_coco(backbone, layer_decay=0.9)
    if variant == "full":
        config.mesh.fsdp, config.mesh.model = 4, 2  # data: the rest (8 of 64 devices)
    if variant == "lora":
        # Backward through the 7B for 8 images per device: 2 micro-batches of 4
        # keep the attention temporaries of one block within memory.
        config.optimizer.accumulate_steps = 2
    return config
