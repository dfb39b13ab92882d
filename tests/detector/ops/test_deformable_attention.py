"""Multi-scale deformable attention against a loop-by-loop numpy reference, finite differences and grid_sample."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from detector.ops import deformable_attention
from detector.ops.deformable_attention import multi_scale_deformable_attention
from tests.helpers.deformable_attention_inputs import SHAPES, sampling_inputs
from tests.reference_outputs import generate

# Every property holds for both ways of computing the same sum.
BOTH_METHODS = pytest.mark.parametrize("method", ["gather", "matrix"])

# Non-square levels of different sizes, one a single pixel.


def _reference(value, shapes, locations, weights):
    """Straight from the definition, in float64.

    Bilinear interpolation is the tent kernel: pixel (i, j) weighs
    max(0, 1 - |x - j|) * max(0, 1 - |y - i|) at pixel coordinates (x, y), pixel
    centres at integers. Summing over the pixels that exist is the zero padding.
    """
    value = np.asarray(value, np.float64)
    locations = np.asarray(locations, np.float64)
    weights = np.asarray(weights, np.float64)
    batch, _, heads, head_dim = value.shape
    _, queries, _, levels, points, _ = locations.shape
    out = np.zeros((batch, queries, heads, head_dim))
    for b in range(batch):
        for q in range(queries):
            for h in range(heads):
                start = 0
                for l, (height, width) in enumerate(shapes):
                    grid = value[b, start : start + height * width, h].reshape(height, width, head_dim)
                    start += height * width
                    for p in range(points):
                        x = locations[b, q, h, l, p, 0] * width - 0.5
                        y = locations[b, q, h, l, p, 1] * height - 0.5
                        sample = np.zeros(head_dim)
                        for i in range(height):
                            for j in range(width):
                                tent = max(0.0, 1 - abs(x - j)) * max(0.0, 1 - abs(y - i))
                                sample += tent * grid[i, j]
                        out[b, q, h] += weights[b, q, h, l, p] * sample
    return out.reshape(batch, queries, heads * head_dim)


def _corner_status(locations, shapes):
    """Per point: 'in' (4 neighbours in the map), 'partial' or 'out' (none)."""
    status = np.empty(locations.shape[:-1], object)
    for l, (height, width) in enumerate(shapes):
        x = locations[..., l, :, 0] * width - 0.5
        y = locations[..., l, :, 1] * height - 0.5
        x_in = [(np.floor(x) + d >= 0) & (np.floor(x) + d <= width - 1) for d in (0, 1)]
        y_in = [(np.floor(y) + d >= 0) & (np.floor(y) + d <= height - 1) for d in (0, 1)]
        count = sum(xi & yi for xi in x_in for yi in y_in)
        status[..., l, :] = np.where(count == 4, "in", np.where(count == 0, "out", "partial"))
    return status


@BOTH_METHODS
def test_matches_loop_reference_inside_on_border_and_outside(method):
    value, locations, weights = sampling_inputs(np.random.default_rng(0))
    status = _corner_status(locations, SHAPES)
    assert {(status == s).sum() > 20 for s in ("in", "partial", "out")} == {True}

    got = np.asarray(multi_scale_deformable_attention(value, SHAPES, locations, weights, method))
    want = _reference(value, SHAPES, locations, weights)
    assert got.shape == (2, 6, 3 * 5) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@BOTH_METHODS
def test_hand_values_follow_align_corners_false(method):
    # A 1x1 map and a 1x2 map [a, b]: pixel centres at x = 0.5 (1x1) and 0.25, 0.75 (1x2).
    shapes = ((1, 1), (1, 2))
    value = np.array([2.0, 10.0, 20.0], np.float32).reshape(1, 3, 1, 1)
    cases = [
        # (level, x, y, expected)
        (0, 0.5, 0.5, 2.0),  # the centre
        (0, 0.25, 0.5, 1.5),  # a quarter pixel left of centre: 3/4 of the pixel, 1/4 from padding
        (0, 0.0, 0.0, 0.5),  # the outer corner: half a pixel outside in x and in y
        (0, 1.2, 0.5, 0.6),  # beyond the edge, 0.7 pixel from the centre: still weighs 0.3
        (0, 1.6, 0.5, 0.0),  # more than a pixel from the only centre
        (1, 0.5, 0.5, 15.0),  # halfway between the two centres
        (1, 0.25, 0.5, 10.0),
        (1, 1.0, 0.5, 10.0),  # right edge: half of b
    ]
    for level, x, y, expected in cases:
        locations = np.zeros((1, 1, 1, 2, 1, 2), np.float32)
        weights = np.zeros((1, 1, 1, 2, 1), np.float32)
        locations[0, 0, 0, level, 0] = [x, y]
        weights[0, 0, 0, level, 0] = 1.0
        got = float(multi_scale_deformable_attention(value, shapes, locations, weights, method)[0, 0, 0])
        assert got == pytest.approx(expected, abs=1e-6), (level, x, y)


@BOTH_METHODS
def test_matches_torch_grid_sample(method):
    # Deformable DETR's ms_deform_attn_core_pytorch (torch's grid_sample) in float64, stored by
    # tests.reference_outputs.generate, so that no torch is needed here.
    case = generate.read("deformable_attention_grid_sample")
    shapes = tuple(tuple(shape) for shape in case.options["shapes"])
    value, locations, weights = (case.arrays[key] for key in ("value", "locations", "weights"))
    status = _corner_status(locations, shapes)
    assert {(status == s).sum() > 20 for s in ("in", "partial", "out")} == {True}
    got = np.asarray(multi_scale_deformable_attention(value, shapes, locations, weights, method))
    np.testing.assert_allclose(got, case.arrays["reference"], rtol=1e-5, atol=1e-5)


@BOTH_METHODS
def test_gradients_match_finite_differences_of_the_reference(method):
    shapes = ((3, 4), (2, 3), (1, 1))
    rng = np.random.default_rng(2)
    value, _, weights = sampling_inputs(rng, batch=1, queries=3, heads=2, points=2, head_dim=2, shapes=shapes)
    # Pixel coordinates a whole number plus a fraction in [0.1, 0.9]: away from the
    # kinks where the bilinear weights (and finite differences) jump, from two pixels
    # outside the map on either side.
    loc_shape = (1, 3, 2, len(shapes), 2, 2)
    sizes = np.array([[w, h] for h, w in shapes], np.float64)[:, None, :]  # [L, 1, 2] as (x, y)
    pixel = rng.integers(-3, 1, loc_shape) + rng.integers(0, sizes + 2, loc_shape) + rng.uniform(0.1, 0.9, loc_shape)
    locations = (pixel + 0.5) / sizes
    status = _corner_status(locations, shapes)
    assert {(status == s).sum() >= 3 for s in ("in", "partial", "out")} == {True}
    cotangent = rng.normal(size=(1, 3, 2 * 2))

    def ref_loss(v, loc, w):
        return float((_reference(v, shapes, loc, w) * cotangent).sum())

    def central_differences(args, i, eps=1e-6):
        grad = np.zeros_like(args[i])
        for idx in np.ndindex(args[i].shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[i][idx] += eps
            minus[i][idx] -= eps
            grad[idx] = (ref_loss(*plus) - ref_loss(*minus)) / (2 * eps)
        return grad

    args = [np.asarray(value, np.float64), locations, np.asarray(weights, np.float64)]
    with jax.enable_x64(True):
        loss = lambda v, loc, w: jnp.sum(multi_scale_deformable_attention(v, shapes, loc, w, method) * cotangent)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
        grads = [np.asarray(g) for g in grads]
    assert all(g.dtype == np.float64 for g in grads)
    for i, name in enumerate(("value", "locations", "weights")):
        np.testing.assert_allclose(grads[i], central_differences(args, i), rtol=1e-6, atol=1e-7, err_msg=name)

    loc_grad = np.abs(grads[1]).sum(-1)
    # No neighbour in the map: nothing sampled, nothing to move towards.
    assert np.all(loc_grad[status == "out"] == 0) and np.all(grads[2][status == "out"] == 0)
    # Partly outside: the inside neighbours still pull.
    assert np.all(loc_grad[status == "partial"] > 0)


@BOTH_METHODS
def test_bf16_value_is_accumulated_in_float32(method):
    value, locations, weights = sampling_inputs(np.random.default_rng(3))
    value_bf16 = jnp.asarray(value, jnp.bfloat16)
    got = multi_scale_deformable_attention(value_bf16, SHAPES, locations, weights, method)
    assert got.dtype == jnp.bfloat16
    got = np.asarray(got, np.float32)
    assert np.all(np.isfinite(got))
    full = np.asarray(multi_scale_deformable_attention(value, SHAPES, locations, weights, method))
    np.testing.assert_allclose(got, full, rtol=2e-2, atol=2e-2)
    # Given the rounded values, only the final cast to bf16 may differ (half a bf16 step).
    rounded = _reference(np.asarray(value_bf16, np.float32), SHAPES, locations, weights)
    np.testing.assert_allclose(got, rounded, rtol=2**-8, atol=1e-6)


@BOTH_METHODS
def test_jit_and_vmap_and_cost_analysis(method):
    value, locations, weights = sampling_inputs(np.random.default_rng(4))
    op = functools.partial(multi_scale_deformable_attention, spatial_shapes=SHAPES, method=method)
    eager = np.asarray(op(value, sampling_locations=locations, attention_weights=weights))

    # A leading axis over the same inputs, shifted per slice so that slices differ.
    stacked = [np.stack([a, a[::-1]]) for a in (value, locations, weights)]
    batched = jax.jit(jax.vmap(lambda v, loc, w: op(v, sampling_locations=loc, attention_weights=w)))(*stacked)
    np.testing.assert_allclose(np.asarray(batched[0]), eager, rtol=1e-6, atol=1e-6)
    second = op(stacked[0][1], sampling_locations=stacked[1][1], attention_weights=stacked[2][1])
    np.testing.assert_allclose(np.asarray(batched[1]), np.asarray(second), rtol=1e-6, atol=1e-6)

    compiled = (
        jax.jit(multi_scale_deformable_attention, static_argnums=(1, 4))
        .lower(value, SHAPES, locations, weights, method)
        .compile()
    )
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost["flops"] > 0 and cost["bytes accessed"] > 0
    assert "custom-call" not in compiled.as_text()  # plain XLA ops, no host callbacks


@BOTH_METHODS
def test_heads_sharding_splits_the_gather_without_communication(method):
    mesh = jax.make_mesh((4,), ("model",))
    value, locations, weights = sampling_inputs(np.random.default_rng(5), heads=4)
    heads = lambda rank: NamedSharding(mesh, P(*([None] * 2 + ["model"] + [None] * (rank - 3))))
    fn = jax.jit(
        functools.partial(multi_scale_deformable_attention, method=method),
        static_argnums=1,
        in_shardings=(heads(4), heads(6), heads(5)),
        out_shardings=NamedSharding(mesh, P(None, None, "model")),
    )
    compiled = fn.lower(value, SHAPES, locations, weights).compile()
    hlo = compiled.as_text()
    for collective in ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter"):
        assert collective not in hlo, collective
    got = compiled(value, locations, weights)
    np.testing.assert_allclose(np.asarray(got), _reference(value, SHAPES, locations, weights), rtol=1e-5, atol=1e-5)

    # The backward pass too (the gather's is a custom VJP): each device scatters into its own heads.
    loss = lambda v, loc, w: jnp.sum(multi_scale_deformable_attention(v, SHAPES, loc, w, method) ** 2)
    grad = jax.jit(
        jax.grad(loss, argnums=(0, 1, 2)),
        in_shardings=(heads(4), heads(6), heads(5)),
        out_shardings=(heads(4), heads(6), heads(5)),
    )
    hlo = grad.lower(value, locations, weights).compile().as_text()
    # The loss's own sum over heads is the one collective.
    assert hlo.count("all-reduce(") <= 1 and "all-gather" not in hlo and "all-to-all" not in hlo
    single = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(value, locations, weights)
    for sharded, one in zip(grad(value, locations, weights), single):
        np.testing.assert_allclose(np.asarray(sharded), np.asarray(one), rtol=1e-5, atol=1e-6)


def test_auto_uses_the_sampling_matrix_for_small_maps_only():
    value, locations, weights = sampling_inputs(np.random.default_rng(6))
    lowered = lambda method: jax.jit(
        functools.partial(multi_scale_deformable_attention, method=method), static_argnums=1
    ).lower(value, SHAPES, locations, weights)
    assert sum(h * w for h, w in SHAPES) <= deformable_attention.DENSE_MAX_POSITIONS
    assert lowered("auto").as_text() == lowered("matrix").as_text()
    assert lowered("auto").as_text() != lowered("gather").as_text()
    with pytest.raises(ValueError, match="method='nearest'"):
        multi_scale_deformable_attention(value, SHAPES, locations, weights, "nearest")


def test_gather_gradient_keeps_no_per_sample_rows():
    # Encoder self-attention's shape, every position a query (Q = S): the rows
    # gathered for all K = L * P * 4 samples would be B * H * Q * K * Dh floats.
    shapes = ((24, 24), (12, 12), (6, 6), (3, 3))
    batch, heads, points, head_dim = 1, 2, 4, 32
    num_values = sum(h * w for h, w in shapes)
    rng = np.random.default_rng(7)
    value = rng.normal(size=(batch, num_values, heads, head_dim)).astype(np.float32)
    locations = rng.uniform(0, 1, size=(batch, num_values, heads, len(shapes), points, 2)).astype(np.float32)
    weights = rng.uniform(0, 1, size=locations.shape[:-1]).astype(np.float32)
    loss = lambda v, loc, w: jnp.sum(multi_scale_deformable_attention(v, shapes, loc, w, "gather") ** 2)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(value, locations, weights).compile()
    all_rows_bytes = batch * heads * num_values * len(shapes) * points * 4 * head_dim * 4
    temp_bytes = compiled.memory_analysis().temp_size_in_bytes
    # JAX's own gradient of the gather holds them several times over (3.2x
    # here); the custom VJP about a third of them once.
    assert temp_bytes < all_rows_bytes / 2, (temp_bytes, all_rows_bytes)
