"""TFDS detection datasets (coco/2017, voc, synthetic_shapes) as SourceExamples.

Reads a prepared TFDS split once, in its deterministic file order, without
decoding images (the encoded bytes are copied as they are), and yields the
common SourceExample (input_pipeline/records.py). Every malformed record is
counted under one of these keys and handled as stated:

  images             records in the split
  usable_images      records yielded
  unreadable_image   image bytes whose header cannot be read: skipped
  invalid_record     objects/bbox and objects/label (or objects' masks) of
                     different lengths: skipped
  invalid_mask       an object's RLE string that is damaged or not the
                     image's size: the box kept without a mask
  invalid_box        box with a NaN coordinate: dropped
  empty_box          box with zero or negative height or width: dropped
  clipped_box        box partly outside the image: clipped to it
  outside_box        box with nothing left inside the image: dropped
  unknown_category   label outside 0..num_classes-1: dropped
  crowd_box          region to ignore (`is_crowd`, VOC `is_difficult`): kept,
                     flagged; excluded from training targets
  no_annotations     images without any box left (kept as negatives)
  converted_*        images the decoder converts to 8-bit RGB (grayscale,
                     16-bit, alpha, palette, CMYK)
"""

from __future__ import annotations

import collections
import dataclasses
import io
from collections.abc import Iterator

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
from PIL import Image

from input_pipeline import masks, records
from input_pipeline.datasets import box_checks


@dataclasses.dataclass(frozen=True)
class TfdsLayout:
    """Where a TFDS detection dataset keeps what the records need.

    Attributes:
      image_id_key: top-level feature holding the image id, or None to number
        the split's records 1, 2, ... in file order (VOC has no ids).
      ignore_key: boolean `objects` feature marking regions to ignore, or None.
      mask_key: text `objects` feature holding each object's mask as COCO's
        compressed RLE `counts` over the image, or None (boxes only).
    """

    image_id_key: str | None
    ignore_key: str | None
    mask_key: str | None = None


def _read_split(builder: tfds.core.DatasetBuilder, split: str, layout: TfdsLayout) -> tf.data.Dataset:
    ds = builder.as_dataset(
        split=split,
        shuffle_files=False,
        decoders={"image": tfds.decode.SkipDecoding()},
        read_config=tfds.ReadConfig(try_autocache=False),
    )

    def select(example):
        objects = example["objects"]
        n = tf.shape(objects["label"])[0]
        ignore = tf.cast(objects[layout.ignore_key], tf.bool) if layout.ignore_key else tf.zeros([n], tf.bool)
        image_id = tf.cast(example[layout.image_id_key], tf.int64) if layout.image_id_key else tf.constant(-1, tf.int64)
        selected = {
            "image": example["image"],
            "image_id": image_id,
            "bbox": tf.reshape(tf.cast(objects["bbox"], tf.float32), [-1]),
            "label": tf.cast(objects["label"], tf.int64),
            "ignore": ignore,
        }
        if layout.mask_key:
            selected["rle"] = objects[layout.mask_key]
        return selected

    return ds.map(select, num_parallel_calls=tf.data.AUTOTUNE)


def iter_examples(
    builder: tfds.core.DatasetBuilder, split: str, layout: TfdsLayout, num_classes: int, counts: collections.Counter
) -> Iterator[records.SourceExample]:
    """The split's usable SourceExamples; updates `counts` (module doc).

    Opens the split now (a split that is not prepared fails here, before any
    output is written) and reads it as the iterator is consumed.
    """
    return _examples(_read_split(builder, split, layout), layout, num_classes, counts)


def _examples(
    ds: tf.data.Dataset, layout: TfdsLayout, num_classes: int, counts: collections.Counter
) -> Iterator[records.SourceExample]:
    for index, ex in enumerate(tfds.as_numpy(ds)):
        counts["images"] += 1
        image_bytes = bytes(ex["image"])
        try:
            with Image.open(io.BytesIO(image_bytes)) as image:
                width, height = image.size
                conversion = box_checks.conversion_key(image.mode, image.format)
        except Exception:  # noqa: BLE001  PIL plugins raise many types on garbage.
            counts["unreadable_image"] += 1
            continue
        flat = np.asarray(ex["bbox"], np.float32)
        labels = np.asarray(ex["label"], np.int64)
        ignore = np.asarray(ex["ignore"], bool)
        if flat.size != 4 * labels.size or ignore.size != labels.size:
            counts["invalid_record"] += 1
            continue
        if conversion:
            counts[conversion] += 1
        counts["annotations"] += labels.size
        # TFDS boxes are normalized y0, x0, y1, x1.
        scale = np.array([height, width, height, width], np.float64)
        rles = ex.get("rle")
        if rles is not None and len(rles) != labels.size:
            counts["invalid_record"] += 1
            continue
        boxes, kept_labels, crowd, run_lengths = [], [], [], []
        for i, (normalized, label, is_ignored) in enumerate(zip(flat.reshape(-1, 4), labels, ignore)):
            if not 0 <= label < num_classes:
                counts["unknown_category"] += 1
                continue
            key, box = box_checks.clip_box_yxyx(
                [float(v) for v in normalized.astype(np.float64) * scale], height, width
            )
            if key:
                counts[key] += 1
            if box is None:
                continue
            counts["crowd_box"] += int(is_ignored)
            boxes.append(box)
            kept_labels.append(label)
            crowd.append(is_ignored)
            if rles is not None:
                run_lengths.append(_mask_run_lengths(rles[i], height, width, counts))
        if not boxes:
            counts["no_annotations"] += 1
        counts["usable_images"] += 1
        image_id = int(ex["image_id"]) if layout.image_id_key else index + 1
        yield records.SourceExample(
            image_bytes=image_bytes,
            image_id=image_id,
            height=height,
            width=width,
            boxes_yxyx=np.asarray(boxes, np.float32).reshape(-1, 4),
            labels=np.asarray(kept_labels, np.int32),
            is_crowd=np.asarray(crowd, bool),
            mask_runs=None if rles is None else np.array([len(r) for r in run_lengths], np.int64),
            mask_run_lengths=None if rles is None else np.concatenate([np.zeros([0], np.int64), *run_lengths]),
        )


def _mask_run_lengths(rle: bytes, height: int, width: int, counts: collections.Counter) -> np.ndarray:
    """An object's mask as run lengths; none (the box trains alone) for a damaged string or another image size."""
    try:
        run_lengths = masks.run_lengths_from_string(rle)
    except ValueError:
        counts["invalid_mask"] += 1
        return np.zeros([0], np.int64)
    if run_lengths.sum() != height * width:
        counts["invalid_mask"] += 1
        return np.zeros([0], np.int64)
    return run_lengths
