"""The datasets `config.dataset.name` may name, and where each one's data comes from.

synthetic_shapes  generated locally on first use (synthetic_shapes.py).
coco_json         a COCO-format folder (instances JSON + image root per split).
coco/2017         TFDS, already prepared in the data dir.
voc/2007, voc/2012  TFDS Pascal VOC, likewise; `difficult` objects are
                  regions to ignore, like COCO crowds.
"""

from __future__ import annotations

import dataclasses

from input_pipeline.dataset_errors import DatasetError
from input_pipeline.datasets import coco_json, tfds_source
from input_pipeline.datasets import synthetic_shapes as ss
from input_pipeline.datasets.categories import COCO_CATEGORY_IDS, COCO_CLASS_NAMES, VOC_CLASS_NAMES
from input_pipeline.datasets.locations import coco_json_paths

KNOWN_DATASETS = ("synthetic_shapes", "coco_json", "coco/2017", "voc/2007", "voc/2012")
# The two splits of every dataset, as prepare_split and coco_json_paths name them.
TRAIN, EVAL = "train", "eval"


@dataclasses.dataclass(frozen=True)
class TfdsEntry:
    """A TFDS dataset: its labels' names and COCO category ids, and how its examples are laid out."""

    class_names: tuple[str, ...]
    category_ids: tuple[int, ...]
    layout: tfds_source.TfdsLayout


TFDS_DATASETS = {
    "synthetic_shapes": TfdsEntry(
        class_names=tuple(ss.CLASS_NAMES),
        # COCO-format files need ids; 0 is avoided as it is no valid COCO id.
        category_ids=tuple(range(1, len(ss.CLASS_NAMES) + 1)),
        layout=tfds_source.TfdsLayout(image_id_key="image/id", ignore_key=None, mask_key="rle"),
    ),
    "coco/2017": TfdsEntry(
        class_names=COCO_CLASS_NAMES,
        category_ids=COCO_CATEGORY_IDS,
        layout=tfds_source.TfdsLayout(image_id_key="image/id", ignore_key="is_crowd"),
    ),
    "voc/2007": TfdsEntry(
        class_names=VOC_CLASS_NAMES,
        category_ids=tuple(range(1, 21)),
        layout=tfds_source.TfdsLayout(image_id_key=None, ignore_key="is_difficult"),
    ),
}
TFDS_DATASETS["voc/2012"] = TFDS_DATASETS["voc/2007"]


def check_name(config) -> str:
    """`config.dataset.name`; DatasetError listing the known datasets when it is none of them."""
    name = config.dataset.name
    if name not in KNOWN_DATASETS:
        raise DatasetError(f"unknown dataset {name!r}; known datasets: {', '.join(KNOWN_DATASETS)}")
    return name


def class_names(config) -> tuple[str, ...]:
    """Class names of `config.dataset`, label order, without converting any data."""
    name = check_name(config)
    if name == "coco_json":
        return coco_json.read_categories(coco_json_paths(config, TRAIN)[0]).class_names
    return TFDS_DATASETS[name].class_names
