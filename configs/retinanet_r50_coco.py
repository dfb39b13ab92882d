"""RetinaNet ResNet-50-FPN on COCO 2017, 1x schedule (the detectron2/torchvision recipe).

90k steps at global batch 16, SGD momentum 0.9, lr 0.01 with a 1k-step
linear warmup and x0.1 steps at 60k and 80k, weight decay 1e-4; focal loss
(alpha 0.25, gamma 2), anchors 4x stride with 3 scales x 3 ratios on P3-P7.
Inputs are padded to a static 1024x1024 (XLA needs static shapes) with
flip and mild scale jitter. GroupNorm replaces frozen BatchNorm, since the
backbone here trains from scratch unless pretrained weights are loaded; to
fine-tune torchvision's ImageNet ResNet-50 as detectron2 does, add
`--config.model.backbone.norm=frozen_bn --config.model.backbone.freeze_stages=2
--config.model.backbone.pretrained=resnet50_backbone.npz` (from
`python -m detector.convert_pretrained`).

python -m detector.train --config=configs/retinanet_r50_coco.py --workdir=DIR \
    --config.dataset.data_dir=TFDS_DIR
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
    # Dataset, 1024 px inputs, neck, head, anchors: common.coco_2017.
    config = common.coco_2017(common.base_config())

    config.input.scale_jitter = (0.8, 1.25)

    config.model.backbone = common.resnet_backbone((3, 4, 6, 3), 64, "bottleneck")

    config.loss.box_loss = "huber"
    config.loss.huber_delta = 0.1

    config.optimizer.name = "sgd"
    config.optimizer.learning_rate = 0.01
    config.optimizer.schedule = "step"
    config.optimizer.decay_boundaries = (60_000, 80_000)
    config.optimizer.warmup_steps = 1000
    config.optimizer.grad_clip_norm = 0.0

    config.global_batch_size = 16
    config.eval_batch_size = 16
    config.total_steps = 90_000
    config.checkpoint_every_steps = 5_000
    return config
