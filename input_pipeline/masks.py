"""Instance masks on the host: COCO RLE run lengths in, network-geometry bitmaps at the mask stride out.

A record keeps each instance's mask as the run lengths of its COCO RLE over
the encoded image (column-major, the first run counting zeros, as
pycocotools' uncompressed `counts`): no per-pixel array is ever stored, and
a COCO instance takes a few hundred bytes. Training rasterises them straight
into the network geometry (after flip, scale jitter and crop) at the mask
stride, one sample per output cell at its centre: a cell is set when the
source pixel under its centre is, so a mask's cells cover its transformed box
to within one cell. The lookup is a binary search of each cell's column-major
source index in the cumulative run lengths, so the cost is cells x log(runs)
per instance and nothing of source resolution is materialised (a 1024 px
COCO image would otherwise hold ~1 MB per instance before downsampling).

The bitmaps travel to the device 8 cells to a byte (`pack_bits`; the device
unpacks them): a 1024 px image with 100 instances at stride 4 is 0.8 MB
instead of 6.6 MB of booleans.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import tensorflow as tf


def run_lengths_from_string(counts: str | bytes) -> np.ndarray:
    """COCO's compressed RLE `counts` string -> int64 [runs] run lengths (pycocotools' rleFrString).

    Each run is a little-endian base-32 number, 5 bits to a character offset
    by 48, bit 0x20 saying another character follows and bit 0x10 of the last
    one its sign; from the third run on a number is the difference to the run
    two before. Vectorised over the characters: COCO's 860k instances decode
    in seconds, not the minutes of a per-character loop.
    """
    codes = np.frombuffer(counts.encode("ascii") if isinstance(counts, str) else bytes(counts), np.uint8)
    if codes.size == 0:
        return np.zeros([0], np.int64)
    values = codes.astype(np.int64) - 48
    if values.min() < 0 or values.max() > 63:
        raise ValueError("an RLE counts string holds characters outside COCO's '0'..'o' alphabet")
    last = (values & 0x20) == 0
    if not last[-1]:
        raise ValueError("an RLE counts string ends inside a number")
    starts = np.flatnonzero(np.concatenate([[True], last[:-1]]))
    position = np.arange(values.size) - np.repeat(starts, np.diff(np.append(starts, values.size)))
    if position.max() > 12:
        raise ValueError("an RLE counts string holds a number longer than 64 bits")
    numbers = np.add.reduceat((values & 0x1F) << (5 * position), starts)
    lengths = np.diff(np.append(starts, values.size))
    negative = (values[last] & 0x10) != 0
    numbers[negative] -= np.left_shift(np.int64(1), 5 * lengths[negative])
    runs = numbers.copy()
    runs[1::2] = np.cumsum(numbers[1::2])  # each run after the third adds the one two before
    runs[2::2] = np.cumsum(numbers[2::2])
    if (runs < 0).any():
        raise ValueError("an RLE counts string decodes to a negative run length")
    return runs


def run_lengths_of_mask(mask: np.ndarray) -> np.ndarray:
    """bool [h, w] -> int64 [runs] its COCO RLE run lengths (column-major, the first run counting zeros)."""
    flat = np.asarray(mask, bool).reshape(-1, order="F")
    changes = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    edges = np.concatenate([[0], changes, [flat.size]])
    run_lengths = np.diff(edges).astype(np.int64)
    return np.concatenate([[0], run_lengths]) if flat.size and flat[0] else run_lengths


def run_lengths_to_string(run_lengths: np.ndarray) -> bytes:
    """int [runs] run lengths -> COCO's compressed `counts` string (pycocotools' rleToString), for small masks.

    The inverse of `run_lengths_from_string`; a Python loop per run, meant for
    the embedded dataset's few objects per image (COCO's own strings come from
    its files or from hotcoco's polygon encoder).
    """
    out = bytearray()
    runs = [int(v) for v in run_lengths]
    for i, run in enumerate(runs):
        value = run - runs[i - 2] if i > 2 else run
        more = True
        while more:
            code = value & 0x1F
            value >>= 5
            more = value != -1 if code & 0x10 else value != 0
            out.append((code | 0x20 if more else code) + 48)
    return bytes(out)


def network_sample_grid(
    original_hw: tf.Tensor,
    axis_scale: tf.Tensor,
    offset_yx: tf.Tensor,
    window_hw: tf.Tensor,
    flipped: tf.Tensor,
    grid_hw: tuple[int, int],
    stride: int,
) -> tuple[tf.Tensor, tf.Tensor]:
    """The original pixel under each mask cell's centre, per axis (the geometry is separable).

    A network pixel (y, x) shows the original's ((y + offset_y) / scale_y,
    (x + offset_x) / scale_x), mirrored first (x -> w - x) when `flipped`; the
    network image holds pixels only in its top-left `window_hw`.

    Args:
      original_hw: int32 [2] (h, w) of the original image, pixels.
      axis_scale: float32 [2] network pixels per original pixel, per axis.
      offset_yx: int32 or float32 [2] network pixels cropped off the top-left of the scaled image.
      window_hw: int32 [2] (h, w) of the network image holding pixels.
      flipped: bool [] whether the original was mirrored left-right first.
      grid_hw: (Ho, Wo) cells of the mask grid.
      stride: network pixels per mask cell.

    Returns:
      (rows int32 [Ho], columns int32 [Wo]): the original row and column
      under each cell's centre, -1 where the centre shows no pixel (padding).
    """
    import tensorflow as tf

    offset = tf.cast(offset_yx, tf.float32)
    window = tf.cast(window_hw, tf.float32)

    def axis(cells, index, mirrored):
        centres = (tf.range(cells, dtype=tf.float32) + 0.5) * float(stride)
        source = (centres + offset[index]) / axis_scale[index]
        size = tf.cast(original_hw[index], tf.float32)
        if mirrored is not None:
            source = tf.where(mirrored, size - source, source)
        pixel = tf.cast(tf.floor(source), tf.int32)
        inside = (centres < window[index]) & (pixel >= 0) & (pixel < original_hw[index])
        return tf.where(inside, pixel, -1)

    return axis(grid_hw[0], 0, None), axis(grid_hw[1], 1, flipped)


def sample_masks(run_lengths: tf.RaggedTensor, image_height: tf.Tensor, rows: tf.Tensor, columns: tf.Tensor):
    """Each instance's mask at the given original rows x columns.

    Args:
      run_lengths: int64 RaggedTensor [n, (runs)], COCO RLE run lengths over
        an image `image_height` rows tall (column-major, zeros first).
      image_height: int [] rows of the image the RLE covers.
      rows: int32 [Ho] original row per output row, -1 for none.
      columns: int32 [Wo] original column per output column, -1 for none.

    Returns:
      bool [n, Ho, Wo].
    """
    import tensorflow as tf

    # [n, R]: zero-length padding runs repeat the total, which is past every index.
    ends = tf.math.cumsum(run_lengths.to_tensor(), axis=1)
    index = tf.cast(columns, tf.int64)[None, :] * tf.cast(image_height, tf.int64) + tf.cast(rows, tf.int64)[:, None]
    queries = tf.tile(tf.reshape(index, [1, -1]), [tf.shape(ends)[0], 1])
    run = tf.searchsorted(ends, queries, side="right")  # the run holding each index: odd runs are ones
    inside = tf.reshape((rows[:, None] >= 0) & (columns[None, :] >= 0), [1, -1])
    cells = (run % 2 == 1) & inside
    return tf.reshape(cells, [-1, tf.shape(rows)[0], tf.shape(columns)[0]])


def packed_width(width: int) -> int:
    """Bytes per packed row of `width` cells."""
    return -(-width // 8)


def pack_bits(masks: tf.Tensor) -> tf.Tensor:
    """bool [..., W] -> uint8 [..., ceil(W / 8)], the first cell in the high bit (numpy's packbits order)."""
    import tensorflow as tf

    width = masks.shape[-1]
    padded = tf.pad(
        tf.cast(masks, tf.uint8), [[0, 0]] * (masks.shape.rank - 1) + [[0, packed_width(width) * 8 - width]]
    )
    octets = tf.reshape(padded, tf.concat([tf.shape(padded)[:-1], [packed_width(width), 8]], 0))
    weights = tf.constant([128, 64, 32, 16, 8, 4, 2, 1], tf.uint8)
    return tf.reduce_sum(octets * weights, axis=-1)


def run_lengths_from_segmentation(segmentation: Any, height: int, width: int) -> tuple[np.ndarray | None, str | None]:
    """A COCO annotation's `segmentation` -> (int64 [runs] run lengths over the height x width image, problem).

    Polygons (one or more parts, [x0, y0, x1, y1, ...] in pixels) are filled
    and merged as pycocotools' annToRLE does (hotcoco's encoder, the same
    rasterisation); RLE, compressed (`counts` a string) or not (a list, as
    COCO's crowd regions), is taken as it is. Returns (None, None) for an
    annotation without a segmentation (a box-only dataset), and (None, key)
    for one that cannot give a mask, the box then training alone:
    'invalid_mask' (a polygon part under 3 points or not numbers, a damaged
    RLE), 'mask_size_mismatch' (an RLE of another image size) or
    'empty_mask' (no pixel set).
    """
    import hotcoco

    if segmentation is None:
        return None, None
    if isinstance(segmentation, dict):
        size = segmentation.get("size")
        counts = segmentation.get("counts")
        if not (isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) for v in size)):
            return None, "invalid_mask"
        if size != [height, width]:
            return None, "mask_size_mismatch"
        if isinstance(counts, str):
            try:
                run_lengths = run_lengths_from_string(counts)
            except ValueError:
                return None, "invalid_mask"
        elif isinstance(counts, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in counts):
            run_lengths = np.asarray(counts, np.int64)
            if (run_lengths < 0).any():
                return None, "invalid_mask"
        else:
            return None, "invalid_mask"
        if run_lengths.sum() != height * width:
            return None, "invalid_mask"
    elif isinstance(segmentation, list):
        parts = []
        for part in segmentation:
            # JSON numbers only (a bool is an int to isinstance); inf and nan pass json's parser.
            numbers = isinstance(part, list) and all(type(v) in (int, float) and math.isfinite(v) for v in part)
            # pycocotools reads a 4-number "polygon" as a box: fewer than 3 points is refused instead.
            if not numbers or len(part) < 6 or len(part) % 2:
                return None, "invalid_mask"
            parts.append(part)
        if not parts:
            return None, "empty_mask"
        merged = hotcoco.mask.merge(hotcoco.mask.frPyObjects(parts, height, width))
        run_lengths = run_lengths_from_string(merged["counts"])
    else:
        return None, "invalid_mask"
    if not run_lengths[1::2].any():
        return None, "empty_mask"
    return run_lengths, None
