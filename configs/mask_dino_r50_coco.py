"""Mask DINO ResNet-50 on COCO 2017 instance segmentation: Mask DINO's 50-epoch R50 recipe (46.3 mask AP).

configs/dino_r50_coco.py's DINO-4scale model (ResNet-50 C3-C5 plus one
stride-2 level, 6-layer deformable encoder) with Mask DINO's instance
settings (`configs/common.py` mask_dino_coco): the mask branch at stride 4
(the ResNet's C2 plus the encoder's finest level, 256 wide), mask-enhanced
anchors, 300 queries, 9 decoder layers, class weight 4, mask BCE and dice
on 12,544 points. Mask DINO's R50 schedule: large-scale jitter 0.1-2.0 to
1024 x 1024, AdamW lr 1e-4 (backbone x0.1), weight decay 0.05, global batch
16 for 368,750 steps (50 epochs) with x0.1 steps at 327,778 and 355,092.

Memory: batch 2 per device (8 devices), by `detector.plan` in
docs/detectors.md, against Mask DINO's ~15 GB per GPU.

The data is a COCO-format folder (TFDS's coco/2017 has no masks); the
weights one offline conversion of torchvision's ResNet-50:
  python -m detector.convert_pretrained --input=resnet50-0676ba61.pth --output=resnet50.npz
  python -m detector.train --config=configs/mask_dino_r50_coco.py --workdir=DIR \\
      --config.dataset.train_json=COCO/annotations/instances_train2017.json \\
      --config.dataset.train_images=COCO/train2017 \\
      --config.dataset.eval_json=COCO/annotations/instances_val2017.json \\
      --config.dataset.eval_images=COCO/val2017 \\
      --config.model.backbone.pretrained=resnet50.npz
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
    config = common.mask_dino_coco(common.dino_r50_coco())
    config.input.scale_jitter = (0.1, 2.0)
    config.optimizer.weight_decay = 0.05
    config.optimizer.decay_boundaries = (327_778, 355_092)
    config.total_steps = 368_750
    return config
