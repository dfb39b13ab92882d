"""Per-host input pipelines: datasets, box-aware transforms, global batches.

Public API:
  create_train_iterator(config, *, start_position=0, first_row=None)
      -> TrainIterator (numpy batches, .position, .input_counts)
  create_eval_iterator(config, *, first_row=None)
      -> EvalIterator(batches, num_batches, input_counts)
  coco_ground_truth(config) -> COCO-format dict of the eval split
  coco_ground_truth_columns(config) -> the same boxes as numpy columns (for scoring at scale)
  to_global_batch(local_batch, mesh, batch_axes) -> dict of jax.Array
  process_rows(sharding, global_batch_size) -> first row this process holds
  with_batch_size(config, batch_size) -> config copy batching by batch_size
  num_threads(config) -> tf.data threads the pipeline uses
  get_dataset_info(config) -> DatasetInfo
  prepare_split(config, 'train' | 'eval') -> PreparedSplit (with counts)
  format_counts({name: PreparedSplit}) -> markdown table of the counts
  TransformOptions.from_config(config) -> the input options, checked (DatasetError names a bad one)
  DatasetError: raised for unusable datasets and configs.
The batch layout (keys, dtypes, shapes) is input_pipeline.batch; box
geometry shared with detector.ops is input_pipeline.box_geometry.

These names load their modules on first use: `input_pipeline.batch` and
`input_pipeline.box_geometry` need numpy only, and importing them must not
start TensorFlow (benchmarks' PyTorch worker, detector.ops' pure array math).
"""

from __future__ import annotations

import importlib

# Public name -> (module, attribute) it comes from.
_EXPORTS = {
    "DatasetError": ("input_pipeline.dataset_errors", "DatasetError"),
    "DatasetInfo": ("input_pipeline.datasets", "DatasetInfo"),
    "EvalIterator": ("input_pipeline.pipeline", "EvalIterator"),
    "InputCounts": ("input_pipeline.pipeline", "InputCounts"),
    "TrainIterator": ("input_pipeline.pipeline", "TrainIterator"),
    "TransformOptions": ("input_pipeline.transforms", "TransformOptions"),
    "coco_ground_truth": ("input_pipeline.datasets", "eval_ground_truth"),
    "coco_ground_truth_columns": ("input_pipeline.datasets", "eval_ground_truth_columns"),
    "create_eval_iterator": ("input_pipeline.pipeline", "create_eval_iterator"),
    "create_train_iterator": ("input_pipeline.pipeline", "create_train_iterator"),
    "format_counts": ("input_pipeline.datasets.cache", "format_counts"),
    "get_dataset_info": ("input_pipeline.datasets", "get_dataset_info"),
    "local_batch_size": ("input_pipeline.pipeline", "local_batch_size"),
    "num_threads": ("input_pipeline.pipeline", "num_threads"),
    "prepare_split": ("input_pipeline.datasets", "prepare_split"),
    "process_rows": ("input_pipeline.global_batch", "process_rows"),
    "with_batch_size": ("input_pipeline.pipeline", "with_batch_size"),
    "to_global_batch": ("input_pipeline.global_batch", "to_global_batch"),
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name.startswith("__"):  # Probes such as __wrapped__ are no submodules.
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _EXPORTS:
        module, attribute = _EXPORTS[name]
        value = getattr(importlib.import_module(module), attribute)
    else:
        # `import input_pipeline` then `input_pipeline.transforms`: submodules are attributes as well.
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
