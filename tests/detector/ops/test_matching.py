"""Hungarian matching, checked against scipy's linear_sum_assignment, and DINO's matching cost."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sharding
from detector.ops import matching

optimize = pytest.importorskip("scipy.optimize")


def _hard_costs(rng, n, m, kind):
    """[n, m] float32 costs where the per-column argmins collide, so augmenting paths are needed.

    A per-query quality term shared by all columns makes the same few queries
    the best for every gt, as a well-placed DETR query is.
    """
    if kind == "uniform":
        cost = rng.uniform(size=(n, m)) + 2.0 * rng.uniform(size=(n, 1))
    elif kind == "integer":  # many exact ties between optimal assignments
        cost = rng.integers(0, 6, size=(n, m)) + rng.integers(0, 4, size=(n, 1))
    elif kind == "dynamic_range":  # entries from ~1e-4 to ~1e4
        cost = rng.uniform(size=(n, m)) * 10.0 ** rng.uniform(-4, 4, size=(n, m)) + rng.uniform(size=(n, 1))
    else:
        raise ValueError(kind)
    return cost.astype(np.float32)


def _check_assignment(cost, valid, query_for_gt, gt_for_query):
    """Asserts the assignment is an optimal matching of the real columns, consistent both ways."""
    cost = np.asarray(cost, np.float64)
    query_for_gt = np.asarray(query_for_gt)
    gt_for_query = np.asarray(gt_for_query)
    n, m = cost.shape
    assert query_for_gt.shape == (m,) and query_for_gt.dtype == np.int32
    assert gt_for_query.shape == (n,) and gt_for_query.dtype == np.int32
    real = np.flatnonzero(valid)
    np.testing.assert_array_equal(query_for_gt[~valid], -1)
    matched = query_for_gt[real]
    assert ((matched >= 0) & (matched < n)).all()
    assert len(set(matched.tolist())) == len(real), "two gts share a query"
    # The per-query array is the exact inverse on the real columns.
    np.testing.assert_array_equal(gt_for_query[matched], real)
    assert (gt_for_query >= 0).sum() == len(real)
    assert set(np.flatnonzero(gt_for_query >= 0).tolist()) == set(matched.tolist())

    rows, cols = optimize.linear_sum_assignment(cost[:, real])
    optimum = cost[:, real][rows, cols].sum()
    total = cost[matched, real].sum()
    # float32 potentials may pick another assignment within rounding of the optimum.
    np.testing.assert_allclose(total, optimum, rtol=1e-6, atol=1e-6)


_hungarian = jax.jit(matching.hungarian_assignment)


@pytest.mark.parametrize("kind", ["uniform", "integer", "dynamic_range"])
@pytest.mark.parametrize("n,m,num_padded", [(5, 5, 0), (20, 7, 0), (20, 7, 2), (300, 30, 4)])
def test_assignment_matches_scipy_optimum(n, m, num_padded, kind):
    rng = np.random.default_rng(n * 1000 + m * 10 + num_padded)
    for _ in range(3):
        cost = _hard_costs(rng, n, m, kind)
        valid = np.ones(m, bool)
        valid[rng.choice(m, num_padded, replace=False)] = False
        # Padding columns hold attractive garbage that must be ignored.
        cost[:, ~valid] = -1e6
        cost[0, ~valid] = np.nan
        # Greedy per-column argmins collide: a solver that never augments would fail here.
        greedy = cost[:, valid].argmin(axis=0)
        assert len(set(greedy.tolist())) < valid.sum()
        _check_assignment(cost, valid, *_hungarian(cost, valid))


def test_square_full_permutation_and_default_mask():
    rng = np.random.default_rng(7)
    cost = _hard_costs(rng, 12, 12, "uniform")
    query_for_gt, gt_for_query = _hungarian(cost, np.ones(12, bool))
    _check_assignment(cost, np.ones(12, bool), query_for_gt, gt_for_query)
    assert sorted(np.asarray(gt_for_query).tolist()) == list(range(12))
    default = matching.hungarian_assignment(cost)
    np.testing.assert_array_equal(default[0], query_for_gt)


def test_zero_real_boxes_gives_all_minus_one():
    cost = np.full((9, 4), np.nan, np.float32)
    query_for_gt, gt_for_query = _hungarian(cost, np.zeros(4, bool))
    np.testing.assert_array_equal(query_for_gt, -1)
    np.testing.assert_array_equal(gt_for_query, -1)


def test_non_finite_real_costs_are_matched_last():
    rng = np.random.default_rng(3)
    cost = _hard_costs(rng, 6, 3, "uniform")
    cost[:, 0] = np.nan  # column 0 is finite only at query 2, so it must take query 2
    cost[2, 0] = 0.5
    cost[4, 1] = np.inf
    query_for_gt, gt_for_query = _hungarian(cost, np.ones(3, bool))
    assert int(query_for_gt[0]) == 2
    finite = np.where(np.isfinite(cost), cost, 1e9)
    _check_assignment(finite, np.ones(3, bool), query_for_gt, gt_for_query)


def test_rejects_fewer_queries_than_gt_slots():
    with pytest.raises(ValueError, match="at least as many queries"):
        matching.hungarian_assignment(jnp.zeros((3, 4)))


def test_vmap_with_different_numbers_of_real_boxes():
    rng = np.random.default_rng(11)
    b, n, m = 4, 40, 8
    costs = np.stack([_hard_costs(rng, n, m, "uniform") for _ in range(b)])
    num_real = [0, 3, 8, 5]
    valid = np.arange(m)[None, :] < np.array(num_real)[:, None]
    valid[3] = np.roll(valid[3], 2)  # real slots need not be a prefix
    query_for_gt, gt_for_query = jax.jit(jax.vmap(matching.hungarian_assignment))(costs, valid)
    assert query_for_gt.shape == (b, m) and gt_for_query.shape == (b, n)
    for k in range(b):
        _check_assignment(costs[k], valid[k], query_for_gt[k], gt_for_query[k])
        # Batched elements that finish early idle: the same answer as alone.
        single = _hungarian(costs[k], valid[k])
        np.testing.assert_array_equal(query_for_gt[k], single[0])
        np.testing.assert_array_equal(gt_for_query[k], single[1])


def _numpy_dino_cost(logits, boxes, labels, gts, cw=2.0, lw=5.0, gw=2.0, alpha=0.25, gamma=2.0):
    logits = np.asarray(logits, np.float64)[:, labels]
    p = 1 / (1 + np.exp(-logits))
    focal = alpha * (1 - p) ** gamma * -np.log(p) - (1 - alpha) * p**gamma * -np.log(1 - p)
    boxes = np.asarray(boxes, np.float64)
    gts = np.asarray(gts, np.float64)
    l1 = np.abs(boxes[:, None, :] - gts[None, :, :]).sum(-1)

    def xyxy(b):
        return np.concatenate([b[:, :2] - b[:, 2:] / 2, b[:, :2] + b[:, 2:] / 2], axis=-1)

    a, g = xyxy(boxes)[:, None, :], xyxy(gts)[None, :, :]
    area_a = (a[..., 2] - a[..., 0]) * (a[..., 3] - a[..., 1])
    area_g = (g[..., 2] - g[..., 0]) * (g[..., 3] - g[..., 1])
    lo, hi = np.maximum(a[..., :2], g[..., :2]), np.minimum(a[..., 2:], g[..., 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=-1)
    union = area_a + area_g - inter
    enclosing = np.prod(np.maximum(a[..., 2:], g[..., 2:]) - np.minimum(a[..., :2], g[..., :2]), axis=-1)
    giou = inter / union - (enclosing - union) / enclosing
    return cw * focal + lw * l1 - gw * giou


def _random_detections(rng, n, m, c):
    logits = rng.normal(0, 2, (n, c)).astype(np.float32)
    boxes = np.concatenate([rng.uniform(0.2, 0.8, (n, 2)), rng.uniform(0.05, 0.4, (n, 2))], -1).astype(np.float32)
    labels = rng.integers(0, c, m).astype(np.int32)
    gts = np.concatenate([rng.uniform(0.2, 0.8, (m, 2)), rng.uniform(0.05, 0.4, (m, 2))], -1).astype(np.float32)
    return logits, boxes, labels, gts


@pytest.mark.parametrize(
    "weights", [{}, {"class_weight": 1.0, "l1_weight": 2.0, "giou_weight": 3.0, "focal_gamma": 1.5}]
)
def test_dino_cost_matches_numpy(weights):
    rng = np.random.default_rng(5)
    logits, boxes, labels, gts = _random_detections(rng, 30, 6, 5)
    boxes[0] = gts[1]  # a perfect box: GIoU exactly 1
    got = np.asarray(matching.dino_matching_cost(logits, boxes, labels, gts, **weights))
    ref_kwargs = {
        "cw": weights.get("class_weight", 2.0),
        "lw": weights.get("l1_weight", 5.0),
        "gw": weights.get("giou_weight", 2.0),
        "gamma": weights.get("focal_gamma", 2.0),
    }
    want = _numpy_dino_cost(logits, boxes, labels, gts, **ref_kwargs)
    assert got.shape == (30, 6) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_dino_cost_padding_does_not_change_real_columns():
    rng = np.random.default_rng(6)
    logits, boxes, labels, gts = _random_detections(rng, 20, 3, 4)
    real = np.asarray(matching.dino_matching_cost(logits, boxes, labels, gts))
    padded_labels = np.concatenate([labels, [-1, 99]]).astype(np.int32)
    padded_gts = np.concatenate([gts, np.zeros((1, 4)), np.full((1, 4), np.nan)]).astype(np.float32)
    padded = np.asarray(matching.dino_matching_cost(logits, boxes, padded_labels, padded_gts))
    np.testing.assert_array_equal(padded[:, :3], real)


def test_match_batch_is_optimal_per_image_under_jit():
    rng = np.random.default_rng(8)
    b, n, m, c = 3, 50, 6, 4
    dets = [_random_detections(rng, n, m, c) for _ in range(b)]
    logits, boxes, labels, gts = (np.stack(x) for x in zip(*dets))
    mask = np.arange(m)[None, :] < np.array([6, 0, 2])[:, None]
    gts[~mask] = np.nan  # padding boxes may be garbage
    labels[~mask] = -1
    query_for_gt, gt_for_query = jax.jit(matching.match_batch)(logits, boxes, labels, gts, mask)
    for k in range(b):
        cost = np.nan_to_num(_numpy_dino_cost(logits[k], boxes[k], labels[k], gts[k]))
        _check_assignment(cost, mask[k], query_for_gt[k], gt_for_query[k])


def test_match_batch_sharded_over_the_mesh_gives_one_devices_assignment():
    """Images split over ('data', 'fsdp') and queries over 'model', as a sharded DINO step may place them.

    The costs are elementwise and the search takes minima, which no split
    reorders: the assignment must be identical, not merely as cheap.
    """
    rng = np.random.default_rng(21)
    b, n, m, c = 8, 48, 6, 5
    logits, boxes, labels, gts = (np.stack(x) for x in zip(*[_random_detections(rng, n, m, c) for _ in range(b)]))
    mask = np.arange(m)[None, :] < rng.integers(0, m + 1, size=(b, 1))
    one_device = jax.jit(matching.match_batch)(logits, boxes, labels, gts, mask)
    mesh = sharding.create_mesh(dict(data=2, fsdp=2, model=2))
    by_query = NamedSharding(mesh, P(("data", "fsdp"), "model"))
    by_image = NamedSharding(mesh, P(("data", "fsdp")))
    sharded = jax.jit(
        matching.match_batch, in_shardings=(by_query, by_query, by_image, by_image, by_image), out_shardings=by_image
    )(logits, boxes, labels, gts, mask)
    assert len(sharded[0].sharding.device_set) == 8
    for expected, actual in zip(one_device, sharded):
        np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected))


def test_traces_to_a_static_program():
    b, n, m, c = 2, 900, 100, 91
    args = (
        jax.ShapeDtypeStruct((b, n, c), jnp.float32),
        jax.ShapeDtypeStruct((b, n, 4), jnp.float32),
        jax.ShapeDtypeStruct((b, m), jnp.int32),
        jax.ShapeDtypeStruct((b, m, 4), jnp.float32),
        jax.ShapeDtypeStruct((b, m), jnp.bool_),
    )
    lowered = jax.jit(matching.match_batch).lower(*args)
    query_for_gt, gt_for_query = lowered.out_info
    assert query_for_gt.shape == (b, m) and query_for_gt.dtype == jnp.int32
    assert gt_for_query.shape == (b, n) and gt_for_query.dtype == jnp.int32
    # The loops stay on the device: no host callbacks in the program.
    text = lowered.as_text()
    assert "while" in text and "callback" not in text
