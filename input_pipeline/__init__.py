"""Per-host input pipelines: datasets, box-aware transforms, global batches.

Public API:
  create_train_iterator(config, *, start_step=0) -> Iterator[dict]
  create_eval_iterator(config) -> EvalIterator(batches, num_batches)
  coco_ground_truth(config) -> COCO-format dict of the eval split
  to_global_batch(local_batch, mesh, batch_axes) -> dict of jax.Array
  get_dataset_info(config) -> DatasetInfo
  DatasetError: raised for unusable dataset configs.
"""

from input_pipeline.datasets import DatasetError
from input_pipeline.datasets import DatasetInfo
from input_pipeline.datasets import get_dataset_info
from input_pipeline.global_batch import to_global_batch
from input_pipeline.pipeline import coco_ground_truth
from input_pipeline.pipeline import create_eval_iterator
from input_pipeline.pipeline import create_train_iterator
from input_pipeline.pipeline import EvalIterator
from input_pipeline.pipeline import local_batch_size

__all__ = [
    "DatasetError",
    "DatasetInfo",
    "EvalIterator",
    "coco_ground_truth",
    "create_eval_iterator",
    "create_train_iterator",
    "get_dataset_info",
    "local_batch_size",
    "to_global_batch",
]
