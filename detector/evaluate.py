"""Evaluates a trained workdir on its config's eval split: the COCO table and per-class AP.

  python -m detector.evaluate --config=configs/default.py --workdir=runs/default
  python -m detector.evaluate --config=... --workdir=DIR --checkpoint=best    # or last, or a step

Evaluation is sharded like training (the config's mesh; several processes
join as for training). Process 0 prints the COCO metrics and a per-class
table and writes, under `--output` (default `WORKDIR/evaluation/STEP`):
  metrics.json     the COCO metrics, per-class AP/AP50/AP75 and instance counts
  detections.json  the detections in COCO results format (original pixels,
                   the dataset's category ids), to score again with pycocotools
"""

from __future__ import annotations

from absl import flags

from detector import cli
from detector.serving.predictor import evaluate_workdir
from sharding import distributed

_CONFIG, _WORKDIR, _CHECKPOINT, _RAW_PARAMS = cli.define_trained_run_flags()
_OUTPUT = flags.DEFINE_string(
    "output", None, "Directory for metrics.json and detections.json (default WORKDIR/evaluation/STEP)."
)
distributed.define_flags()


def main(argv: list[str]) -> None:
    cli.start(argv)
    evaluate_workdir(_CONFIG.value, _WORKDIR.value, _CHECKPOINT.value, _OUTPUT.value, raw_params=_RAW_PARAMS.value)


if __name__ == "__main__":
    cli.run(main)
