"""Trains and evaluates the detector on a device mesh.

  python -m detector.train --config=configs/default.py --workdir=runs/default
  python -m detector.train --config=configs/default.py --workdir=DIR \
      --config.mesh.data=4 --config.mesh.model=2 --config.global_batch_size=32

The same code runs on one CPU, one GPU, or many hosts: the config's mesh and
batch size decide how the work is split. Running the same command again in a
workdir that holds a checkpoint resumes from it.
"""

from __future__ import annotations

from absl import flags, logging
from ml_collections import config_flags

from detector import cli
from detector.loop.trainer import train_and_evaluate
from sharding import distributed

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (get_config()).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and logs.")
flags.mark_flags_as_required(["config", "workdir"])
distributed.define_flags()


def main(argv: list[str]) -> None:
    cli.start(argv)
    logging.info("%s", distributed.describe())
    train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
    cli.run(main)
