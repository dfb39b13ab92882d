"""Per-host input pipelines: datasets, box-aware transforms, global batches.

Public API:
  create_train_iterator(config, *, start_position=0, first_row=None)
      -> TrainIterator (numpy batches, .position, .input_counts)
  create_eval_iterator(config, *, first_row=None)
      -> EvalIterator(batches, num_batches, input_counts)
  coco_ground_truth(config) -> COCO-format dict of the eval split
  to_global_batch(local_batch, mesh, batch_axes) -> dict of jax.Array
  process_rows(sharding, global_batch_size) -> first row this process holds
  with_batch_size(config, batch_size) -> config copy batching by batch_size
  num_threads(config) -> tf.data threads the pipeline uses
  get_dataset_info(config) -> DatasetInfo
  prepare_split(config, 'train' | 'eval') -> PreparedSplit (with counts)
  format_counts({name: PreparedSplit}) -> markdown table of the counts
  DatasetError: raised for unusable datasets and configs.
"""

from input_pipeline.dataset_errors import DatasetError
from input_pipeline.datasets import DatasetInfo, get_dataset_info, prepare_split
from input_pipeline.datasets import eval_ground_truth as coco_ground_truth
from input_pipeline.datasets.cache import format_counts
from input_pipeline.global_batch import process_rows, to_global_batch
from input_pipeline.pipeline import (
    EvalIterator,
    InputCounts,
    TrainIterator,
    create_eval_iterator,
    create_train_iterator,
    local_batch_size,
    num_threads,
    with_batch_size,
)

__all__ = [
    "DatasetError",
    "DatasetInfo",
    "EvalIterator",
    "InputCounts",
    "TrainIterator",
    "coco_ground_truth",
    "create_eval_iterator",
    "create_train_iterator",
    "format_counts",
    "get_dataset_info",
    "local_batch_size",
    "num_threads",
    "prepare_split",
    "process_rows",
    "with_batch_size",
    "to_global_batch",
]
