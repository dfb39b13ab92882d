"""Box geometry and coding, checked against pycocotools and hand-computed values."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pycocotools import mask as mask_utils

from detector.ops import box_ops


def _random_boxes_yxyx(rng, n, size=100.0):
    y0 = rng.uniform(0, size, n)
    x0 = rng.uniform(0, size, n)
    h = rng.uniform(1, size / 2, n)
    w = rng.uniform(1, size / 2, n)
    return np.stack([y0, x0, y0 + h, x0 + w], axis=-1).astype(np.float32)


def test_pairwise_iou_matches_pycocotools():
    rng = np.random.default_rng(0)
    boxes1 = _random_boxes_yxyx(rng, 20)
    boxes2 = _random_boxes_yxyx(rng, 15)
    # Identical boxes and a box far from everything else.
    boxes2[0] = boxes1[3]
    boxes2[1] = [500.0, 500.0, 510.0, 520.0]
    got = np.asarray(box_ops.pairwise_iou(boxes1, boxes2))

    to_xywh = lambda b: np.asarray(box_ops.yxyx_to_xywh(b), np.float64).tolist()
    want = mask_utils.iou(to_xywh(boxes1), to_xywh(boxes2), [0] * len(boxes2))
    assert got.shape == (20, 15)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert got[3, 0] == pytest.approx(1.0)
    np.testing.assert_array_equal(got[:, 1], 0.0)
    assert (want > 0).sum() > 10  # the random sets do overlap


def test_pairwise_iou_empty_union_is_zero_and_broadcasts():
    degenerate = jnp.zeros((2, 4))
    np.testing.assert_array_equal(box_ops.pairwise_iou(degenerate, degenerate), 0.0)
    rng = np.random.default_rng(1)
    batch1 = _random_boxes_yxyx(rng, 3 * 5).reshape(3, 5, 4)
    batch2 = _random_boxes_yxyx(rng, 3 * 4).reshape(3, 4, 4)
    got = box_ops.pairwise_iou(batch1, batch2)
    assert got.shape == (3, 5, 4)
    np.testing.assert_allclose(got[1], box_ops.pairwise_iou(batch1[1], batch2[1]))


def test_area_and_elementwise_iou():
    boxes = jnp.array(
        [
            [0.0, 0.0, 2.0, 3.0],
            [5.0, 5.0, 5.0, 9.0],  # zero height
            [5.0, 5.0, 3.0, 9.0],
        ]
    )  # inverted: not negative
    np.testing.assert_array_equal(box_ops.area(boxes), [6.0, 0.0, 0.0])
    a = jnp.array([0.0, 0.0, 10.0, 10.0])
    b = jnp.array([0.0, 5.0, 10.0, 15.0])
    assert float(box_ops.elementwise_iou(a, b)) == pytest.approx(50.0 / 150.0)
    assert float(box_ops.elementwise_iou(a, a)) == pytest.approx(1.0)


def test_generalized_iou_known_values():
    a = jnp.array([0.0, 0.0, 10.0, 10.0])
    assert float(box_ops.generalized_iou(a, a)) == pytest.approx(1.0)
    # Touching side by side: IoU 0, enclosing box = union -> GIoU 0.
    b = jnp.array([0.0, 10.0, 10.0, 20.0])
    assert float(box_ops.generalized_iou(a, b)) == pytest.approx(0.0, abs=1e-6)
    # Diagonal, gap: union 200, enclosing 30*30=900 -> -(700/900).
    c = jnp.array([20.0, 20.0, 30.0, 30.0])
    assert float(box_ops.generalized_iou(a, c)) == pytest.approx(-7.0 / 9.0)
    far = jnp.array([1e5, 1e5, 1e5 + 10, 1e5 + 10])
    assert float(box_ops.generalized_iou(a, far)) == pytest.approx(-1.0, abs=1e-6)
    # Elementwise over leading dims, and in [-1, 1].
    rng = np.random.default_rng(2)
    g = box_ops.generalized_iou(_random_boxes_yxyx(rng, 50), _random_boxes_yxyx(rng, 50))
    assert g.shape == (50,)
    assert np.all(np.asarray(g) <= 1.0) and np.all(np.asarray(g) >= -1.0)
    # Finite gradient even for disjoint and degenerate boxes.
    grad = jax.grad(lambda x: box_ops.generalized_iou(x, jnp.zeros(4)))(c)
    assert np.all(np.isfinite(grad))


@pytest.mark.parametrize("weights", [(1.0, 1.0, 1.0, 1.0), (10.0, 10.0, 5.0, 5.0)])
def test_encode_decode_round_trip(weights):
    rng = np.random.default_rng(3)
    boxes = _random_boxes_yxyx(rng, 64)
    anchors = _random_boxes_yxyx(rng, 64)
    deltas = box_ops.encode_boxes(boxes, anchors, weights)
    assert deltas.shape == (64, 4)
    np.testing.assert_allclose(box_ops.decode_boxes(deltas, anchors, weights), boxes, rtol=1e-5, atol=1e-3)
    # A box equal to its anchor encodes to zeros.
    np.testing.assert_allclose(box_ops.encode_boxes(anchors, anchors, weights), 0.0, atol=1e-6)


def test_encode_known_values_and_degenerate_box():
    anchor = jnp.array([0.0, 0.0, 10.0, 20.0])  # centre (5, 10), h 10, w 20
    box = jnp.array([5.0, 0.0, 25.0, 10.0])  # centre (15, 5), h 20, w 10
    np.testing.assert_allclose(box_ops.encode_boxes(box, anchor), [1.0, -0.25, math.log(2.0), math.log(0.5)], rtol=1e-6)
    assert np.all(np.isfinite(box_ops.encode_boxes(jnp.zeros(4), anchor)))


def test_decode_clamps_log_scale():
    anchor = jnp.array([0.0, 0.0, 16.0, 16.0])
    out = box_ops.decode_boxes(jnp.array([0.0, 0.0, 100.0, 100.0]), anchor)
    side = 16.0 * 1000.0 / 16.0
    np.testing.assert_allclose(out, [8 - side / 2, 8 - side / 2, 8 + side / 2, 8 + side / 2], rtol=1e-5)
    out = box_ops.decode_boxes(jnp.array([0.0, 0.0, 3.0, 3.0]), anchor, max_log_scale=1.0)
    np.testing.assert_allclose(out[2] - out[0], 16.0 * math.e, rtol=1e-5)


def test_clip_boxes():
    boxes = jnp.array([[-5.0, -3.0, 50.0, 200.0], [10.0, 10.0, 20.0, 20.0]])
    np.testing.assert_array_equal(
        box_ops.clip_boxes(boxes, 40, 100), [[0.0, 0.0, 40.0, 100.0], [10.0, 10.0, 20.0, 20.0]]
    )
    # One size per image, broadcast over a [B, N] batch.
    batch = jnp.stack([boxes, boxes])
    clipped = box_ops.clip_boxes(batch, jnp.array([[40.0], [15.0]]), jnp.array([[100.0], [15.0]]))
    np.testing.assert_array_equal(clipped[1], [[0.0, 0.0, 15.0, 15.0], [10.0, 10.0, 15.0, 15.0]])


def test_xywh_round_trip():
    boxes = jnp.array([[1.0, 2.0, 4.0, 7.0]])
    np.testing.assert_array_equal(box_ops.yxyx_to_xywh(boxes), [[2.0, 1.0, 5.0, 3.0]])
    np.testing.assert_array_equal(box_ops.xywh_to_yxyx(box_ops.yxyx_to_xywh(boxes)), boxes)


def test_jit_and_vmap():
    rng = np.random.default_rng(4)
    b1 = jnp.asarray(_random_boxes_yxyx(rng, 4 * 6).reshape(4, 6, 4))
    b2 = jnp.asarray(_random_boxes_yxyx(rng, 4 * 3).reshape(4, 3, 4))
    iou = jax.jit(jax.vmap(box_ops.pairwise_iou))(b1, b2)
    np.testing.assert_allclose(iou, box_ops.pairwise_iou(b1, b2), rtol=1e-6)

    def round_trip(boxes, anchors):
        return box_ops.decode_boxes(box_ops.encode_boxes(boxes, anchors), anchors)

    out = jax.jit(jax.vmap(round_trip))(b1, b1[:, ::-1])
    np.testing.assert_allclose(out, b1, rtol=1e-5, atol=1e-3)
    g = jax.jit(jax.vmap(box_ops.generalized_iou))(b1[:, 0], b1[:, 1])
    assert g.shape == (4,)
    clipped = jax.jit(box_ops.clip_boxes)(b1, 50.0, jnp.float32(60.0))
    assert float(clipped[..., 2].max()) <= 50.0 and float(clipped[..., 3].max()) <= 60.0


def test_mask_boxes_are_the_tight_boxes_of_the_set_cells_and_empty_masks_say_so():
    rng = np.random.default_rng(0)
    masks = np.zeros((5, 6, 8), bool)
    masks[0, 2:4, 3:7] = True
    masks[1, 0, 0] = True
    masks[2] = rng.random((6, 8)) < 0.1
    masks[3, 5, 7] = masks[3, 1, 2] = True  # two cells: their joint box
    boxes, nonempty = jax.jit(box_ops.mask_boxes_cxcywh)(jnp.asarray(masks))
    for mask, box, has in zip(masks, np.asarray(boxes), np.asarray(nonempty)):
        rows, columns = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
        assert has == (rows.size > 0)
        if not has:
            np.testing.assert_array_equal(box, 0.0)
            continue
        y0, y1, x0, x1 = rows[0] / 6, (rows[-1] + 1) / 6, columns[0] / 8, (columns[-1] + 1) / 8
        np.testing.assert_allclose(box, [(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], rtol=1e-6)
    assert not nonempty[4]
