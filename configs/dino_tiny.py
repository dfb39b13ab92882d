"""A tiny DINO on the embedded synthetic-shapes dataset: trains on a laptop CPU.

The same model as configs/dino_r50_coco.py (deformable encoder and decoder,
two-stage query selection, contrastive denoising, Hungarian-matched set
losses) at a size that trains in minutes on a CPU: the default config's
ResNet (one basic block per stage, width 16) at 128 px, a 64-wide
transformer with 1 encoder and 3 decoder layers, 2 sampling points per head
and level, 100 queries, AdamW at 2e-3 (1e-3 and a 32-wide transformer both
reached less AP in the same time), 4 images a step for 2160 steps.

It reaches more AP than the default RetinaNet in less time on a 2-core CPU
(`python -m benchmarks.ap_vs_time --configs=default,dino_tiny`; see
docs/performance.md). Each choice, measured with `--configs=dino_tiny
--override=...` on a 2-core Intel Xeon (AP at the last step, wall seconds
from the command's start):

- 4 images a step: the step costs about its batch (99 ms at 4 images, 189
  at 8, 365 at 16) and DINO learns more per update than per image. 16 x 600
  steps 0.428 at 296 s; 8 x 1200 0.507 at 287 s; 4 x 2400 0.560 at 314 s;
  2 x 4000 0.460 at 316 s.
- NMS at 0.7 on the predictions (`postprocess.query_nms_iou_threshold`):
  a DINO trained for minutes still predicts duplicates. The 4 x 2000 run's
  last checkpoint: 0.512 without, 0.580 with (0.576 at 0.5).
- DDQ's distinct queries (`model.dino.distinct_query_iou=0.8`): 4 x 2000,
  0.512 -> 0.535 (0.580 -> 0.596 with NMS); in this recipe 0.554 at 219 s
  without, 0.567 at 230 s with.
- 1 encoder layer and 2 points (`encoder_layers`, `num_points`): the step
  86 and 90 ms instead of 98 each, together 20% fewer seconds a step; with
  NMS and distinct queries, 4 x 1700 steps with 2 layers and 4 points
  reached 0.536 at 253 s, 4 x 1900 with 1 and 2 0.515 at 208 s, 4 x 2160
  0.567 at 230 s.

DEIM's matchability-aware class loss (`loss.set_prediction.class_loss=
"mal"`, from configs/common.py): one sitting on a 2-core CPU, AP at step
600 of 16 images: focal (DINO's) 0.322, varifocal 0.401, mal 0.448.
H-DETR's one-to-many branch and DEIM's mosaics stay off: on this dataset
each cost AP and wall time (16 images a step, AP at the last step and wall
seconds: off 0.448 at 308 s; one_to_many_queries=200 x 6 repeats 0.108 at
step 250 and stopped by the 420 s budget at step 451; 64 x 4 repeats 0.384
at 420 s; mosaic_probability=0.5 for the first half 0.396 at 333 s).

python -m detector.train --config=configs/dino_tiny.py --workdir=runs/dino_tiny
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
    return common.dino_tiny()
