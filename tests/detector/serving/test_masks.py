"""masks: pasting mask logits as torch's two F.interpolate calls do (stored outputs), RLE out, Mask DINO's score."""

import math

import numpy as np
import pytest
from pycocotools import mask as mask_utils

from detector.serving import masks
from tests.reference_outputs import generate

# torch's float32 resizes against the float64 matrices: relative to the largest logit.
LOGIT_TOLERANCE = 2e-6
# Where torch's pasted logit is this close to 0, float32 rounding may put the pixel on either side.
NEAR_ZERO = 1e-5


def _cases():
    case = generate.read("mask_paste_bilinear")
    for i, shape in enumerate(case.options["shapes"]):
        yield case.arrays[f"logits/{i}"], case.arrays[f"reference/{i}"], shape


def _decode(rle_masks):
    return np.stack([mask_utils.decode(rle) for rle in rle_masks.to_coco()]).astype(bool)


def test_paste_matrices_are_torchs_two_resizes():
    for logits, reference, shape in _cases():
        _, h, w = logits.shape
        (image_h, image_w), (height, width) = shape["image_hw"], shape["original_hw"]
        rows = masks.paste_matrix(h, shape["mask_stride"], image_h, height)
        columns = masks.paste_matrix(w, shape["mask_stride"], image_w, width)
        pasted = np.einsum("Hh,nhw,Ww->nHW", rows, logits.astype(np.float64), columns)
        np.testing.assert_allclose(pasted, reference, rtol=0, atol=LOGIT_TOLERANCE * np.abs(reference).max())


def test_paste_masks_are_torchs_masks():
    shapes_seen = set()
    for logits, reference, shape in _cases():
        pasted = masks.paste_masks(logits, shape["image_hw"], shape["original_hw"], shape["mask_stride"])
        assert len(pasted) == len(logits)
        np.testing.assert_array_equal(pasted.heights, shape["original_hw"][0])
        np.testing.assert_array_equal(pasted.widths, shape["original_hw"][1])
        found, expected = _decode(pasted), reference > 0
        near_zero = np.abs(reference) <= NEAR_ZERO
        assert not (found != expected)[~near_zero].any()
        assert near_zero.mean() < 0.01
        assert not found[1].any() and found[0].any() and not found[0].all()  # the empty mask; a real one
        # One mask at a time (a chunk per mask) gives the same strings.
        single = masks.paste_masks(
            logits, shape["image_hw"], shape["original_hw"], shape["mask_stride"], chunk_pixels=1
        )
        assert single.to_coco() == pasted.to_coco()
        h, w = logits.shape[1:]
        shapes_seen.add(
            (
                shape["mask_stride"],
                shape["original_hw"][0] != shape["original_hw"][1],
                shape["image_hw"][0] < h * shape["mask_stride"],
                shape["image_hw"][1] < w * shape["mask_stride"],
            )
        )
    # Stride 4, non-square originals, images that leave padding in each axis.
    assert {s[0] for s in shapes_seen} >= {4} and all(s[1] for s in shapes_seen)
    assert any(s[2] for s in shapes_seen) and any(s[3] for s in shapes_seen)


def test_bilinear_resize_matrix_by_hand():
    # Enlarging 2 -> 4: samples at -0.25 (clamped to 0), 0.25, 0.75, 1.25 (past the last pixel: the last pixel).
    np.testing.assert_allclose(
        masks.bilinear_resize_matrix(2, 4), [[1, 0], [0.75, 0.25], [0.25, 0.75], [0, 1]], rtol=0, atol=0
    )
    # Reducing 4 -> 2: samples at 0.5 and 2.5, no antialiasing (pixels 0 and 3 get no weight).
    np.testing.assert_allclose(masks.bilinear_resize_matrix(4, 2), [[0.5, 0.5, 0, 0], [0, 0, 0.5, 0.5]])
    np.testing.assert_array_equal(masks.bilinear_resize_matrix(5, 5), np.eye(5))


def test_bands_keep_the_products():
    matrix = masks.paste_matrix(40, 4, 150, 97)
    x = np.random.default_rng(0).normal(size=(40, 3))
    banded = np.zeros((97, 3))
    for out, cells in masks.bands(matrix, block=8):
        assert cells.stop - cells.start < 10  # a band, not every cell
        banded[out] = matrix[out, cells] @ x[cells]
    np.testing.assert_allclose(banded, matrix @ x, rtol=0, atol=1e-12)


def test_paste_masks_edge_cases():
    empty = masks.paste_masks(np.zeros((0, 6, 8), np.float32), (20, 30), (40, 60), 4)
    assert len(empty) == 0 and empty.to_coco() == []
    with pytest.raises(ValueError, match="padded network image"):
        masks.paste_masks(np.zeros((1, 6, 8), np.float32), (25, 30), (40, 60), 4)
    # A constant positive logit fills the whole original image, whatever the sizes.
    full = masks.paste_masks(np.ones((2, 5, 3), np.float32), (17, 9), (31, 44), 4)
    assert _decode(full).all() and _decode(full).shape == (2, 31, 44)


def test_mask_scores_by_hand():
    # Stride 4, the image 5x8 network pixels: cells [:2, :2] hold it; row 2 and column 2 are padding.
    pad = 50.0
    logits = np.array(
        [
            [[math.log(3), math.log(9), pad], [-2.0, 0.0, pad], [pad, pad, pad]],  # sigmoid 0.75, 0.9; 0 is out
            [[-1.0, -3.0, pad], [-0.5, -9.0, pad], [pad, pad, pad]],  # nothing inside the image: 0
            [[math.log(9), -1.0, -pad], [math.log(4), -math.log(3), -pad], [pad, -pad, pad]],  # 0.9, 0.8
        ],
        np.float32,
    )
    scores = masks.mask_scores(np.array([0.5, 0.8, 1.0]), logits, (5, 8), 4)
    assert scores.dtype == np.float32
    np.testing.assert_allclose(scores, [0.5 * 0.825, 0.0, 0.85], rtol=1e-6)
