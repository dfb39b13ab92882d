"""Anchor generation (count, order, geometry) and anchor-to-gt assignment."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detector.ops import anchors as anchors_lib
from detector.ops import box_ops

RATIOS = (0.5, 1.0, 2.0)
# Jitted: one compile per shape is much faster than eager op-by-op dispatch.
assign = jax.jit(anchors_lib.assign_targets, static_argnames=("allow_low_quality_matches", "box_coder_weights"))


def _centres_and_sizes(boxes):
    boxes = np.asarray(boxes, np.float64)
    return (
        (boxes[..., 0] + boxes[..., 2]) / 2,
        (boxes[..., 1] + boxes[..., 3]) / 2,
        boxes[..., 2] - boxes[..., 0],
        boxes[..., 3] - boxes[..., 1],
    )


def test_count_and_order_hand_computed():
    anchors = anchors_lib.generate_anchors(64, 64, 3, 4, 2, RATIOS, 4.0)
    per_loc = anchors_lib.num_anchors_per_location(2, RATIOS)
    assert per_loc == 6
    assert anchors.dtype == np.float32
    assert anchors.shape == ((8 * 8 + 4 * 4) * per_loc, 4)
    cy, cx, h, w = _centres_and_sizes(anchors)

    # First anchor: level 3, row 0, column 0, scale 0, ratio 0.5 (h/w).
    size = 4.0 * 8
    np.testing.assert_allclose(
        anchors[0],
        [
            4 - size * math.sqrt(0.5) / 2,
            4 - size / math.sqrt(0.5) / 2,
            4 + size * math.sqrt(0.5) / 2,
            4 + size / math.sqrt(0.5) / 2,
        ],
        rtol=1e-6,
    )
    np.testing.assert_allclose(anchors[1], [-12.0, -12.0, 20.0, 20.0])  # ratio 1
    assert h[2] / w[2] == pytest.approx(2.0)  # ratio 2
    # Scale-major: anchors 3..5 are scale 2**(1/2) with ratios 0.5, 1, 2.
    np.testing.assert_allclose(h[4], size * 2**0.5, rtol=1e-6)
    np.testing.assert_allclose(h[3] / w[3], 0.5, rtol=1e-6)
    # x (column) moves before y (row).
    assert (cy[per_loc], cx[per_loc]) == pytest.approx((4.0, 12.0))
    assert (cy[8 * per_loc], cx[8 * per_loc]) == pytest.approx((12.0, 4.0))
    assert (cy[64 * per_loc - 1], cx[64 * per_loc - 1]) == pytest.approx((60.0, 60.0))
    # Level 4 starts after all of level 3.
    first4 = 64 * per_loc
    assert (cy[first4], cx[first4]) == pytest.approx((8.0, 8.0))
    np.testing.assert_allclose(h[first4 + 1], 4.0 * 16, rtol=1e-6)


def test_grid_rounds_up_and_area_preserved():
    anchors = anchors_lib.generate_anchors(100, 60, 3, 5, 3, RATIOS, 4.0)
    sizes = [math.ceil(100 / 2**l) * math.ceil(60 / 2**l) for l in (3, 4, 5)]
    assert anchors.shape == (sum(sizes) * 9, 4)
    _, _, h, w = _centres_and_sizes(anchors)
    # Each group of len(RATIOS) anchors shares one scale, hence one area.
    areas = (h * w).reshape(-1, len(RATIOS))
    np.testing.assert_allclose(areas, areas[:, :1].repeat(len(RATIOS), 1), rtol=1e-5)
    np.testing.assert_allclose(np.sqrt(areas[0, 0]), 4.0 * 8, rtol=1e-6)
    np.testing.assert_allclose((h / w)[:9], np.tile(RATIOS, 3), rtol=1e-5)


# Hand-built anchors, kept tiny so every IoU is easy to compute by hand.
ANCHORS = np.array(
    [
        [0, 0, 10, 10],  # a0
        [0, 10, 10, 20],  # a1
        [20, 20, 40, 40],  # a2
        [50, 50, 60, 60],  # a3
        [0, 0, 100, 100],  # a4
        [200, 200, 210, 210],  # a5
    ],
    np.float32,
)
GT_BOXES = np.array(
    [
        [20, 20, 40, 40],  # g0 == a2
        [0, 0, 10, 22],  # g1: IoU 100/220 with a0 and with a1 (ignore band)
        [52, 52, 54, 54],  # g2: small, IoU 0.04 with a3
        [50, 50, 60, 60],  # padding that would match a3 exactly
        [300, 300, 310, 310],  # g4: overlaps no anchor at all
    ],
    np.float32,
)
GT_LABELS = np.array([3, 1, 5, 7, 2], np.int32)
GT_MASK = np.array([True, True, True, False, True])


def test_assign_hand_built_with_low_quality_matches():
    out = assign(ANCHORS, GT_BOXES, GT_LABELS, GT_MASK)
    np.testing.assert_array_equal(out["positive"], [True, True, True, True, False, False])
    # a0 and a1 tie as g1's best anchors; a3 is the small g2's best anchor.
    np.testing.assert_array_equal(out["labels"], [1, 1, 3, 5, -1, -1])
    np.testing.assert_array_equal(out["ignore"], [False] * 6)
    np.testing.assert_allclose(out["box_targets"][2], 0.0, atol=1e-6)
    np.testing.assert_allclose(out["box_targets"][0], box_ops.encode_boxes(GT_BOXES[1], ANCHORS[0]), rtol=1e-6)
    np.testing.assert_array_equal(out["box_targets"][4:], 0.0)
    np.testing.assert_array_equal(out["matched_gt_boxes"][:4], GT_BOXES[[1, 1, 0, 2]])
    np.testing.assert_array_equal(out["matched_gt_boxes"][4:], 0.0)
    assert out["labels"].dtype == jnp.int32 and out["box_targets"].dtype == jnp.float32


def test_assign_hand_built_without_low_quality_matches():
    out = assign(ANCHORS, GT_BOXES, GT_LABELS, GT_MASK, allow_low_quality_matches=False)
    np.testing.assert_array_equal(out["positive"], [False, False, True, False, False, False])
    np.testing.assert_array_equal(out["ignore"], [True, True, False, False, False, False])
    np.testing.assert_array_equal(out["labels"], [-1, -1, 3, -1, -1, -1])
    np.testing.assert_array_equal(np.asarray(out["box_targets"])[[0, 1, 3]], 0.0)


def test_padded_gts_never_match():
    all_padding = assign(ANCHORS, GT_BOXES, GT_LABELS, np.zeros(5, bool))
    assert not np.any(all_padding["positive"]) and not np.any(all_padding["ignore"])
    np.testing.assert_array_equal(all_padding["labels"], -1)
    # Adding padded slots (even copies of real boxes) changes nothing.
    base = assign(ANCHORS, GT_BOXES[:3], GT_LABELS[:3], GT_MASK[:3])
    padded = assign(
        ANCHORS,
        np.concatenate([GT_BOXES[:3], ANCHORS[:3]]),
        np.concatenate([GT_LABELS[:3], [9, 9, 9]]),
        np.concatenate([GT_MASK[:3], [False] * 3]),
    )
    for key in ("labels", "box_targets", "positive", "ignore", "matched_gt_boxes"):
        np.testing.assert_array_equal(base[key], padded[key])


def test_gt_equal_to_generated_anchor():
    anchors = anchors_lib.generate_anchors(64, 64, 3, 4, 2, RATIOS, 4.0)
    idx = 6 * 9 + 4  # level 3, row 1, column 1, scale 1, ratio 1
    gt = np.stack([anchors[idx], np.zeros(4, np.float32)])
    out = assign(anchors, gt, np.array([4, 0]), np.array([True, False]))
    assert bool(out["positive"][idx]) and int(out["labels"][idx]) == 4
    np.testing.assert_allclose(out["box_targets"][idx], 0.0, atol=1e-6)
    assert int(out["positive"].sum()) >= 1
    assert np.all(np.asarray(out["labels"])[~np.asarray(out["positive"])] == -1)


def test_assign_jit_vmap_over_batch():
    boxes = np.stack([GT_BOXES, GT_BOXES[::-1]])
    labels = np.stack([GT_LABELS, GT_LABELS[::-1]])
    mask = np.stack([GT_MASK, GT_MASK[::-1]])

    @jax.jit
    def assign_batch(b, l, m):
        return jax.vmap(lambda b1, l1, m1: anchors_lib.assign_targets(jnp.asarray(ANCHORS), b1, l1, m1))(b, l, m)

    out = assign_batch(boxes, labels, mask)
    assert out["box_targets"].shape == (2, len(ANCHORS), 4)
    for i in range(2):
        single = assign(ANCHORS, boxes[i], labels[i], mask[i])
        for key in single:
            np.testing.assert_allclose(out[key][i], single[key], rtol=1e-6)
    # Reversing the gt order only changes which duplicate index matched.
    np.testing.assert_array_equal(out["labels"][0], out["labels"][1])
