"""Per-process tf.data pipelines yielding host-local numpy batches.

Every batch is a dict of numpy arrays, b = global_batch_size // process_count:
  image          float32 [b, H, W, 3]   normalized ((x - mean) / std)
  boxes          float32 [b, max_boxes, 4]  y0, x0, y1, x1 network-input px
  labels         int32   [b, max_boxes]  contiguous labels, -1 = padding
  boxes_mask     bool    [b, max_boxes]
  image_id       int32   [b]             -1 for eval padding examples
  scale          float32 [b]             network px per original px
  original_size  int32   [b, 2]          (h, w) of the original image
  example_mask   bool    [b]             False only for eval padding

Each process reads only its own shard of the split
(`tfds.split_for_jax_process`). Training randomness is stateless and seeded
from (config.seed, position of the example in the global stream), so a given
seed and process count always give the same batches.

Config keys read: seed, global_batch_size, dataset.{name, data_dir,
train_split, eval_split, num_train_examples, num_eval_examples, image_size},
input.{image_size, max_boxes, scale_jitter, horizontal_flip, mean_rgb,
std_rgb, shuffle_buffer, prefetch, min_box_size}; optional
input.num_threads (tf.data thread pool size per process).
"""

from __future__ import annotations

import math
import os
from typing import Iterator, NamedTuple

import jax
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from input_pipeline import datasets
from input_pipeline import transforms
from input_pipeline.datasets import DatasetError

Batch = dict[str, np.ndarray]


def local_batch_size(config, process_count: int | None = None) -> int:
  """global_batch_size // process_count; DatasetError if not divisible."""
  if process_count is None:
    process_count = jax.process_count()
  global_batch = int(config.global_batch_size)
  if global_batch <= 0 or global_batch % process_count:
    raise DatasetError(
        f"global_batch_size {global_batch} must be a positive multiple of the "
        f"number of processes ({process_count})")
  return global_batch // process_count


def _setup(config, process_index, process_count):
  """TF setup plus what both pipelines need: this process, its batch, transforms, decoder."""
  datasets.configure_tf()
  if process_index is None:
    process_index = jax.process_index()
  if process_count is None:
    process_count = jax.process_count()
  return (process_index, process_count, local_batch_size(config, process_count),
          transforms.TransformOptions.from_config(config), datasets.get_decoder(config))


def _options(config) -> tf.data.Options:
  options = tf.data.Options()
  # A private pool bounds how many cores tf.data takes from the trainer.
  threads = config.input.get("num_threads", None) or max(
      1, min(16, (os.cpu_count() or 2) // 2))
  options.threading.private_threadpool_size = int(threads)
  options.threading.max_intra_op_parallelism = 1
  options.deterministic = True
  return options


def _read(config, split: str, *, shuffle_files: bool) -> tf.data.Dataset:
  builder = datasets.get_builder(config)
  read_config = tfds.ReadConfig(
      shuffle_seed=int(config.seed) if shuffle_files else None,
      # An endless training stream is rarely read to the end of an epoch
      # before it is dropped, which discards TFDS's in-memory cache (with a
      # warning); the OS page cache serves small datasets just as well.
      try_autocache=not shuffle_files)
  try:
    # Images are decoded in the transform, after any skipping.
    return builder.as_dataset(
        split=split, shuffle_files=shuffle_files, read_config=read_config,
        decoders={"image": tfds.decode.SkipDecoding()})
  except (KeyError, ValueError) as e:
    raise DatasetError(
        f"cannot read split {split!r} of {config.dataset.name}: {e}") from e


def train_dataset(config, *, start_step: int = 0,
                  process_index: int | None = None,
                  process_count: int | None = None) -> tf.data.Dataset:
  """Infinite tf.data.Dataset of local training batches (see module doc).

  Args:
    config: the trainer config.
    start_step: number of local batches to skip (resuming a run). The
      skipped records are read and shuffled but not decoded or transformed,
      so resuming costs about one pass over start_step * b records.
    process_index, process_count: default to jax's; settable for tests.
  """
  process_index, process_count, batch, opts, decode = _setup(config, process_index, process_count)
  split = tfds.split_for_jax_process(
      config.dataset.train_split, process_index=process_index,
      process_count=process_count, drop_remainder=True)
  seed = int(config.seed)

  ds = _read(config, split, shuffle_files=True)
  ds = ds.shuffle(int(config.input.shuffle_buffer), seed=seed,
                  reshuffle_each_iteration=True)
  ds = ds.repeat()
  ds = ds.enumerate()  # Position of each example in this process's stream.
  if start_step:
    ds = ds.skip(int(start_step) * batch)

  def transform(position, example):
    # Position in the global stream: processes interleave example by example.
    global_position = position * process_count + process_index
    example_seed = tf.stack([tf.constant(seed, tf.int64), global_position])
    return transforms.train_transform(decode(example), example_seed, opts)

  ds = ds.map(transform, num_parallel_calls=tf.data.AUTOTUNE)
  ds = ds.batch(batch, drop_remainder=True)
  ds = ds.prefetch(int(config.input.prefetch))
  return ds.with_options(_options(config))


def create_train_iterator(config, *, start_step: int = 0) -> Iterator[Batch]:
  """Endless iterator of this process's training batches (numpy dicts).

  Args:
    config: the trainer config.
    start_step: local batches already consumed (for resuming at a step).
  """
  return iter(tfds.as_numpy(train_dataset(config, start_step=start_step)))


def _padding_example(element_spec) -> dict:
  """A masked dummy eval example matching `element_spec` (no batch dim)."""
  dummy = {k: tf.zeros(s.shape, s.dtype) for k, s in element_spec.items()}
  dummy["labels"] = -tf.ones_like(dummy["labels"])
  dummy["image_id"] = tf.constant(-1, tf.int32)
  dummy["scale"] = tf.constant(1.0, tf.float32)  # Safe to divide by.
  return dummy


def eval_dataset(config, *, process_index: int | None = None,
                 process_count: int | None = None
                 ) -> tuple[tf.data.Dataset, int]:
  """Finite eval dataset of this process's shard and the number of batches.

  Every process returns the same number of batches,
  ceil(num_eval_examples / global_batch_size); the tail is filled with
  masked dummy examples (example_mask False, image_id -1, labels -1).
  """
  process_index, process_count, batch, opts, decode = _setup(config, process_index, process_count)
  info = datasets.get_dataset_info(config)
  num_batches = math.ceil(
      info.num_eval_examples / int(config.global_batch_size))

  split = tfds.split_for_jax_process(
      config.dataset.eval_split, process_index=process_index,
      process_count=process_count, drop_remainder=False)
  ds = _read(config, split, shuffle_files=False)
  ds = ds.map(lambda ex: transforms.eval_transform(decode(ex), opts),
              num_parallel_calls=tf.data.AUTOTUNE)
  padding = tf.data.Dataset.from_tensors(
      _padding_example(ds.element_spec)).repeat()
  ds = ds.concatenate(padding).take(num_batches * batch)
  ds = ds.batch(batch, drop_remainder=True)
  ds = ds.prefetch(int(config.input.prefetch))
  return ds.with_options(_options(config)), num_batches


class EvalIterator(NamedTuple):
  """create_eval_iterator() result; unpacks as (batches, num_batches).

  Attributes:
    batches: iterator over exactly num_batches numpy batches.
    num_batches: same on every process.
  """

  batches: Iterator[Batch]
  num_batches: int


def create_eval_iterator(config) -> EvalIterator:
  """One pass over the eval split, every example exactly once over processes.

  Usage: `batches, num_batches = create_eval_iterator(config)`. Call it again
  for the next evaluation.
  """
  ds, num_batches = eval_dataset(config)
  return EvalIterator(iter(tfds.as_numpy(ds)), num_batches)


def coco_ground_truth(config) -> dict:
  """COCO-format ground truth of the eval split, in original image pixels.

  Reads the whole split (call it on one process; it never waits for others).
  Crowd regions of coco/2017 are kept with iscrowd=1 so COCO evaluation
  ignores detections on them, as the official annotations do.

  Returns:
    {'images': [{'id', 'height', 'width'}],
     'annotations': [{'id' (from 1), 'image_id', 'category_id', 'bbox'
                      [x, y, w, h], 'area', 'iscrowd'}],
     'categories': [{'id', 'name'}]}.
  """
  datasets.configure_tf()
  info = datasets.get_dataset_info(config, sync=False)
  builder = datasets.get_builder(config, sync=False)
  try:
    ds = builder.as_dataset(split=config.dataset.eval_split,
                            shuffle_files=False,
                            decoders={"image": tfds.decode.SkipDecoding()})
  except (KeyError, ValueError) as e:
    raise DatasetError(f"cannot read eval split: {e}") from e

  def summarize(ex):
    encoded = ex["image"]
    hw = tf.cond(
        tf.io.is_jpeg(encoded),
        lambda: tf.image.extract_jpeg_shape(encoded)[:2],
        lambda: tf.shape(tf.io.decode_image(
            encoded, channels=3, expand_animations=False))[:2])
    objects = ex["objects"]
    n = tf.shape(objects["label"])[0]
    return {
        "image_id": ex["image/id"],
        "hw": hw,
        "bbox": objects["bbox"],
        "label": objects["label"],
        "is_crowd": objects.get("is_crowd", tf.zeros([n], tf.bool)),
        "area": objects.get("area", -tf.ones([n], tf.int64)),
    }

  ds = ds.map(summarize, num_parallel_calls=tf.data.AUTOTUNE)
  images, annotations = [], []
  for ex in tfds.as_numpy(ds):
    h, w = (int(v) for v in ex["hw"])
    image_id = int(ex["image_id"])
    images.append({"id": image_id, "height": h, "width": w})
    for box, label, crowd, area in zip(ex["bbox"], ex["label"],
                                       ex["is_crowd"], ex["area"]):
      y0, x0, y1, x1 = (float(v) for v in box.astype(np.float64)
                        * np.array([h, w, h, w]))
      bw, bh = x1 - x0, y1 - y0
      annotations.append({
          "id": len(annotations) + 1,  # COCO eval treats id 0 as unmatched.
          "image_id": image_id,
          "category_id": int(info.label_to_category_id[int(label)]),
          # Stored normalized in float32: round away the representation noise.
          "bbox": [round(x0, 3), round(y0, 3), round(bw, 3), round(bh, 3)],
          "area": float(area) if area >= 0 else round(bw * bh, 3),
          "iscrowd": int(bool(crowd)),
      })
  categories = [{"id": int(c), "name": n} for c, n in
                zip(info.label_to_category_id, info.class_names)]
  return {"images": images, "annotations": annotations,
          "categories": categories}
