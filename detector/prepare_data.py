"""Converts a config's dataset before training and prints what the conversion found.

  python -m detector.prepare_data --config=configs/retinanet_r50_coco.py \
      --config.dataset.name=coco_json \
      --config.dataset.train_json=DATA/annotations/instances_train.json \
      --config.dataset.train_images=DATA/train \
      --config.dataset.eval_json=DATA/annotations/instances_val.json \
      --config.dataset.eval_images=DATA/val

Training converts on first use as well; converting ahead of a multi-host
launch means no host waits for it, and shows the bad-record counts before
any accelerator time is spent.
"""

from __future__ import annotations

from absl import flags
from ml_collections import config_flags

import input_pipeline
from detector import cli
from detector.errors import ConfigError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (get_config()).", lock_config=True)
flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise ConfigError(f"unexpected arguments: {' '.join(argv[1:])}; pass options as --flag=value")
    config = _CONFIG.value
    splits = {which: input_pipeline.prepare_split(config, which) for which in ("train", "eval")}
    print(f"dataset {config.dataset.name}: {len(splits['train'].class_names)} classes\n")
    print(input_pipeline.format_counts(splits))


if __name__ == "__main__":
    cli.run(main)
