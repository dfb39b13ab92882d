"""Dataset registry: name -> prepared TFDS builder and example decoder.

Known datasets:
  synthetic_shapes  generated locally on first use (input_pipeline/datasets/
                    synthetic_shapes.py); the default, needs no download.
  coco/2017         TFDS `coco/2017`, which must already be prepared in the
                    data dir (`tfds build coco/2017 --data_dir=DIR`); this code
                    never downloads it.

Both use the TFDS COCO feature layout (`image`, `image/id`, `objects/bbox`
normalized y0, x0, y1, x1, `objects/label`), so one decoder reads both.

Data dir: `config.dataset.data_dir`, or when None `$DETECTOR_DATA_DIR`, or
`~/.cache/detector/datasets`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from etils import epath
import jax
from jax.experimental import multihost_utils
import tensorflow as tf
import tensorflow_datasets as tfds

from input_pipeline import transforms
from input_pipeline.datasets import synthetic_shapes as ss


class DatasetError(ValueError):
  """A dataset cannot be used as configured; the message says how to fix it."""


KNOWN_DATASETS = ("synthetic_shapes", "coco/2017")
DEFAULT_DATA_DIR = os.path.join("~", ".cache", "detector", "datasets")

# TFDS coco/2017 labels are the 80 used COCO categories in category-id order;
# COCO's own ids (1-90, with gaps) are what its evaluation files use.
COCO_CATEGORY_IDS = (
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,
    23, 24, 25, 27, 28, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44,
    46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64,
    65, 67, 70, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 84, 85, 86, 87, 88,
    89, 90)
COCO_CLASS_NAMES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train",
    "truck", "boat", "traffic light", "fire hydrant", "stop sign",
    "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag",
    "tie", "suitcase", "frisbee", "skis", "snowboard", "sports ball", "kite",
    "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon",
    "bowl", "banana", "apple", "sandwich", "orange", "broccoli", "carrot",
    "hot dog", "pizza", "donut", "cake", "chair", "couch", "potted plant",
    "bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote",
    "keyboard", "cell phone", "microwave", "oven", "toaster", "sink",
    "refrigerator", "book", "clock", "vase", "scissors", "teddy bear",
    "hair drier", "toothbrush")


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """What the model and the evaluator need to know about a dataset.

  Attributes:
    name: registry name, e.g. 'synthetic_shapes'.
    num_classes: number of contiguous labels 0..num_classes-1.
    class_names: tuple of num_classes names.
    label_to_category_id: tuple of num_classes COCO category ids; entry i is
      the category id of contiguous label i (used in COCO-format files).
    num_eval_examples: examples in config.dataset.eval_split.
  """

  name: str
  num_classes: int
  class_names: tuple[str, ...]
  label_to_category_id: tuple[int, ...]
  num_eval_examples: int


@dataclasses.dataclass(frozen=True)
class _Entry:
  open_builder: Callable[[Any, str, bool], tfds.core.DatasetBuilder]
  class_names: tuple[str, ...]
  label_to_category_id: tuple[int, ...]
  # Drop `objects/is_crowd` boxes from training/eval targets: a crowd box
  # marks a region of many instances, not one object to regress.
  drop_crowd: bool


def _check_name(config) -> _Entry:
  name = config.dataset.name
  if name not in _REGISTRY:
    raise DatasetError(
        f"unknown dataset {name!r}; known datasets: "
        f"{', '.join(KNOWN_DATASETS)}")
  return _REGISTRY[name]


_tf_configured = False


def configure_tf() -> None:
  """Keeps TensorFlow off accelerators: it only feeds the input pipeline."""
  global _tf_configured
  if _tf_configured:
    return
  try:
    tf.config.set_visible_devices([], "GPU")
  except RuntimeError:
    pass  # TF's runtime was already initialized elsewhere; too late to hide.
  _tf_configured = True


def resolve_data_dir(config) -> str:
  """Returns the data dir for `config`, creating the default one if needed.

  An explicitly set `config.dataset.data_dir` may not exist yet, but its
  parent directory must (a typo in a path should fail here, loudly, rather
  than prepare a dataset somewhere unexpected).
  """
  data_dir = config.dataset.get("data_dir", None)
  if not data_dir:
    data_dir = os.environ.get("DETECTOR_DATA_DIR") or os.path.expanduser(
        DEFAULT_DATA_DIR)
    epath.Path(data_dir).mkdir(parents=True, exist_ok=True)
    return os.fspath(data_dir)
  data_dir = os.fspath(data_dir)
  if "://" not in data_dir:  # Local path; remote ones (gs://) are not checked.
    data_dir = os.path.abspath(os.path.expanduser(data_dir))
    parent = os.path.dirname(data_dir)
    if not os.path.isdir(parent):
      raise DatasetError(
          f"data_dir {data_dir} cannot be used: its parent directory {parent} "
          f"does not exist; create it (mkdir -p {parent}) or set "
          "--config.dataset.data_dir to an existing location")
  return data_dir


def _synthetic_builder(config, data_dir: str, sync: bool):
  ds = config.dataset
  sizes = (int(ds.get("num_train_examples", 4096)),
           int(ds.get("num_eval_examples", 256)),
           int(ds.get("image_size", 128)))
  name = ss.config_name(*sizes)

  def make():
    # TFDS refuses a new config object named like a predefined one.
    cfg = name if name in ss.SyntheticShapes.builder_configs else (
        ss.SyntheticShapesConfig.make(*sizes))
    return ss.SyntheticShapes(data_dir=data_dir, config=cfg)

  epath.Path(data_dir).mkdir(parents=True, exist_ok=True)
  # No network: the dataset is generated here, never fetched from GCS.
  download_config = tfds.download.DownloadConfig(try_download_gcs=False)
  if sync and jax.process_count() > 1:
    if jax.process_index() == 0:
      make().download_and_prepare(download_config=download_config)
    multihost_utils.sync_global_devices(f"prepare synthetic_shapes/{name}")
    builder = make()  # Opened after the barrier so it reads process 0's files.
    if not builder.is_prepared():
      # data_dir is not shared between hosts: generation is deterministic,
      # so a local copy is identical to process 0's.
      builder.download_and_prepare(download_config=download_config)
    return builder
  builder = make()
  builder.download_and_prepare(download_config=download_config)
  return builder


def _coco_builder(config, data_dir: str, sync: bool):
  del config, sync  # Never prepared here, so there is nothing to wait for.
  error = DatasetError(
      f"coco/2017 is not prepared in {data_dir}; download it with "
      f"`tfds build coco/2017 --data_dir={data_dir}` or set "
      "--config.dataset.data_dir")
  root = epath.Path(data_dir) / "coco" / "2017"
  versions = []
  if root.exists():
    for d in root.iterdir():
      if (d / "dataset_info.json").exists():
        try:
          versions.append((tfds.core.Version(d.name), d))
        except ValueError:
          continue  # Not a version directory (e.g. an incomplete temp dir).
  if not versions:
    raise error
  # Read the prepared files directly: no download code, no network.
  builder = tfds.builder_from_directory(max(versions)[1])
  if not builder.is_prepared():
    raise error
  return builder


_REGISTRY: dict[str, _Entry] = {
    "synthetic_shapes": _Entry(
        open_builder=_synthetic_builder,
        class_names=tuple(ss.CLASS_NAMES),
        # COCO-format files need ids; 0 is avoided as it is no valid COCO id.
        label_to_category_id=tuple(range(1, len(ss.CLASS_NAMES) + 1)),
        drop_crowd=False),
    "coco/2017": _Entry(
        open_builder=_coco_builder,
        class_names=COCO_CLASS_NAMES,
        label_to_category_id=COCO_CATEGORY_IDS,
        drop_crowd=True),
}


def get_builder(config, *, sync: bool = True) -> tfds.core.DatasetBuilder:
  """Returns the prepared TFDS builder of `config.dataset.name`.

  The synthetic dataset is generated on first use and reused afterwards. In
  multi-process runs with `sync=True` (every process must then call this),
  process 0 prepares it while the others wait at a barrier; pass
  `sync=False` only from code that runs on one process.

  Raises:
    DatasetError: unknown name, unusable data dir, or coco/2017 not prepared.
  """
  entry = _check_name(config)
  configure_tf()
  return entry.open_builder(config, resolve_data_dir(config), sync)


def get_decoder(config) -> Callable[[dict], dict]:
  """Returns a tf function: raw TFDS example -> transforms.decode_example()."""
  entry = _check_name(config)

  def decode(example):
    return transforms.decode_example(example, drop_crowd=entry.drop_crowd)

  return decode


def class_names(config) -> tuple[str, ...]:
  """Class names of `config.dataset`, label order, without reading or preparing any data."""
  return tuple(_check_name(config).class_names)


def get_dataset_info(config, *, sync: bool = True) -> DatasetInfo:
  """Class names, category ids and eval size of `config.dataset`.

  Prepares the dataset if needed (see get_builder for `sync`).
  """
  entry = _check_name(config)
  builder = get_builder(config, sync=sync)
  names = entry.class_names
  try:
    num_eval = builder.info.splits[config.dataset.eval_split].num_examples
  except (KeyError, ValueError) as e:
    raise DatasetError(
        f"eval split {config.dataset.eval_split!r} not found in "
        f"{config.dataset.name}; available: {list(builder.info.splits)}"
    ) from e
  return DatasetInfo(
      name=config.dataset.name,
      num_classes=len(names),
      class_names=tuple(names),
      label_to_category_id=entry.label_to_category_id,
      num_eval_examples=int(num_eval),
  )


__all__ = [
    "COCO_CATEGORY_IDS",
    "COCO_CLASS_NAMES",
    "DatasetError",
    "DatasetInfo",
    "KNOWN_DATASETS",
    "class_names",
    "configure_tf",
    "get_builder",
    "get_dataset_info",
    "get_decoder",
    "resolve_data_dir",
]
