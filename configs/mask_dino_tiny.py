"""A tiny Mask DINO on the embedded synthetic-shapes dataset: boxes and instance masks on a laptop CPU.

configs/dino_tiny.py with Mask DINO's branch (`model.dino.mask_dim`): a
pixel embedding at stride 4 (the ResNet's stride-4 map plus the encoder's
finest level) and each query's mask embedding, 32 wide; masks in the
training batches at `input.mask_stride` 4 (32 x 32 cells at 128 px); the
mask terms of matching and loss on 256 points per mask, a quarter of the
map's cells (Mask DINO's 12,544 points are a fifth of a 1024 px image's
256 x 256). Evaluation reports mask AP (`mask_AP`, ...) beside box AP and
keeps the checkpoint with the best mask AP.

The masks' ceiling on this data (`python -m benchmarks.mask_ceiling`: the
ground-truth masks taken down to stride 4 and pasted back up as the
predictor pastes) is the bar its mask AP is measured against; half the
shapes are outlines 2-3 px wide, which a stride-4 mask cannot draw.

python -m detector.train --config=configs/mask_dino_tiny.py --workdir=runs/mask_dino_tiny
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
    config = common.dino_tiny()
    config.model.dino.mask_dim = 32
    config.input.mask_stride = 4
    config.loss.set_prediction.mask_points = 256
    config.best_metric = "mask_AP"
    # Mask terms at 1 instead of Mask DINO's 5 in loss and matching: in this
    # small network they compete with the boxes for the shared features. 800
    # steps, one sitting (box AP / mask AP): at 5, 0.009 / 0.025; at 1, 0.063 /
    # 0.055; without masks, box AP 0.395 (and 0.327 / 0.011 with the masks' gradient
    # kept out of the trunk).
    config.loss.set_prediction.mask_weight = 1.0
    config.loss.set_prediction.dice_weight = 1.0
    config.loss.set_prediction.match_mask_weight = 1.0
    config.loss.set_prediction.match_dice_weight = 1.0
    # The mask branch costs about a third more per step than dino_tiny's (130
    # against 100 ms at 4 images on a 2-core AMD EPYC): 4800 steps and four
    # evaluations take about 13 minutes. Box / mask AP by step, one sitting:
    # 0.447 / 0.121 at 2400, 0.572 / 0.179 at 3600, 0.606 / 0.181 at 4800
    # (3200 steps: 0.489 / 0.155).
    config.total_steps = 4800
    config.optimizer.warmup_steps = 400
    config.eval_every_steps = 1200
    config.checkpoint_every_steps = 1200
    return config
