"""Runs a trained detector over your images, from a folder of photos to millions of files: Parquet shards.

  python -m detector.predict --config=configs/default.py --workdir=runs/default \
      photos/ more.png list.txt --output=predictions [--checkpoint=best] [--score_threshold=0.3]
  python -m detector.predict --config=... --workdir=... --split=eval --output=eval_predictions --coco_results

Inputs: image files, folders (searched recursively) and lists of image paths
(.txt, one per line), or `--split=train|eval`: the config's prepared split.
Images of any size and any format Pillow reads (JPEG, PNG, BMP, GIF, TIFF,
WebP; EXIF rotation applied) are resized and padded exactly as evaluation
does and predicted in batches sharded over the devices; in a multi-process
launch each process reads its own rows. Each process writes its images'
detections to its own Parquet shard as it goes (one row per image: id, file,
size, boxes, scores, category ids, and masks as COCO RLE for a mask model);
OUTPUT/predictions.json indexes them at the end (see
detector/serving/bulk_prediction.py for the layout). `--coco_results` also
writes detections.json (COCO results) and images.json; the first
`--pictures` images are drawn to OUTPUT/pictures/.

Killed or stopped, the same command continues from the last committed rows:
no image is predicted twice or missed. An OUTPUT holding another run's
results (other inputs, model or thresholds) is refused. A file that cannot
be read is counted and listed (the row's `error`), never fatal.
"""

from __future__ import annotations

from absl import flags

import input_pipeline
from detector import cli
from detector.errors import ConfigError
from detector.serving import bulk_prediction, image_sources
from detector.serving.predictor import load_predictor
from sharding import distributed

_CONFIG, _WORKDIR, _CHECKPOINT, _RAW_PARAMS = cli.define_trained_run_flags()
_OUTPUT = flags.DEFINE_string(
    "output", None, "Directory of the run's shards, index and pictures: new or empty, or this run's to resume."
)
_SPLIT = flags.DEFINE_enum(
    "split", None, ["train", "eval"], "Predict the config's prepared split instead of image files (ids: the dataset's)."
)
_PICTURES = flags.DEFINE_integer(
    "pictures",
    None,
    f"Draw the first N images to OUTPUT/pictures (default: all of up to {bulk_prediction.PICTURES_ALL_UP_TO} "
    f"inputs, else the first {bulk_prediction.PICTURES_BEYOND}).",
)
_COCO_RESULTS = flags.DEFINE_bool(
    "coco_results", False, "Also write OUTPUT/detections.json (COCO results) and images.json (COCO images)."
)
_COMMIT_EVERY_S = flags.DEFINE_float(
    "commit_every_s", 60.0, "Commit each process's rows at least this often: what a kill can cost.", lower_bound=0.0
)
_SCORE_THRESHOLD = flags.DEFINE_float("score_threshold", 0.3, "Detections scoring less are dropped.")
_MAX_DETECTIONS = flags.DEFINE_integer(
    "max_detections", None, "Detections per image at most (default: the config's postprocess.max_detections)."
)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None, "Images per global batch (default: eval_batch_size).")
flags.mark_flag_as_required("output")
distributed.define_flags()


def main(argv: list[str]) -> None:
    inputs = argv[1:]
    if not inputs and _SPLIT.value is None:
        raise ConfigError(
            "no images given: pass image files, folders or lists after the flags (or --split=eval), e.g. "
            "python -m detector.predict --config=... --workdir=... --output=OUT photos/"
        )
    if inputs and _SPLIT.value is not None:
        raise ConfigError(f"--split={_SPLIT.value} and image paths ({inputs[0]}, ...): pass one or the other")
    cli.start(argv, takes_arguments=True)
    config = _CONFIG.value
    if not 0.0 <= _SCORE_THRESHOLD.value <= 1.0:
        raise ConfigError(f"--score_threshold={_SCORE_THRESHOLD.value} must be in [0, 1]")
    config.postprocess.score_threshold = _SCORE_THRESHOLD.value
    if _MAX_DETECTIONS.value is not None:
        if _MAX_DETECTIONS.value < 1:
            raise ConfigError(f"--max_detections={_MAX_DETECTIONS.value} must be at least 1")
        config.postprocess.max_detections = _MAX_DETECTIONS.value
    predictor = load_predictor(
        config, _WORKDIR.value, _CHECKPOINT.value, batch_size=_BATCH_SIZE.value, raw_params=_RAW_PARAMS.value
    )
    split_source = None
    if _SPLIT.value is not None:

        def split_source():
            return image_sources.SplitImages(input_pipeline.prepare_split(config, _SPLIT.value), _SPLIT.value)

    bulk_prediction.predict(
        predictor,
        _OUTPUT.value,
        inputs=inputs,
        split_source=split_source,
        workdir=_WORKDIR.value,
        checkpoint=_CHECKPOINT.value,
        pictures=_PICTURES.value,
        coco_results=_COCO_RESULTS.value,
        commit_every_s=_COMMIT_EVERY_S.value,
    )


if __name__ == "__main__":
    cli.run(main)
