"""ViTDet-B RetinaNet on COCO 2017: plain ViT-B/16 backbone, simple feature pyramid.

The ViTDet recipe (Li et al. 2022) with a RetinaNet head: 1024x1024 inputs
with large-scale jitter (scale 0.1-2.0, crop/pad to 1024), window attention
(14x14) with global attention in blocks 2, 5, 8, 11, absolute position
embeddings interpolated from the 224 px pretraining grid, AdamW (lr 1e-4,
weight decay 0.1) at global batch 64 for 184k steps (~100 epochs) with x0.1
steps at 88.9% and 96.3%, bf16 compute with float32 parameters.

python -m detector.train --config=configs/vitdet_b_coco.py --workdir=DIR \
    --config.dataset.data_dir=TFDS_DIR --config.mesh.fsdp=8

ViT-S (width 384, 6 heads) is the same recipe with
--config.model.backbone.embed_dim=384 --config.model.backbone.num_heads=6.
"""

import ml_collections

from configs import retinanet_r50_coco
from configs.vitdet_tiny import vit_backbone


def get_config() -> ml_collections.ConfigDict:
    config = retinanet_r50_coco.get_config()

    config.model.backbone = vit_backbone(768, 12, 12, global_attention_every=3)
    config.model.dtype = "bfloat16"
    config.model.remat = "none"
    config.model.fpn_features = 256
    config.model.head_convs = 4
    config.model.head_features = 256

    config.input.image_size = (1024, 1024)
    config.input.scale_jitter = (0.1, 2.0)
    config.loss.box_loss = "giou"

    config.optimizer.name = "adamw"
    config.optimizer.learning_rate = 1e-4
    config.optimizer.weight_decay = 0.1
    config.optimizer.schedule = "step"
    config.optimizer.warmup_steps = 250
    config.optimizer.decay_boundaries = (163_889, 177_546)
    config.optimizer.grad_clip_norm = 0.0

    config.global_batch_size = 64
    config.eval_batch_size = 64
    config.total_steps = 184_375
    config.eval_every_steps = 10_000
    config.checkpoint_every_steps = 2_500
    return config
