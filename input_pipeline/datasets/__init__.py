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

from __future__ import annotations

import importlib

# Public name -> (module, attribute). Loaded on first use: conversion worker
# processes import single modules of this package (coco_images, split_writer)
# and must not pay for TensorFlow, TFDS and JAX, which splits.py loads.
_EXPORTS = {
    "COCO_CATEGORY_IDS": ("input_pipeline.datasets.categories", "COCO_CATEGORY_IDS"),
    "COCO_CLASS_NAMES": ("input_pipeline.datasets.categories", "COCO_CLASS_NAMES"),
    "DEFAULT_DATA_DIR": ("input_pipeline.datasets.locations", "DEFAULT_DATA_DIR"),
    "DatasetError": ("input_pipeline.dataset_errors", "DatasetError"),
    "DatasetInfo": ("input_pipeline.datasets.dataset_info", "DatasetInfo"),
    "EVAL": ("input_pipeline.datasets.registry", "EVAL"),
    "KNOWN_DATASETS": ("input_pipeline.datasets.registry", "KNOWN_DATASETS"),
    "TRAIN": ("input_pipeline.datasets.registry", "TRAIN"),
    "VOC_CLASS_NAMES": ("input_pipeline.datasets.categories", "VOC_CLASS_NAMES"),
    "class_names": ("input_pipeline.datasets.registry", "class_names"),
    "coco_json_paths": ("input_pipeline.datasets.locations", "coco_json_paths"),
    "configure_tf": ("input_pipeline.datasets.splits", "configure_tf"),
    "eval_ground_truth": ("input_pipeline.datasets.ground_truth", "eval_ground_truth"),
    "eval_ground_truth_columns": ("input_pipeline.datasets.ground_truth", "eval_ground_truth_columns"),
    "get_builder": ("input_pipeline.datasets.tfds_builders", "get_builder"),
    "get_dataset_info": ("input_pipeline.datasets.dataset_info", "get_dataset_info"),
    "prepare_split": ("input_pipeline.datasets.splits", "prepare_split"),
    "resolve_data_dir": ("input_pipeline.datasets.locations", "resolve_data_dir"),
}
_SUBMODULES = ("cache", "coco_json", "synthetic_shapes", "tfds_source")

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str):
    if name.startswith("__"):  # Probes such as __wrapped__ are no submodules.
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _EXPORTS:
        module, attribute = _EXPORTS[name]
        value = getattr(importlib.import_module(module), attribute)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
