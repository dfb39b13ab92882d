"""Instance masks from mask logits to COCO RLE in original pixels, on the host (Mask DINO's inference).

The network predicts each query's mask as logits at `mask_stride` over the
padded network image. Mask DINO (after Mask2Former and detectron2's
`sem_seg_postprocess`) upsamples them bilinearly to the padded network
size, crops the region the resized image fills, resizes that bilinearly to
the original image size (torch `F.interpolate(mode="bilinear",
align_corners=False)` both times, no antialiasing) and keeps the pixels
above 0. Both resizes and the crop are linear maps along each axis, so here
they are one [H, h] and one [W, w] matrix applied as two matrix products,
a few masks at a time: no full-resolution copy of every mask at once.
An original pixel depends on the two or three mask cells around it, so the
matrices are banded: each block of output pixels is multiplied with the
few cells its band spans only. For 160x160 logits pasted to 480x640 that
is a sixteenth of the dense products' multiply-adds (5x faster), in
products small enough that OpenBLAS runs them on the calling thread
instead of contending for cores with training.
"""

from __future__ import annotations

import math

import hotcoco
import numpy as np

from detector.serving.coco_ap import RleMasks

# Full-resolution pixels computed at once: their masks (a byte each) and the logits resized along one axis.
CHUNK_PIXELS = 1 << 24
# Output pixels per block of a banded product: 32 keeps the inner dimension near 10 cells when enlarging x4.
BAND_BLOCK = 32


def bilinear_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """torch's bilinear resize along one axis (align_corners=False, no antialias) as two taps per output pixel.

    Output pixel i samples the input at (i + 0.5) * in_size / out_size - 0.5,
    clamped at 0, as `torch.nn.functional.interpolate` does for a `size`
    without `scale_factor`.

    Returns:
      low, high: int64 [out_size] the input pixels it mixes (equal at the last one).
      high_weight: float64 [out_size] the weight of `high`; `low`'s is 1 - high_weight.
    """
    source = np.maximum((np.arange(out_size) + 0.5) * (in_size / out_size) - 0.5, 0.0)
    low = np.minimum(np.floor(source).astype(np.int64), in_size - 1)
    return low, np.minimum(low + 1, in_size - 1), source - low


def bilinear_resize_matrix(in_size: int, out_size: int) -> np.ndarray:
    """float64 [out_size, in_size]: `bilinear_taps` as a matrix."""
    low, high, high_weight = bilinear_taps(in_size, out_size)
    matrix = np.zeros([out_size, in_size])
    np.add.at(matrix, (np.arange(out_size), low), 1.0 - high_weight)
    np.add.at(matrix, (np.arange(out_size), high), high_weight)  # both on the last pixel: its weights sum to 1
    return matrix


def paste_matrix(mask_size: int, mask_stride: int, image_size: int, original_size: int) -> np.ndarray:
    """float64 [original_size, mask_size]: upsample x`mask_stride`, keep the first `image_size` pixels, resize.

    Composed tap by tap (an original pixel mixes two upsampled pixels, each two
    mask cells), not as the product of the two resize matrices, which costs
    original_size x image_size x mask_size.
    """
    up_low, up_high, up_weight = bilinear_taps(mask_size, mask_size * mask_stride)
    low, high, weight = bilinear_taps(image_size, original_size)
    matrix = np.zeros([original_size, mask_size])
    out = np.arange(original_size)
    for upsampled, outer in ((low, 1.0 - weight), (high, weight)):
        np.add.at(matrix, (out, up_low[upsampled]), outer * (1.0 - up_weight[upsampled]))
        np.add.at(matrix, (out, up_high[upsampled]), outer * up_weight[upsampled])
    return matrix


def bands(matrix: np.ndarray, block: int = BAND_BLOCK) -> list[tuple[slice, slice]]:
    """(output rows, input columns) for each `block` rows of `matrix`: the columns holding those rows' nonzeros.

    The rows' products over those columns alone equal theirs over all columns (the rest are exact zeros).
    """
    found = []
    for start in range(0, matrix.shape[0], block):
        nonzero = np.flatnonzero(np.any(matrix[start : start + block] != 0, axis=0))
        found.append((slice(start, start + block), slice(int(nonzero[0]), int(nonzero[-1]) + 1)))
    return found


def paste_masks(
    mask_logits: np.ndarray,
    image_hw: tuple[int, int],
    original_hw: tuple[int, int],
    mask_stride: int,
    *,
    chunk_pixels: int = CHUNK_PIXELS,
) -> RleMasks:
    """Binary masks in original pixels, COCO RLE, from one image's mask logits.

    Args:
      mask_logits: float [N, h, w] logits at `mask_stride` network pixels per
        cell over the padded network image (h * mask_stride, w * mask_stride).
      image_hw: (h_img, w_img) the network pixels the resized image fills,
        from the top left; at most the padded size.
      original_hw: (H, W) the original image's size in pixels.
      mask_stride: network pixels per mask cell (4 for Mask DINO's 1/4 map).
      chunk_pixels: full-resolution pixels computed at once (bounds memory:
        about 2 bytes each at stride 4).
    Returns:
      N masks of size (H, W): where the resized logits are > 0.
    """
    mask_logits = np.asarray(mask_logits)
    n, h, w = mask_logits.shape
    h_img, w_img = (int(v) for v in image_hw)
    height, width = (int(v) for v in original_hw)
    if not (0 < h_img <= h * mask_stride and 0 < w_img <= w * mask_stride):
        raise ValueError(
            f"image_hw {tuple(image_hw)} must be within the padded network image "
            f"({h * mask_stride}, {w * mask_stride}) that {h}x{w} logits at stride {mask_stride} cover"
        )
    # float32 products as torch computes them; the matrices are exact to float64 before that.
    rows = paste_matrix(h, mask_stride, h_img, height).astype(np.float32)  # [H, h]
    columns = paste_matrix(w, mask_stride, w_img, width).astype(np.float32)  # [W, w]
    row_bands, column_bands = bands(rows), bands(columns)
    per_chunk = max(1, chunk_pixels // max(1, height * width))
    strings = []
    for first in range(0, n, per_chunk):
        logits = mask_logits[first : first + per_chunk].astype(np.float32)
        m = len(logits)
        by_column = np.ascontiguousarray(logits.transpose(0, 2, 1))  # [m, w, h]
        along_rows = np.empty([m, w, height], np.float32)
        for out, cells in row_bands:
            along_rows[:, :, out] = np.matmul(by_column[:, :, cells], rows[out, cells].T)
        # [m, W, H] in C order is [H, W, m] in Fortran order: each mask's pixels column by column, the
        # order of COCO's run lengths, which the encoder reads without a copy.
        inside = np.empty([m, width, height], bool)
        for out, cells in column_bands:
            inside[:, out] = np.matmul(columns[out, cells], along_rows[:, cells]) > 0
        strings.extend(rle["counts"] for rle in hotcoco.mask.encode(inside.transpose(2, 1, 0)))
    return RleMasks.from_strings(np.full([n], height), np.full([n], width), strings)


def mask_scores(
    class_scores: np.ndarray, mask_logits: np.ndarray, image_hw: tuple[int, int], mask_stride: int
) -> np.ndarray:
    """Mask DINO's instance score: class score x the mean mask probability inside the predicted mask.

    Mask DINO averages sigmoid(logit) over the pixels of the pasted,
    original-size mask; here the average is over the mask cells (at
    `mask_stride`) that cover the image, `logit > 0` as the mask there. It
    differs from Mask DINO's only by the cells' resampling, mostly at mask
    edges; a mask with no cell above 0 scores 0 (Mask DINO's 1e-6 guard).

    Args:
      class_scores: float [N] the queries' class scores (probabilities).
      mask_logits: float [N, h, w] as `paste_masks` takes them.
      image_hw: (h_img, w_img) network pixels holding the image: the cells
        from ceil(h_img / mask_stride), ceil(w_img / mask_stride) on are
        padding and not counted.
      mask_stride: network pixels per mask cell.
    Returns:
      float32 [N].
    """
    logits = np.asarray(mask_logits)[:, : math.ceil(image_hw[0] / mask_stride), : math.ceil(image_hw[1] / mask_stride)]
    logits = logits.astype(np.float32)
    inside = logits > 0
    probabilities = np.exp(-np.logaddexp(0.0, -logits))  # sigmoid without overflow for very negative logits
    mean_inside = (probabilities * inside).sum(axis=(1, 2)) / (inside.sum(axis=(1, 2)) + 1e-6)
    return (np.asarray(class_scores, np.float32) * mean_inside).astype(np.float32)


def instance_masks(
    class_scores: np.ndarray,
    mask_logits: np.ndarray,
    image_hw: tuple[int, int],
    original_hw: tuple[int, int],
    mask_stride: int,
) -> tuple[RleMasks, np.ndarray]:
    """One image's detections' masks and scores as Mask DINO reports them: what every caller of a mask model uses.

    Args:
      class_scores: float [N] the detections' class scores.
      mask_logits: float [N, h, w] their mask logits (see `paste_masks`).
      image_hw, original_hw, mask_stride: as `paste_masks` takes them.
    Returns:
      (`paste_masks`' N masks in original pixels, `mask_scores`' float32 [N] scores).
    """
    return (
        paste_masks(mask_logits, image_hw, original_hw, mask_stride),
        mask_scores(class_scores, mask_logits, image_hw, mask_stride),
    )
