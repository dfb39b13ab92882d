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
  mask_runs int64     [n] (optional) runs of each box's mask in mask_run_lengths,
                      0 for a box without a mask
  mask_run_lengths    int64 [sum(mask_runs)] (optional) each mask's COCO RLE
                      run lengths over the encoded image (column-major, zeros
                      first), one mask after another (`input_pipeline.masks`)

Records of box-only datasets have no mask features and parse as boxes
without masks.

serialize() writes the protocol buffer's bytes itself, without TensorFlow
(tf.train.Example parses them; about as fast as TensorFlow's serializer):
conversion worker processes then start in a fraction of a second and about
100 MB instead of the 6 s and 650 MB that importing TensorFlow costs each of
them. TensorFlow loads on the first parse.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
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
      mask_runs: None (no masks), or int64 [n] the number of runs of each
        box's mask, 0 for a box without one.
      mask_run_lengths: None, or int64 [sum(mask_runs)] the masks' COCO RLE
        run lengths over the height x width image, one after another.
    """

    image_bytes: bytes
    image_id: int
    height: int
    width: int
    boxes_yxyx: np.ndarray
    labels: np.ndarray
    is_crowd: np.ndarray
    mask_runs: np.ndarray | None = None
    mask_run_lengths: np.ndarray | None = None


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _varint(value: int) -> bytes:
    """Protocol-buffer varint of an int64 (a negative one as its 64-bit two's complement, 10 bytes)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _length_delimited(field_number: int, payload: bytes) -> bytes:
    return _varint(field_number << 3 | 2) + _varint(len(payload)) + payload


# Feature's oneof field numbers: bytes_list, float_list, int64_list.
_BYTES, _FLOATS, _INT64S = 1, 2, 3


def _feature(key: str, kind: int, values: bytes) -> bytes:
    """One entry of Features.feature (map<string, Feature>).

    `values` is the list message's field 1: the one value of a BytesList, or
    the packed values of a FloatList or Int64List (left out when empty).
    """
    feature = _length_delimited(kind, _length_delimited(1, values) if values or kind == _BYTES else b"")
    return _length_delimited(1, _length_delimited(1, key.encode()) + _length_delimited(2, feature))


def _int64s(values) -> bytes:
    ints = [int(v) for v in values]
    if any(not _INT64_MIN <= v <= _INT64_MAX for v in ints):
        raise ValueError(f"{ints} does not fit in int64")
    return b"".join(_varint(v) for v in ints)


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
    mask_features = []
    if example.mask_runs is not None:
        runs = np.asarray(example.mask_runs, np.int64).reshape(-1)
        run_lengths = np.asarray(example.mask_run_lengths, np.int64).reshape(-1)
        if len(runs) != len(boxes) or runs.sum() != len(run_lengths):
            raise ValueError(
                f"image {example.image_id}: {len(runs)} mask run counts for {len(boxes)} boxes, summing to "
                f"{runs.sum()} for {len(run_lengths)} run lengths"
            )
        mask_features = [
            _feature("mask_runs", _INT64S, _int64s(runs.tolist())),
            _feature("mask_run_lengths", _INT64S, _int64s(run_lengths.tolist())),
        ]
    features = b"".join(
        [
            _feature("image", _BYTES, bytes(example.image_bytes)),
            _feature("image_id", _INT64S, _int64s([example.image_id])),
            _feature("height", _INT64S, _int64s([example.height])),
            _feature("width", _INT64S, _int64s([example.width])),
            _feature("boxes", _FLOATS, boxes.astype("<f4").tobytes()),
            _feature("labels", _INT64S, _int64s(labels.tolist())),
            _feature("is_crowd", _INT64S, crowd.astype(np.uint8).tobytes()),  # varints of 0 and 1 are those bytes
            *mask_features,
        ]
    )
    return _length_delimited(1, features)


def _features() -> dict:
    import tensorflow as tf

    return {
        "image": tf.io.FixedLenFeature([], tf.string),
        "image_id": tf.io.FixedLenFeature([], tf.int64),
        "height": tf.io.FixedLenFeature([], tf.int64),
        "width": tf.io.FixedLenFeature([], tf.int64),
        "boxes": tf.io.VarLenFeature(tf.float32),
        "labels": tf.io.VarLenFeature(tf.int64),
        "is_crowd": tf.io.VarLenFeature(tf.int64),
        "mask_runs": tf.io.VarLenFeature(tf.int64),
        "mask_run_lengths": tf.io.VarLenFeature(tf.int64),
    }


def parse(serialized: tf.Tensor, *, with_masks: bool = False) -> dict[str, tf.Tensor]:
    """Serialized record -> tensors (TF graph; the image stays encoded).

    Returns:
      {'image': string [], 'image_id': int64 [], 'height', 'width': int64 [],
       'boxes': float32 [n, 4], 'labels': int32 [n], 'is_crowd': bool [n]};
      `with_masks` adds 'mask_run_lengths': int64 RaggedTensor [n, (runs)],
      no runs for a box without a mask (every box of a box-only record).
    """
    import tensorflow as tf

    features = _features()
    if not with_masks:
        del features["mask_runs"], features["mask_run_lengths"]
    parsed = tf.io.parse_single_example(serialized, features)
    masks = {}
    if with_masks:
        runs = tf.sparse.to_dense(parsed["mask_runs"])
        boxes = tf.shape(parsed["labels"].values)[0]
        runs = tf.pad(runs, [[0, boxes - tf.shape(runs)[0]]])  # a box-only record: no runs for any box
        run_lengths = tf.sparse.to_dense(parsed["mask_run_lengths"])
        masks["mask_run_lengths"] = tf.RaggedTensor.from_row_lengths(run_lengths, runs)
    return {
        **masks,
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
    import tensorflow as tf

    ex = tf.train.Example.FromString(serialized).features.feature
    with_masks = "mask_runs" in ex
    return SourceExample(
        image_bytes=ex["image"].bytes_list.value[0],
        image_id=int(ex["image_id"].int64_list.value[0]),
        height=int(ex["height"].int64_list.value[0]),
        width=int(ex["width"].int64_list.value[0]),
        boxes_yxyx=np.asarray(ex["boxes"].float_list.value, np.float32).reshape(-1, 4),
        labels=np.asarray(ex["labels"].int64_list.value, np.int32),
        is_crowd=np.asarray(ex["is_crowd"].int64_list.value, bool),
        mask_runs=np.asarray(ex["mask_runs"].int64_list.value, np.int64) if with_masks else None,
        mask_run_lengths=np.asarray(ex["mask_run_lengths"].int64_list.value, np.int64) if with_masks else None,
    )
