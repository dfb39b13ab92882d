"""Dataset registry: config.dataset -> prepared, random-access splits.

Known datasets (`config.dataset.name`):
  synthetic_shapes  generated locally on first use (input_pipeline/datasets/
                    synthetic_shapes.py); the default, needs no download.
  coco_json         a COCO-format folder: `dataset.train_json` /
                    `dataset.train_images` and `dataset.eval_json` /
                    `dataset.eval_images` (instances JSON + image root), the
                    format custom data comes in.
  coco/2017         TFDS `coco/2017`, already prepared in the data dir
                    (`tfds build coco/2017 --data_dir=DIR`).
  voc/2007, voc/2012  TFDS Pascal VOC, already prepared likewise; `difficult`
                    objects are regions to ignore, like COCO crowds.

Every split is converted once into a prepared split (records + index, see
cache.py) under `dataset.cache_dir` (default DATA_DIR/prepared); later runs
and every host reuse it. Conversion counts bad records; a source where most
images are unusable stops with a DatasetError.

Data dir: `config.dataset.data_dir`, or when None `$DETECTOR_DATA_DIR`, or
`~/.cache/detector/datasets`.

Modules: registry (names -> sources, class names), categories (COCO / VOC
tables), locations (data dir, cache dir, COCO folder paths), fingerprint
(source identity), tfds_builders, splits (prepare_split), dataset_info,
ground_truth; the sources coco_json, tfds_source, synthetic_shapes and their
box_checks; cache (the prepared-split format).
"""

from input_pipeline.dataset_errors import DatasetError
from input_pipeline.datasets import cache, coco_json, synthetic_shapes, tfds_source
from input_pipeline.datasets.categories import COCO_CATEGORY_IDS, COCO_CLASS_NAMES, VOC_CLASS_NAMES
from input_pipeline.datasets.dataset_info import DatasetInfo, get_dataset_info
from input_pipeline.datasets.ground_truth import eval_ground_truth
from input_pipeline.datasets.locations import DEFAULT_DATA_DIR, coco_json_paths, resolve_data_dir
from input_pipeline.datasets.registry import EVAL, KNOWN_DATASETS, TRAIN, class_names
from input_pipeline.datasets.splits import configure_tf, prepare_split
from input_pipeline.datasets.tfds_builders import get_builder

__all__ = [
    "COCO_CATEGORY_IDS",
    "COCO_CLASS_NAMES",
    "DEFAULT_DATA_DIR",
    "DatasetError",
    "DatasetInfo",
    "EVAL",
    "KNOWN_DATASETS",
    "TRAIN",
    "VOC_CLASS_NAMES",
    "cache",
    "class_names",
    "coco_json",
    "coco_json_paths",
    "configure_tf",
    "eval_ground_truth",
    "get_builder",
    "get_dataset_info",
    "prepare_split",
    "resolve_data_dir",
    "synthetic_shapes",
    "tfds_source",
]
