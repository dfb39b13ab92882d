"""The one record format every dataset is converted to, and its parser.

Every source (the synthetic dataset, TFDS `coco/2017` and `voc`, COCO-format
folders) is converted once into records of this format (see
`input_pipeline/datasets/cache.py`), so one random-access reader and one
parser serve them all.

A record is a serialized `tf.train.Example`:
  image     bytes     the encoded image file, unchanged (JPEG, PNG, ...)
  image_id  int64     the dataset's image id (what evaluation files use)
  height    int64     pixels of the encoded image
  width     int64
  boxes     float32   [4 n] flattened y0, x0, y1, x1 in absolute pixels of the
                      encoded image, already clipped to it and non-empty
  labels    int64     [n] contiguous class labels 0..num_classes-1
  is_crowd  int64     [n] 1 for regions to ignore (COCO crowd, VOC difficult):
                      kept for evaluation, dropped from training targets
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class SourceExample:
    """One image with its annotations, as a source yields it (host-side numpy).

    Attributes:
      image_bytes: the encoded image file, unchanged.
      image_id: the dataset's id of the image.
      height, width: pixels of the encoded image.
      boxes_yxyx: float32 [n, 4] absolute pixels, clipped to the image, every box
        with positive height and width.
      labels: int32 [n] contiguous labels.
      is_crowd: bool [n], regions to ignore.
    """

    image_bytes: bytes
    image_id: int
    height: int
    width: int
    boxes_yxyx: np.ndarray
    labels: np.ndarray
    is_crowd: np.ndarray


def _int64(values) -> tf.train.Feature:
    return tf.train.Feature(int64_list=tf.train.Int64List(value=[int(v) for v in values]))


def serialize(example: SourceExample) -> bytes:
    """SourceExample -> serialized tf.train.Example bytes (see module doc)."""
    boxes = np.asarray(example.boxes_yxyx, np.float32).reshape(-1, 4)
    labels = np.asarray(example.labels, np.int64).reshape(-1)
    crowd = np.asarray(example.is_crowd, bool).reshape(-1)
    if not len(boxes) == len(labels) == len(crowd):
        raise ValueError(
            f"image {example.image_id}: {len(boxes)} boxes, {len(labels)} labels "
            f"and {len(crowd)} crowd flags must have the same length"
        )
    feature = {
        "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[example.image_bytes])),
        "image_id": _int64([example.image_id]),
        "height": _int64([example.height]),
        "width": _int64([example.width]),
        "boxes": tf.train.Feature(float_list=tf.train.FloatList(value=boxes.reshape(-1).tolist())),
        "labels": _int64(labels),
        "is_crowd": _int64(crowd.astype(np.int64)),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


_FEATURES = {
    "image": tf.io.FixedLenFeature([], tf.string),
    "image_id": tf.io.FixedLenFeature([], tf.int64),
    "height": tf.io.FixedLenFeature([], tf.int64),
    "width": tf.io.FixedLenFeature([], tf.int64),
    "boxes": tf.io.VarLenFeature(tf.float32),
    "labels": tf.io.VarLenFeature(tf.int64),
    "is_crowd": tf.io.VarLenFeature(tf.int64),
}


def parse(serialized: tf.Tensor) -> dict[str, tf.Tensor]:
    """Serialized record -> tensors (TF graph; the image stays encoded).

    Returns:
      {'image': string [], 'image_id': int64 [], 'height', 'width': int64 [],
       'boxes': float32 [n, 4], 'labels': int32 [n], 'is_crowd': bool [n]}.
    """
    parsed = tf.io.parse_single_example(serialized, _FEATURES)
    return {
        "image": parsed["image"],
        "image_id": parsed["image_id"],
        "height": parsed["height"],
        "width": parsed["width"],
        "boxes": tf.reshape(tf.sparse.to_dense(parsed["boxes"]), [-1, 4]),
        "labels": tf.cast(tf.sparse.to_dense(parsed["labels"]), tf.int32),
        "is_crowd": tf.cast(tf.sparse.to_dense(parsed["is_crowd"]), tf.bool),
    }


def parse_numpy(serialized: bytes) -> SourceExample:
    """Host-side inverse of serialize() (tests, ground truth, tools)."""
    ex = tf.train.Example.FromString(serialized).features.feature
    return SourceExample(
        image_bytes=ex["image"].bytes_list.value[0],
        image_id=int(ex["image_id"].int64_list.value[0]),
        height=int(ex["height"].int64_list.value[0]),
        width=int(ex["width"].int64_list.value[0]),
        boxes_yxyx=np.asarray(ex["boxes"].float_list.value, np.float32).reshape(-1, 4),
        labels=np.asarray(ex["labels"].int64_list.value, np.int32),
        is_crowd=np.asarray(ex["is_crowd"].int64_list.value, bool),
    )
