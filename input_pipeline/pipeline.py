"""Per-process tf.data pipelines yielding host-local numpy batches.

Every batch is a dict of numpy arrays laid out as input_pipeline/batch.py
defines (keys, dtypes, shapes, units), b = global_batch_size // process_count
examples each.

The order is global: example `p` of the training stream (p = 0, 1, ...) is
record `train_ids[shuffle(p mod N; seed, epoch = p div N)]`, a stateless
permutation of the whole split per epoch, and its random augmentation is
seeded by (seed, p). Global batch t holds positions t*G .. t*G + G - 1 and a
process reads only the rows of it that its devices hold. So the sequence of
global batches is a function of (seed, position) alone, the same for any
number of processes, and a run resumed at position t*G continues exactly
where it stopped.

An image that fails to decode (corrupt or truncated file) becomes a masked
example (example_mask False, no boxes) in its slot, so batches keep their
composition; the iterators count these and boxes cut at max_boxes.

Config keys read: seed, global_batch_size, dataset.* (see datasets),
input.{image_size, max_boxes, scale_jitter, horizontal_flip, mean_rgb,
std_rgb, prefetch, min_box_size, min_visible_fraction, color_jitter,
max_bad_fraction, num_threads}; dataset.include_negatives.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
from collections.abc import Iterator
from typing import NamedTuple

import jax
import ml_collections
import numpy as np
import tensorflow as tf

from input_pipeline import batch as batch_layout
from input_pipeline import datasets, records, transforms
from input_pipeline.dataset_errors import DatasetError
from sharding.mesh import split_global_batch

Batch = dict[str, np.ndarray]
# Per-example flags the pipeline emits for accounting; the iterators take
# them out of the batches they yield and count them.
REPORT_KEYS = ("decode_failed", "boxes_truncated")
# Streaming checks start once this many examples were seen, so a few bad
# files at the start of an epoch do not stop a run.
_MIN_EXAMPLES_FOR_BAD_CHECK = 256


def local_batch_size(config, process_count: int | None = None) -> int:
    """global_batch_size // process_count; sharding.MeshError if not divisible."""
    if process_count is None:
        process_count = jax.process_count()
    return split_global_batch(int(config.global_batch_size), process_count, f"{process_count} processes")


def num_threads(config) -> int:
    """tf.data's threads: `input.num_threads`, or when None half the host's cores (1 to 16)."""
    return int(config.input.num_threads or max(1, min(16, (os.cpu_count() or 2) // 2)))


def _options(config) -> tf.data.Options:
    options = tf.data.Options()
    # A private pool bounds how many cores tf.data takes from the trainer.
    options.threading.private_threadpool_size = num_threads(config)
    options.threading.max_intra_op_parallelism = 1
    options.deterministic = True
    return options


def _rows(config, first_row: int | None, process_count: int | None) -> tuple[int, int]:
    """(first global row of this process's part of a batch, rows per process)."""
    batch = local_batch_size(config, process_count)
    if first_row is None:
        first_row = jax.process_index() * batch
    if not 0 <= first_row <= int(config.global_batch_size) - batch:
        raise ValueError(
            f"first_row {first_row} outside a global batch of {config.global_batch_size} with {batch} rows per process"
        )
    return int(first_row), batch


def _local_positions(
    start_position: int, global_batch: int, first_row: int, batch: int, num_batches: int | None
) -> tf.data.Dataset:
    """int64 positions this process reads, batch after batch (endless if None)."""
    steps = tf.data.Dataset.range(num_batches if num_batches is not None else 2**62)
    offsets = tf.range(batch, dtype=tf.int64)
    return steps.map(lambda t: start_position + t * global_batch + first_row + offsets)


def _surfacing_dataset_errors(batches: Iterator) -> Iterator:
    """`batches`, with a DatasetError raised inside tf.data (a record that cannot be read) as that DatasetError.

    tf.numpy_function wraps a Python exception into an OpError whose message
    holds the traceback; the user needs the one line that says what to do.
    """
    while True:
        try:
            batch = next(batches)
        except tf.errors.OpError as e:
            cause = re.search(r"DatasetError: (.+)", str(e))
            if cause is None:
                raise
            raise DatasetError(cause.group(1).strip()) from e
        except StopIteration:
            return
        yield batch


def _read_records(reader: datasets.cache.RecordReader, record_ids: tf.Tensor) -> tf.Tensor:
    """string [n]: serialized records for int64 [n] ids; b'' where id < 0."""

    def read(ids):
        out = np.full(ids.shape, b"", dtype=object)
        valid = ids >= 0
        if valid.any():
            out[valid] = reader.read(ids[valid])
        return out

    serialized = tf.numpy_function(read, [record_ids], tf.string, stateful=False)
    return tf.ensure_shape(serialized, record_ids.shape)


def _masked_example(image_size, max_boxes: int, decode_failed, mask_grid_hw=None) -> dict:
    """batch_layout.empty_example as tensors, with the REPORT_KEYS flags."""
    example = batch_layout.empty_example(
        image_size,
        max_boxes,
        full=lambda shape, value, dtype: tf.fill(shape, tf.constant(value, dtype)),
        mask_grid_hw=mask_grid_hw,
    )
    return {
        **example,
        "boxes_truncated": tf.constant(False),
        "decode_failed": tf.cast(decode_failed, tf.bool),
    }


def _decode(serialized: tf.Tensor, *, with_masks: bool = False) -> dict:
    """Record -> transforms' input (image uint8 [h, w, 3], boxes, labels, image_id; `with_masks`: the
    boxes' mask_run_lengths).

    Crowd / ignore regions are no training targets: they are dropped here
    (evaluation reads them from the ground truth instead).
    """
    ex = records.parse(serialized, with_masks=with_masks)
    image = tf.io.decode_image(ex["image"], channels=3, dtype=tf.uint8, expand_animations=False)
    keep = tf.logical_not(ex["is_crowd"])
    masks = {}
    if with_masks:
        masks["mask_run_lengths"] = tf.ragged.boolean_mask(ex["mask_run_lengths"], keep)
    return {
        **masks,
        "image": tf.ensure_shape(image, [None, None, 3]),
        "boxes": tf.boolean_mask(ex["boxes"], keep),
        "labels": tf.boolean_mask(ex["labels"], keep),
        "image_id": tf.cast(ex["image_id"], tf.int32),
    }


def _guarded(transform, image_size, max_boxes: int, mask_grid_hw=None):
    """Per-example `transform(serialized, position)` (decode and transform) that turns a failure into a masked example.

    tf.data cannot catch an op error inside a map function, but a one-element
    dataset with ignore_errors() can: it yields the result, or nothing and the
    fallback that follows it. Slots never move, so batches keep their rows.
    Any error lands here, not only undecodable bytes; the iterators' check on
    the decode_failed fraction stops a run where that would hide a bug.
    """

    def process(position, record_id, serialized):
        def run(position, record_id, serialized):
            out = transform(serialized, position)
            out["decode_failed"] = tf.constant(False)
            return out

        args = (position, record_id, serialized)
        # Padding (record id -1) never reaches the parser: parsing its empty
        # record would fail too, but TensorFlow logs every failed op, one
        # warning per padding slot of every evaluation.
        good = tf.data.Dataset.from_tensors(args).filter(lambda _, rid, __: rid >= 0).map(run).ignore_errors()
        fallback = tf.data.Dataset.from_tensors(record_id).map(
            lambda rid: _masked_example(image_size, max_boxes, decode_failed=rid >= 0, mask_grid_hw=mask_grid_hw)
        )
        return good.concatenate(fallback).take(1)

    return process


def _build(
    config,
    positions: tf.data.Dataset,
    record_of_position,
    reader,
    transform,
    batch: int,
    image_size,
    partners_of_position=None,
    mask_grid_hw=None,
) -> tf.data.Dataset:
    """Batches of `batch` transformed examples whose `image` is `image_size` (H, W).

    `transform(serialized, position)` gets the position's record, or with
    `partners_of_position` (int64 [n] positions -> [n, k] record ids, -1 for
    none) a string [1 + k] of it and its partners (b'' for none).
    """

    def read(positions):
        record_ids = record_of_position(positions)
        if partners_of_position is None:
            return positions, record_ids, _read_records(reader, record_ids)
        # [n, 1 + k] records: each example's own, then the k its transform may combine it with (-1: none).
        with_partners = tf.concat([record_ids[:, None], partners_of_position(positions)], axis=1)
        return positions, record_ids, _read_records(reader, with_partners)

    ds = positions.map(read, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.unbatch()
    ds = ds.interleave(
        _guarded(transform, image_size, int(config.input.max_boxes), mask_grid_hw),
        cycle_length=max(2, int(_options(config).threading.private_threadpool_size)),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    ds = ds.batch(batch, drop_remainder=True)
    ds = ds.prefetch(int(config.input.prefetch))
    return ds.with_options(_options(config))


def training_record_ids(config, split: datasets.cache.PreparedSplit) -> np.ndarray:
    """int64 [N']: records the training stream draws from, in record order.

    All records, or only those with at least one training box when
    `dataset.include_negatives` is False.
    """
    ids = np.arange(split.num_records, dtype=np.int64)
    if not config.dataset.include_negatives:
        ids = ids[split.num_training_boxes() > 0]
    if ids.size == 0:
        raise DatasetError(
            "the training split has no image with a box to train on; check the "
            "annotations or set dataset.include_negatives=True"
        )
    return ids


def train_dataset(
    config, *, start_position: int = 0, first_row: int | None = None, process_count: int | None = None
) -> tf.data.Dataset:
    """Endless tf.data.Dataset of this process's training batches.

    Args:
      config: the trainer config.
      start_position: examples of the global stream already consumed (a
        multiple of global_batch_size when resuming a run at a step).
      first_row: first row of each global batch this process holds (default:
        process_index * b; the trainer passes what its mesh says).
      process_count: defaults to jax's; settable for tests.

    Batches carry the REPORT_KEYS flags besides the keys in the module doc.
    """
    first_row, batch = _rows(config, first_row, process_count)
    split = datasets.prepare_split(config, datasets.TRAIN)
    train_ids = tf.constant(training_record_ids(config, split))
    num = tf.constant(int(train_ids.shape[0]), tf.int64)
    seed = int(config.seed)
    opts = transforms.TransformOptions.from_config(config)

    def record_of_position(positions):
        epoch = positions // num
        # A fresh permutation of the whole split every epoch (stateless, O(1) per
        # example: no buffer, no dependence on how many hosts read the stream).
        # The raw op takes one [seed, epoch, 0] row per position (the public
        # wrapper only pads a single seed vector).
        seeds = tf.stack([tf.fill(tf.shape(epoch), tf.constant(seed, tf.int64)), epoch, tf.zeros_like(epoch)], axis=-1)
        index = tf.raw_ops.RandomIndexShuffle(index=positions % num, seed=seeds, max_index=num - 1, rounds=4)
        return tf.gather(train_ids, index)

    mosaic = _mosaic_schedule(config)
    mask_grid_hw = batch_layout.training_mask_grid(config.input)

    def decode(serialized):
        return _decode(serialized, with_masks=mask_grid_hw is not None)

    def transform(serialized, position):
        example_seed = tf.stack([tf.constant(seed, tf.int64), position])
        if mosaic is None:
            return transforms.train_transform(decode(serialized), example_seed, opts)
        return tf.cond(
            mosaic.uses(position),
            lambda: transforms.mosaic_transform([decode(serialized[i]) for i in range(4)], example_seed, opts),
            lambda: transforms.train_transform(decode(serialized[0]), example_seed, opts),
        )

    def partners_of_position(positions):
        def partners(position):
            drawn = tf.random.stateless_uniform([3], mosaic.partner_seed(position), 0, num, dtype=tf.int64)
            return tf.where(mosaic.uses(position), tf.gather(train_ids, drawn), -tf.ones([3], tf.int64))

        return tf.map_fn(partners, positions, fn_output_signature=tf.TensorSpec([3], tf.int64))

    positions = _local_positions(int(start_position), int(config.global_batch_size), first_row, batch, None)
    return _build(
        config,
        positions,
        record_of_position,
        split.open_reader(),
        transform,
        batch,
        opts.training_image_size,
        partners_of_position=None if mosaic is None else partners_of_position,
        mask_grid_hw=mask_grid_hw,
    )


@dataclasses.dataclass(frozen=True)
class _MosaicSchedule:
    """Which training positions are 2 x 2 mosaics (`transforms.mosaic_transform`): a pure function of the position.

    Positions before `until_position` are, each with `probability`; the
    draw and the partners' draw use `seed`, apart from the example's own.
    """

    probability: float
    until_position: int
    seed: int

    def uses(self, position: tf.Tensor) -> tf.Tensor:
        drawn = tf.random.stateless_uniform([], tf.stack([tf.constant(self.seed, tf.int64), position]))
        return (position < self.until_position) & (drawn < self.probability)

    def partner_seed(self, position: tf.Tensor) -> tf.Tensor:
        """The stateless seed of the three partners' draw at `position`."""
        return tf.stack([tf.constant(self.seed + 1, tf.int64), position])


def _mosaic_schedule(config) -> _MosaicSchedule | None:
    """`input.mosaic_probability` and `input.mosaic_until` checked; None when no position is a mosaic."""
    probability, until = float(config.input.mosaic_probability), float(config.input.mosaic_until)
    for name, value in (("mosaic_probability", probability), ("mosaic_until", until)):
        if not 0.0 <= value <= 1.0:  # Also rejects NaN.
            raise DatasetError(f"input.{name} must be in [0, 1], got {value}")
    until_position = round(until * int(config.total_steps)) * int(config.global_batch_size)
    if probability == 0.0 or until_position == 0:
        return None
    # One more seed, derived from the run's: the schedule's draws are not the transforms' (seed, position) stream.
    return _MosaicSchedule(probability, until_position, int(config.seed) ^ 0x4D4F53)


def eval_dataset(
    config, *, first_row: int | None = None, process_count: int | None = None
) -> tuple[tf.data.Dataset, int]:
    """Finite eval dataset of this process's rows and the number of batches.

    Every process returns the same number of batches,
    ceil(num_eval_examples / global_batch_size); positions past the split are
    masked padding (example_mask False, image_id -1, labels -1).
    """
    first_row, batch = _rows(config, first_row, process_count)
    split = datasets.prepare_split(config, datasets.EVAL)
    num_batches = math.ceil(split.num_records / int(config.global_batch_size))
    num = split.num_records
    opts = transforms.TransformOptions.from_config(config)

    def record_of_position(positions):
        return tf.where(positions < num, positions, -tf.ones_like(positions))

    positions = _local_positions(0, int(config.global_batch_size), first_row, batch, num_batches)
    ds = _build(
        config,
        positions,
        record_of_position,
        split.open_reader(),
        lambda serialized, position: transforms.eval_transform(_decode(serialized), opts),
        batch,
        opts.image_size,
    )
    return ds, num_batches


class InputCounts:
    """Running counts of what the pipeline masked or cut, per process.

    Attributes:
      examples: examples yielded (padding excluded).
      counts: Counter with decode_failed (images that could not be decoded and
        were masked) and boxes_truncated (images with more boxes than max_boxes).
    """

    def __init__(self):
        self.examples = 0
        self.counts: collections.Counter = collections.Counter()

    def take(self, batch: Batch) -> Batch:
        """Removes and counts the REPORT_KEYS of `batch`; returns the rest."""
        padding = (batch["image_id"] < 0) & ~batch["decode_failed"]
        self.examples += int(np.sum(~padding))
        for key in REPORT_KEYS:
            self.counts[key] += int(np.sum(batch[key]))
        return {k: v for k, v in batch.items() if k not in REPORT_KEYS}


class TrainIterator:
    """This process's training batches, with the stream position and counts.

    Attributes:
      position: global examples consumed after the last batch yielded (what a
        checkpoint records to resume exactly).
      input_counts: InputCounts of the batches yielded.
    """

    def __init__(self, config, *, start_position: int = 0, first_row: int | None = None):
        self._global_batch = int(config.global_batch_size)
        self._max_bad_fraction = float(config.input.max_bad_fraction)
        self.position = int(start_position)
        self.input_counts = InputCounts()
        ds = train_dataset(config, start_position=start_position, first_row=first_row)
        self._batches = _surfacing_dataset_errors(ds.as_numpy_iterator())

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        batch = self.input_counts.take(next(self._batches))
        self.position += self._global_batch
        seen = self.input_counts.examples
        failed = self.input_counts.counts["decode_failed"]
        if seen >= _MIN_EXAMPLES_FOR_BAD_CHECK and failed > self._max_bad_fraction * seen:
            raise DatasetError(
                f"{failed} of the {seen} training images read so far could not be decoded "
                "(corrupt or truncated files); fix the data or raise "
                f"input.max_bad_fraction (now {self._max_bad_fraction})"
            )
        return batch


def create_train_iterator(config, *, start_position: int = 0, first_row: int | None = None) -> TrainIterator:
    """Endless iterator of this process's training batches (numpy dicts).

    Args:
      config: the trainer config.
      start_position: global examples already consumed (resuming a run).
      first_row: first global-batch row this process holds (see train_dataset).
    """
    return TrainIterator(config, start_position=start_position, first_row=first_row)


class EvalIterator(NamedTuple):
    """create_eval_iterator() result; unpacks as (batches, num_batches).

    Attributes:
      batches: iterator over exactly num_batches numpy batches.
      num_batches: same on every process.
      input_counts: InputCounts, filled while `batches` is consumed.
    """

    batches: Iterator[Batch]
    num_batches: int
    input_counts: InputCounts


def with_batch_size(config, batch_size: int):
    """A copy of `config` whose pipelines batch by `batch_size` images.

    The iterators read `global_batch_size`; evaluation at `eval_batch_size` or
    prediction at any size go through a copy with both set to `batch_size`.
    """
    derived = ml_collections.ConfigDict(config.to_dict())
    derived.global_batch_size = derived.eval_batch_size = int(batch_size)
    return derived


def create_eval_iterator(config, *, first_row: int | None = None) -> EvalIterator:
    """One pass over the eval split, every example exactly once over processes.

    Usage: `batches, num_batches, _ = create_eval_iterator(config)`. Call it
    again for the next evaluation.
    """
    ds, num_batches = eval_dataset(config, first_row=first_row)
    counts = InputCounts()
    batches = (counts.take(b) for b in _surfacing_dataset_errors(ds.as_numpy_iterator()))
    return EvalIterator(batches, num_batches, counts)
