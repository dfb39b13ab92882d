"""What the model and the evaluator need to know about a dataset, read off its prepared splits."""

from __future__ import annotations

import dataclasses

from input_pipeline.dataset_errors import DatasetError
from input_pipeline.datasets.registry import EVAL, TRAIN
from input_pipeline.datasets.splits import prepare_split


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What the model and the evaluator need to know about a dataset.

    Attributes:
      name: registry name, e.g. 'synthetic_shapes'.
      num_classes: number of contiguous labels 0..num_classes-1.
      class_names: tuple of num_classes names.
      label_to_category_id: tuple of num_classes category ids; entry i is the
        category id of contiguous label i (used in COCO-format files).
      num_eval_examples: usable images in the eval split.
    """

    name: str
    num_classes: int
    class_names: tuple[str, ...]
    label_to_category_id: tuple[int, ...]
    num_eval_examples: int


def get_dataset_info(config, *, sync: bool = True) -> DatasetInfo:
    """Class names, category ids and eval size of `config.dataset`.

    Prepares both splits if needed (see prepare_split for `sync`).

    Raises:
      DatasetError: as prepare_split, or train and eval splits whose categories
        differ.
    """
    train = prepare_split(config, TRAIN, sync=sync)
    evaluation = prepare_split(config, EVAL, sync=sync)
    if (train.category_ids, train.class_names) != (evaluation.category_ids, evaluation.class_names):
        raise DatasetError(
            f"train and eval categories differ ({len(train.category_ids)} vs "
            f"{len(evaluation.category_ids)} categories); both JSON files must list "
            "the same categories with the same ids"
        )
    return DatasetInfo(
        name=config.dataset.name,
        num_classes=len(train.class_names),
        class_names=train.class_names,
        label_to_category_id=train.category_ids,
        num_eval_examples=evaluation.num_records,
    )
