"""A tiny DINO on the embedded synthetic-shapes dataset: trains on a laptop CPU.

The same model as configs/dino_r50_coco.py (4-scale deformable encoder and
decoder, two-stage query selection, contrastive denoising, Hungarian-matched
set losses, top-k without NMS) at a size that trains in minutes on a CPU:
the default config's ResNet (one basic block per stage, width 16) at 128 px,
a 64-wide transformer with 2 encoder and 3 decoder layers and 100 queries,
AdamW at 2e-3 (1e-3 and a 32-wide transformer both reached less AP in the
same time) for 600 steps, about the default config's wall time.

Its class loss is DEIM's matchability-aware loss (`loss.set_prediction.
class_loss="mal"`): `python -m benchmarks.ap_vs_time --configs=dino_tiny
--override=loss.set_prediction.class_loss=X`, one sitting on a 2-core CPU,
AP at step 600: focal (DINO's) 0.322, varifocal 0.401, mal 0.448.

H-DETR's one-to-many branch and DEIM's mosaics stay off: on this dataset
each cost AP and wall time (one sitting, AP at the last step and wall
seconds: off 0.448 at 308 s; one_to_many_queries=200 x 6 repeats 0.108 at
step 250 and stopped by the 420 s budget at step 451; 64 x 4 repeats 0.384
at 420 s; mosaic_probability=0.5 for the first half 0.396 at 333 s).

python -m detector.train --config=configs/dino_tiny.py --workdir=runs/dino_tiny
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
    return common.tiny_dino()
