"""Tiny RetinaNet on the embedded synthetic-shapes dataset: trains on a laptop CPU.

The base config of configs/common.py as it is: every default there is
chosen for this recipe (a ResNet with one basic block per stage at width 16,
128 px images, AdamW with a cosine schedule for 1500 steps at batch 16).

python -m detector.train --config=configs/default.py --workdir=runs/default
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
    return common.base_config()
