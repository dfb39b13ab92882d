"""A tiny DINO on the embedded synthetic-shapes dataset: trains on a laptop CPU.

The same model as configs/dino_r50_coco.py (4-scale deformable encoder and
decoder, two-stage query selection, contrastive denoising, Hungarian-matched
set losses, top-k without NMS) at a size that trains in minutes on a CPU:
the default config's ResNet (one basic block per stage, width 16) at 128 px,
a 64-wide transformer with 2 encoder and 3 decoder layers and 100 queries,
AdamW at 2e-3 (1e-3 and a 32-wide transformer both reached less AP in the
same time).

4 images per step for 2000 steps: on this dataset the tiny DINO learns more
per update than per image, and its step costs about its batch (99 ms at 4
images, 189 at 8, 365 at 16 on a 2-core Intel Xeon). One sitting there,
`python -m benchmarks.ap_vs_time --configs=dino_tiny --override=...`, AP at
the last step (3 or 4 evaluations a run) and wall seconds: 16 x 600 steps
0.428 at 296 s; 8 x 1200 0.507 at 287 s; 4 x 2400 0.560 at 314 s; 2 x 4000
0.460 at 316 s (31 images/s); 4 x 2400 with 50 queries and 16 denoising
pairs 0.513 at 270 s; 4 x 2000 with 2 decoder layers 0.448 at 239 s.
`--configs=default,dino_tiny` in the same sitting: this config (4 x 2000)
0.512 at 277 s, the default RetinaNet 0.545 at 230 s (its programs loaded
from an earlier run's compilation cache, about 7 s less than compiling
them).

Its class loss is DEIM's matchability-aware loss (`loss.set_prediction.
class_loss="mal"`): `python -m benchmarks.ap_vs_time --configs=dino_tiny
--override=loss.set_prediction.class_loss=X`, one sitting on a 2-core CPU,
AP at step 600 of 16 images: focal (DINO's) 0.322, varifocal 0.401, mal
0.448.

H-DETR's one-to-many branch and DEIM's mosaics stay off: on this dataset
each cost AP and wall time (one sitting, 16 images a step, AP at the last
step and wall seconds: off 0.448 at 308 s; one_to_many_queries=200 x 6
repeats 0.108 at step 250 and stopped by the 420 s budget at step 451; 64 x
4 repeats 0.384 at 420 s; mosaic_probability=0.5 for the first half 0.396 at
333 s).

python -m detector.train --config=configs/dino_tiny.py --workdir=runs/dino_tiny
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
    config = common.tiny_dino()
    # More updates of fewer images each, in the same wall time: DETR-style set
    # prediction learns per update more than per image here (see above).
    config.global_batch_size = 4
    config.total_steps = 2000
    config.optimizer.warmup_steps = 300
    config.eval_every_steps = 500
    config.checkpoint_every_steps = 500
    return config
