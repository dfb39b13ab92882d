"""Runs a trained detector on your own images: COCO-results JSON and a picture per image.

  python -m detector.predict --config=configs/default.py --workdir=runs/default \
      photos/ extra.png --output=predictions [--checkpoint=best] [--score_threshold=0.3]

Images of any size and any format Pillow reads (JPEG, PNG, BMP, GIF, TIFF,
WebP; EXIF rotation applied) are resized and padded exactly as evaluation
does, predicted in batches sharded over the devices, and written to OUTPUT:
  detections.json  COCO results: [{image_id, category_id, bbox [x, y, w, h] in
                   original pixels, score}]; a mask model's (Mask DINO) also
                   `segmentation`, the mask as COCO compressed RLE
                   ({size: [h, w], counts}), and Mask DINO's instance score
  images.json      COCO images: [{id, file_name, width, height}] (ids as above)
  NAME.png         each image with its boxes, class names and scores drawn
                   (and masks, filled translucent in their box's colour)
                   (NAME_ID.png where two inputs share a name)
A file that cannot be read is skipped with a warning and counted.
"""

from __future__ import annotations

from absl import flags

from detector import cli
from detector.errors import ConfigError
from detector.serving.predictor import load_predictor, predict_images
from sharding import distributed

_CONFIG, _WORKDIR, _CHECKPOINT, _RAW_PARAMS = cli.define_trained_run_flags()
_OUTPUT = flags.DEFINE_string("output", None, "Directory for detections.json, images.json and the pictures.")
_SCORE_THRESHOLD = flags.DEFINE_float("score_threshold", 0.3, "Detections scoring less are dropped.")
_MAX_DETECTIONS = flags.DEFINE_integer(
    "max_detections", None, "Detections per image at most (default: the config's postprocess.max_detections)."
)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None, "Images per global batch (default: eval_batch_size).")
flags.mark_flag_as_required("output")
distributed.define_flags()


def main(argv: list[str]) -> None:
    inputs = argv[1:]
    if not inputs:
        raise ConfigError(
            "no images given: pass image files or folders after the flags, e.g. "
            "python -m detector.predict --config=... --workdir=... --output=OUT photos/"
        )
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
    predict_images(predictor, inputs, _OUTPUT.value)


if __name__ == "__main__":
    cli.run(main)
