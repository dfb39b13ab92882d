"""Multi-scale deformable attention (Deformable DETR, Zhu et al. 2021), the core sampling step.

Each query attends to a few (P) sampled points on each of L feature levels per
head, instead of to every position: the value maps are bilinearly sampled at
the given locations and the samples summed with the given attention weights.
The projections that predict locations and weights around it belong to the
network; this module is the pure array function only.

Conventions follow Deformable DETR's PyTorch core (``ms_deform_attn_core_pytorch``):
locations are normalised ``(x, y)``, 0 and 1 being the map's outer edges and
pixel ``i``'s centre at ``(i + 0.5) / w``; the sampling is
``grid_sample(mode='bilinear', padding_mode='zeros', align_corners=False)``,
so each of the four bilinear neighbours that falls outside the map contributes
zero (a point half a pixel outside still gets half its weight from the edge).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from detector.ops.attention import accumulation_dtype

# `method="auto"` uses the sampling matrix up to this many value positions (all
# levels together), where its matmul and scalar scatter beat the row gathers:
# measured forward + backward on a 2-core CPU with Q = S, 2x faster at S = 340
# (the tiny DINO's 128 px pyramid); at S = 1360 the gathers were 2.3-3x faster
# (and held a quarter of the memory); larger maps gather.
DENSE_MAX_POSITIONS = 512
METHODS = ("auto", "gather", "matrix")


def multi_scale_deformable_attention(
    value,
    spatial_shapes: Sequence[tuple[int, int]],
    sampling_locations,
    attention_weights,
    method: str = "auto",
):
    """Bilinearly samples each level's value map at the given points and sums the samples with the given weights.

    Shapes: B batch, S = sum over levels of h_l * w_l flattened positions, H heads,
    Dh channels per head, Q queries, L levels, P points per level and head.

    Args:
        value: float ``[B, S, H, Dh]``, the levels' value maps flattened row-major
            (y, then x) and concatenated in ``spatial_shapes`` order. May be bf16.
        spatial_shapes: static ``(h_l, w_l)`` per level in pixels of that level, as
            Python ints (shapes must be known at trace time).
        sampling_locations: float ``[B, Q, H, L, P, 2]``, normalised ``(x, y)``
            per level: 0 and 1 are the outer edges of the map, pixel centres at
            ``(i + 0.5) / w_l``. Any value is allowed: a point on the edge gets
            half the edge pixel, one half a pixel or more beyond it gets zero.
        attention_weights: float ``[B, Q, H, L, P]``, already normalised by the
            caller (Deformable DETR softmaxes over L * P).

    Returns:
        ``[B, Q, H * Dh]`` in ``value``'s dtype, heads major then channels (the
        layout of ``value.reshape(B, S, H * Dh)``).

    Precision: the bilinear and attention weights and the accumulation are
    float32 whatever the inputs (float64 if any input is); only the gathered
    values travel in ``value``'s dtype, so bf16 values halve the bytes read
    without losing the sum's precision.

    Cost: gathers of ``B * Q * H * L * P * 4`` rows of Dh channels from
    ``value`` (batched over batch and heads, so heads stay a separate axis and a
    ``heads`` sharding splits them without communication), a multiply and a
    sum, taken one point's four neighbours at a time in the inputs' own
    ``[B, Q, H, ...]`` layout (nothing is transposed); the backward pass
    gathers the same rows again (for the weights' gradients) and scatter-adds
    into the value maps' gradient. A custom VJP keeps only the inputs for the
    backward pass, never the gathered rows, so no pass holds more than
    ``[B, Q, H, 4, Dh]`` of them: for encoder self-attention, where Q = S, the
    rows of all samples would be ``L * P`` times that. Plain XLA ops, usable
    under ``jit``, ``vmap`` and ``grad``, static shapes throughout; a fused
    kernel with the same signature can replace it.

    ``method``: "gather" as above; "matrix" adds the same bilinear x
    attention weights into a ``[B, H, Q, S]`` sampling matrix (a scatter of
    scalars, not of Dh-wide rows) and applies it with one matmul per batch
    and head (``B * H * Q * S * Dh`` multiply-adds; JAX's own gradient);
    "auto" takes "matrix" when S is at most ``DENSE_MAX_POSITIONS``. Both give
    the same values and gradients.
    """
    spatial_shapes = tuple((int(h), int(w)) for h, w in spatial_shapes)
    batch, num_values, num_heads, head_dim = value.shape
    b, num_queries, h_, num_levels, num_points, two = sampling_locations.shape
    if num_values != sum(h * w for h, w in spatial_shapes):
        raise ValueError(f"value has {num_values} positions, spatial_shapes {spatial_shapes} sum to a different count")
    if (b, h_, num_levels, two) != (batch, num_heads, len(spatial_shapes), 2):
        raise ValueError(
            f"sampling_locations shape {sampling_locations.shape} does not fit value {value.shape} "
            f"and {len(spatial_shapes)} levels"
        )
    if attention_weights.shape != sampling_locations.shape[:-1]:
        raise ValueError(f"attention_weights shape {attention_weights.shape}, expected {sampling_locations.shape[:-1]}")
    if method not in METHODS:
        raise ValueError(f"method={method!r}; use one of {', '.join(METHODS)}")

    if method == "gather" or (method == "auto" and num_values > DENSE_MAX_POSITIONS):
        return _gather_attention(spatial_shapes, value, sampling_locations, attention_weights)
    compute_dtype = accumulation_dtype(value, sampling_locations, attention_weights)

    # The sampling matrix: batch and heads stay scatter batch axes (so a heads
    # sharding splits the scatter without communication); within one, a single
    # flat index per sample is cheaper for XLA than index vectors.
    indices, weights = _corners(spatial_shapes, sampling_locations, attention_weights, compute_dtype)
    rows = jnp.arange(num_queries, dtype=jnp.int32)[:, None] * num_values

    def head_matrix(head_indices, head_weights):  # [Q, K] -> [Q, S]
        flat = jnp.zeros((num_queries * num_values,), head_weights.dtype)
        flat = flat.at[(rows + head_indices).reshape(-1)].add(head_weights.reshape(-1), mode="promise_in_bounds")
        return flat.reshape(num_queries, num_values)

    matrix = jax.vmap(jax.vmap(head_matrix))(indices, weights)  # [B, H, Q, S]
    out = jnp.einsum("bhqs,bhsd->bhqd", matrix, jnp.transpose(value, (0, 2, 1, 3)).astype(compute_dtype))
    return _heads_last(out).astype(value.dtype)


def _heads_last(out_bhqd):
    """`[B, H, Q, Dh]` -> `[B, Q, H * Dh]`."""
    batch, heads, queries, head_dim = out_bhqd.shape
    return jnp.transpose(out_bhqd, (0, 2, 1, 3)).reshape(batch, queries, heads * head_dim)


def _bilinear_corners(x_normalised, y_normalised, attention, height, width, start):
    """The four bilinear neighbours of sampling points: (indices, weights), each the inputs' shape + `[4]`.

    `x_normalised`, `y_normalised`, `attention` are float arrays of one shape;
    `height`, `width` (float) and `start` (int32, the level's first row in the
    flattened maps) broadcast against them. `indices` (int32) are rows of the
    flattened value maps, always in bounds; `weights` the bilinear weight
    times the attention weight, 0 for a neighbour outside its map. A
    differentiable function of locations and attention (the floors carry no
    gradient), so the backward passes get those gradients from its `jax.vjp`.
    """
    # align_corners=False: pixel i covers [i, i + 1) after scaling, its centre at i + 0.5.
    x = x_normalised * width - 0.5
    y = y_normalised * height - 0.5
    x0 = jnp.floor(x)
    y0 = jnp.floor(y)
    # floor() has zero gradient, so the location gradient flows through these fractions only.
    fx = x - x0
    fy = y - y0
    width_int = width.astype(jnp.int32)
    indices, weights = [], []
    for dy, wy in ((0, 1.0 - fy), (1, fy)):
        for dx, wx in ((0, 1.0 - fx), (1, fx)):
            xi = x0 + dx
            yi = y0 + dy
            # Decided in float before the int cast, so far-away points cannot overflow int32.
            inside = (xi >= 0) & (xi <= width - 1) & (yi >= 0) & (yi <= height - 1)
            # Outside neighbours read some valid row and are weighted 0: padding without padding.
            xi = jnp.clip(xi, 0, width - 1).astype(jnp.int32)
            yi = jnp.clip(yi, 0, height - 1).astype(jnp.int32)
            indices.append(start + yi * width_int + xi)
            weights.append(jnp.where(inside, wy * wx * attention, 0.0))
    return jnp.stack(indices, axis=-1), jnp.stack(weights, axis=-1)


def _level_constants(spatial_shapes, repeats: int = 1):
    """Per level (each repeated `repeats` times): heights and widths (float32) and first rows (int32), numpy."""
    heights = np.repeat(np.array([h for h, _ in spatial_shapes], np.float32), repeats)
    widths = np.repeat(np.array([w for _, w in spatial_shapes], np.float32), repeats)
    starts = np.concatenate([[0], np.cumsum([h * w for h, w in spatial_shapes])[:-1]]).astype(np.int32)
    return heights, widths, np.repeat(starts, repeats)


def _corners(spatial_shapes, sampling_locations, attention_weights, compute_dtype):
    """Every sampling point's four bilinear neighbours, heads next to batch: (indices, weights), each `[B, H, Q, K]`.

    K = L * P * 4, ordered (level, point, corner). For the sampling matrix.
    """
    batch, num_queries, num_heads = sampling_locations.shape[:3]
    heights, widths, starts = (jnp.asarray(c[:, None]) for c in _level_constants(spatial_shapes))
    loc = jnp.transpose(sampling_locations.astype(compute_dtype), (0, 2, 1, 3, 4, 5))
    attn = jnp.transpose(attention_weights.astype(compute_dtype), (0, 2, 1, 3, 4))
    indices, weights = _bilinear_corners(loc[..., 0], loc[..., 1], attn, heights, widths, starts)
    return indices.reshape(batch, num_heads, num_queries, -1), weights.reshape(batch, num_heads, num_queries, -1)


# Rows of `value [B, S, H, Dh]` at `indices [B, Q, H, k, 1]`, batched over images and
# heads (so a heads or batch sharding splits gather and scatter without communication):
# `[B, Q, H, k, Dh]`, already in the output's and the gradient's layout.
_ROWS = dict(
    offset_dims=(4,),
    collapsed_slice_dims=(1,),
    start_index_map=(1,),
    operand_batching_dims=(0, 2),
    start_indices_batching_dims=(0, 2),
)
_ROW_UPDATES = dict(
    update_window_dims=(4,),
    inserted_window_dims=(1,),
    scatter_dims_to_operand_dims=(1,),
    operand_batching_dims=(0, 2),
    scatter_indices_batching_dims=(0, 2),
)


def _gathered(value, indices):
    """Rows of `value [B, S, H, Dh]` at `indices [B, Q, H, k]`, within each image and head: `[B, Q, H, k, Dh]`."""
    return jax.lax.gather(
        value,
        indices[..., None],
        jax.lax.GatherDimensionNumbers(**_ROWS),
        slice_sizes=(1, 1, 1, value.shape[-1]),
        # In bounds by construction; promising so skips XLA's own clamping.
        mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
    )


def _scattered(value_grad, indices, updates):
    """`value_grad [B, S, H, Dh]` plus `updates [B, Q, H, k, Dh]` added at rows `indices [B, Q, H, k]`."""
    return jax.lax.scatter_add(
        value_grad,
        indices[..., None],
        updates,
        jax.lax.ScatterDimensionNumbers(**_ROW_UPDATES),
        mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
    )


def _flat_points(sampling_locations, attention_weights):
    """`[B, Q, H, L, P, 2]`, `[B, Q, H, L, P]` -> `[B, Q, H, L * P, 2]`, `[B, Q, H, L * P]` (views)."""
    batch, queries, heads, levels, points, _ = sampling_locations.shape
    flat = (batch, queries, heads, levels * points)
    return sampling_locations.reshape(*flat, 2), attention_weights.reshape(flat)


def _point_inputs(locations, attention, levels, point, compute_dtype):
    """Sampling point `point` of every query and head: `(x, y) [B, Q, H, 2]`, attention `[B, Q, H]`, its level.

    `locations`, `attention` as `_flat_points` gives them; `levels` the
    per-point `_level_constants`; `point` (traced) counts (level, point)
    pairs. The loops below walk the points in the inputs' own layout, one
    point (four neighbours) at a time, so nothing is transposed and no pass
    holds more than `[B, Q, H, 4, Dh]` gathered rows.
    """
    loc = jax.lax.dynamic_index_in_dim(locations, point, axis=3, keepdims=False).astype(compute_dtype)
    attn = jax.lax.dynamic_index_in_dim(attention, point, axis=3, keepdims=False).astype(compute_dtype)
    return loc, attn, tuple(jnp.asarray(constant)[point] for constant in levels)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_attention(spatial_shapes, value, sampling_locations, attention_weights):
    return _gather_attention_forward(spatial_shapes, value, sampling_locations, attention_weights)[0]


def _gather_attention_forward(spatial_shapes, value, sampling_locations, attention_weights):
    compute_dtype = accumulation_dtype(value, sampling_locations, attention_weights)
    batch, num_queries, heads, levels, num_points, _ = sampling_locations.shape
    locations, attention = _flat_points(sampling_locations, attention_weights)
    levels_per_point = _level_constants(spatial_shapes, num_points)

    def accumulate(point, out):
        loc, attn, level = _point_inputs(locations, attention, levels_per_point, point, compute_dtype)
        indices, weights = _bilinear_corners(loc[..., 0], loc[..., 1], attn, *level)
        rows = _gathered(value, indices).astype(compute_dtype)
        for corner in range(4):
            out = out + rows[:, :, :, corner] * weights[..., corner, None]
        return out

    out = jnp.zeros((batch, num_queries, heads, value.shape[-1]), compute_dtype)
    out = jax.lax.fori_loop(0, levels * num_points, accumulate, out)
    # Only the inputs are kept for the backward pass, never per-sample rows.
    return out.reshape(batch, num_queries, -1).astype(value.dtype), (value, sampling_locations, attention_weights)


def _gather_attention_backward(spatial_shapes, residuals, out_grad):
    value, sampling_locations, attention_weights = residuals
    compute_dtype = accumulation_dtype(value, sampling_locations, attention_weights)
    batch, num_queries, heads, levels, num_points, _ = sampling_locations.shape
    locations, attention = _flat_points(sampling_locations, attention_weights)
    grad = out_grad.reshape(batch, num_queries, heads, -1).astype(compute_dtype)  # [B, Q, H, Dh]
    # The corners are recomputed from locations and weights that depend on the
    # gradient: from the inputs themselves, XLA may merge them with the forward
    # pass's corners and keep every layer's until the backward pass (XLA:CPU
    # drops optimisation barriers). Float rules keep x * 0 unfolded; each
    # query and head takes its own gradient's element, so a heads or tokens
    # sharding needs no communication for it.
    zero = grad[..., :1] * 0  # [B, Q, H, 1]
    levels_per_point = _level_constants(spatial_shapes, num_points)

    def accumulate(point, grads):
        value_grad, locations_grad, attention_grad = grads
        point_loc, point_attn, level = _point_inputs(locations, attention, levels_per_point, point, compute_dtype)

        def corners(loc, attn):
            loc, attn = loc + zero, attn + zero[..., 0]
            return _bilinear_corners(loc[..., 0], loc[..., 1], attn, *level)[::-1]

        weights, corners_vjp, indices = jax.vjp(corners, point_loc, point_attn, has_aux=True)
        rows = _gathered(value, indices).astype(compute_dtype)  # [B, Q, H, 4, Dh]
        # d out / d weight of a neighbour: its row against the output's gradient
        # (a batched matrix-vector product; as a broadcast product and a sum,
        # XLA:CPU wrote the gradient out four times over).
        weights_grad = jnp.einsum("bqhcd,bqhd->bqhc", rows, grad)
        value_grad = _scattered(value_grad, indices, weights[..., None] * grad[:, :, :, None, :])
        point_loc_grad, point_attn_grad = corners_vjp(weights_grad)
        locations_grad = jax.lax.dynamic_update_index_in_dim(locations_grad, point_loc_grad, point, axis=3)
        attention_grad = jax.lax.dynamic_update_index_in_dim(attention_grad, point_attn_grad, point, axis=3)
        return value_grad, locations_grad, attention_grad

    grads = (
        jnp.zeros(value.shape, compute_dtype),
        jnp.zeros(locations.shape, compute_dtype),
        jnp.zeros(attention.shape, compute_dtype),
    )
    value_grad, locations_grad, attention_grad = jax.lax.fori_loop(0, levels * num_points, accumulate, grads)
    return (
        value_grad.astype(value.dtype),
        locations_grad.reshape(sampling_locations.shape).astype(sampling_locations.dtype),
        attention_grad.reshape(attention_weights.shape).astype(attention_weights.dtype),
    )


_gather_attention.defvjp(_gather_attention_forward, _gather_attention_backward)
