"""The batch: its keys, dtypes and shapes, defined once for whoever makes or reads one.

A batch of B examples is a dict of arrays, each the example's array with B in
front. (H, W) is `input.image_size` and M is `input.max_boxes`:

  key            dtype    shape          meaning (units)                         empty example
  image          uint8    [B, H, W, 3]   RGB pixels (0-255), image top-left      0
  image_hw       int32    [B, 2]         (h, w) of the network image, pixels     0
  source_hw      int32    [B, 2]         (h, w) of the pixels in `image`         0
  source_to_image float32 [B, 4]         scale_y, scale_x, offset_y, offset_x    1
  source_flipped bool     [B]            mirror `image` left-right first         False
  boxes          float32  [B, M, 4]      y0, x0, y1, x1, network-input pixels    0
  labels         int32    [B, M]         contiguous class labels, -1 = padding   -1
  boxes_mask     bool     [B, M]         True for a real box                     False
  image_id       int32    [B]            source image id, -1 = no image          -1
  scale          float32  [B]            network-input px per original px        1 (safe to divide by)
  original_size  int32    [B, 2]         (h, w) of the original image, pixels    0
  example_mask   bool     [B]            False for padding and undecodable ones  False

Training batches of a config with input.mask_stride = s > 0 add each box's
mask in the network geometry, one cell per s x s network pixels
((Hm, Wm) = ceil((H, W) / s), `mask_grid`), 8 cells to a byte along a row
(numpy's packbits order; `input_pipeline.masks`):

  masks          uint8    [B, M, Hm, ceil(Wm / 8)]  the cells, bit-packed    0
  masks_valid    bool     [B, M]         True where the box has a mask       False

A box without a mask (a box-only image or dataset, a dropped bad mask)
trains its box alone.

Images travel as uint8, a quarter of float32's host-to-device bytes; the
jitted steps normalise them on the device with input.mean_rgb/std_rgb, where
everything outside the top-left image_hw is padding and becomes 0 (the mean
colour after normalisation), whatever its bytes hold.

`image` holds the network image itself (source_hw = image_hw, geometry the
identity: scale 1, offset 0, not flipped), except in training batches with
input.resize_on_device: there it holds the source pixels a crop window
samples (source_hw of them at the top-left), and the train step resamples
them into the network image (a network-image coordinate is the source
coordinate, mirrored first if source_flipped, times scale plus offset;
`detector.ops.images.resample_images`). Those training batches' `image` is
`training_image_size(input_config)`, which input.source_size can make
larger than the network input, so larger sources still fit.

The input pipeline yields one per process (B = global_batch_size // process
count), benchmarks make random ones, and the jitted steps are compiled for
`abstract_batch`. The empty example is what stands in for an undecodable
image or pads the last eval batch.

Imports numpy only (JAX inside abstract_batch): benchmarks' PyTorch worker
builds batches from this table without loading JAX or TensorFlow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class Field:
    """One key of the batch.

    Attributes:
      dtype: numpy dtype of the arrays.
      example_shape: (image_size (H, W) pixels, max_boxes) -> shape of one
        example's array (the batch adds B in front).
      empty: the value every element takes in an empty, masked example.
    """

    dtype: np.dtype
    example_shape: Callable[[tuple[int, int], int], tuple[int, ...]]
    empty: bool | int | float


FIELDS: dict[str, Field] = {
    "image": Field(np.dtype(np.uint8), lambda image_size, max_boxes: (*image_size, 3), 0),
    "image_hw": Field(np.dtype(np.int32), lambda image_size, max_boxes: (2,), 0),
    "source_hw": Field(np.dtype(np.int32), lambda image_size, max_boxes: (2,), 0),
    "source_to_image": Field(np.dtype(np.float32), lambda image_size, max_boxes: (4,), 1.0),
    "source_flipped": Field(np.dtype(np.bool_), lambda image_size, max_boxes: (), False),
    "boxes": Field(np.dtype(np.float32), lambda image_size, max_boxes: (max_boxes, 4), 0.0),
    "labels": Field(np.dtype(np.int32), lambda image_size, max_boxes: (max_boxes,), -1),
    "boxes_mask": Field(np.dtype(np.bool_), lambda image_size, max_boxes: (max_boxes,), False),
    "image_id": Field(np.dtype(np.int32), lambda image_size, max_boxes: (), -1),
    "scale": Field(np.dtype(np.float32), lambda image_size, max_boxes: (), 1.0),
    "original_size": Field(np.dtype(np.int32), lambda image_size, max_boxes: (2,), 0),
    "example_mask": Field(np.dtype(np.bool_), lambda image_size, max_boxes: (), False),
}
KEYS = tuple(FIELDS)
MASK_FIELDS: dict[str, Field] = {
    "masks": Field(np.dtype(np.uint8), lambda image_size, max_boxes: (max_boxes, *image_size), 0),
    "masks_valid": Field(np.dtype(np.bool_), lambda image_size, max_boxes: (max_boxes,), False),
}


def mask_grid(image_size: Sequence[int], mask_stride: int) -> tuple[int, int]:
    """(Hm, Wm) mask cells of a network image of `image_size` (H, W) pixels at `mask_stride` pixels per cell."""
    return tuple(-(-int(v) // int(mask_stride)) for v in image_size)


def training_mask_grid(input_config) -> tuple[int, int] | None:
    """(Hm, Wm) of the masks of training batches (`input.image_size` at `input.mask_stride`), None without masks."""
    if not input_config.mask_stride:
        return None
    return mask_grid(input_config.image_size, input_config.mask_stride)


# source_to_image of pixels that already are the network image (scale 1, offset 0).
IDENTITY_GEOMETRY = (1.0, 1.0, 0.0, 0.0)


def training_image_size(input_config) -> tuple[int, int]:
    """(H, W) of the `image` of training batches: `input.source_size` with `input.resize_on_device` if set, else
    `input.image_size` (what every other batch holds)."""
    image_size = tuple(int(v) for v in input_config.image_size)
    if not input_config.resize_on_device or input_config.source_size is None:
        return image_size
    return tuple(int(v) for v in input_config.source_size)


class ArraySpec(NamedTuple):
    """Shape and dtype of one array of a batch or an example."""

    shape: tuple[int, ...]
    dtype: np.dtype


def example_spec(
    image_size: Sequence[int], max_boxes: int, mask_grid_hw: Sequence[int] | None = None
) -> dict[str, ArraySpec]:
    """Shape and dtype of each key of one example (no batch dimension).

    Args:
      image_size: (H, W) network input, pixels.
      max_boxes: boxes per example after padding.
      mask_grid_hw: (Hm, Wm) mask cells per box, None for an example without masks.
    """
    height, width = (int(v) for v in image_size)
    spec = {
        key: ArraySpec(field.example_shape((height, width), int(max_boxes)), field.dtype)
        for key, field in FIELDS.items()
    }
    if mask_grid_hw is not None:
        packed = (int(mask_grid_hw[0]), -(-int(mask_grid_hw[1]) // 8))
        spec.update(
            {
                key: ArraySpec(field.example_shape(packed, int(max_boxes)), field.dtype)
                for key, field in MASK_FIELDS.items()
            }
        )
    return spec


def batch_spec(
    batch_size: int, image_size: Sequence[int], max_boxes: int, mask_grid_hw: Sequence[int] | None = None
) -> dict[str, ArraySpec]:
    """Shape and dtype of each key of a batch of `batch_size` examples: the example's shapes with B in front."""
    return {
        key: ArraySpec((int(batch_size), *spec.shape), spec.dtype)
        for key, spec in example_spec(image_size, max_boxes, mask_grid_hw).items()
    }


def abstract_batch(
    global_batch_size: int,
    image_size: Sequence[int],
    max_boxes: int,
    sharding: Any = None,
    mask_grid_hw: Sequence[int] | None = None,
) -> dict[str, Any]:
    """One global batch as `jax.ShapeDtypeStruct`s (what the steps are compiled for).

    Args:
      global_batch_size: examples per global batch, B.
      image_size: (H, W) network input, pixels.
      max_boxes: boxes per example, M.
      sharding: the `jax.sharding.Sharding` every array carries (the batch
        sharding, dim 0 over the data axes), or None.
      mask_grid_hw: (Hm, Wm) mask cells per box, None for a batch without masks.
    """
    import jax  # Here, not above: numpy-only users of the table never load JAX.

    return {
        key: jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding)
        for key, spec in batch_spec(global_batch_size, image_size, max_boxes, mask_grid_hw).items()
    }


def empty_example(
    image_size: Sequence[int],
    max_boxes: int,
    full: Callable[[tuple[int, ...], Any, np.dtype], Any] = np.full,
    mask_grid_hw: Sequence[int] | None = None,
) -> dict[str, Any]:
    """An example with no image and no boxes, masked out (example_mask False, image_id -1, labels -1).

    Args:
      image_size: (H, W) network input, pixels.
      max_boxes: boxes per example.
      full: `(shape, value, dtype) -> array`; numpy's by default. A tf.data
        graph passes a `tf.fill` wrapper: a constant the size of an image
        would be stored in the graph.
      mask_grid_hw: (Hm, Wm) mask cells per box, None for an example without masks.
    """
    fields = {**FIELDS, **MASK_FIELDS}
    return {
        key: full(spec.shape, fields[key].empty, spec.dtype)
        for key, spec in example_spec(image_size, max_boxes, mask_grid_hw).items()
    }
