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
# The gather form works through the samples this many at a time (one point's four
# bilinear neighbours), so no pass holds more than [B, H, Q, 4, Dh] gathered rows.
SAMPLES_PER_CHUNK = 4


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

    Cost: gathers of ``B * H * Q * L * P * 4`` rows of Dh channels from
    ``value`` (batched over batch and heads, so heads stay a separate axis and a
    ``heads`` sharding splits them without communication), a multiply and a
    sum, taken one point's four neighbours at a time; the backward pass
    gathers the same rows again (for the weights' gradients) and scatter-adds
    into the value maps' gradient. A custom VJP keeps only the inputs for the
    backward pass, never the gathered rows, so no pass holds more than
    ``[B, H, Q, 4, Dh]`` of them: for encoder self-attention, where Q = S, the
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


def _corners(spatial_shapes, sampling_locations, attention_weights, compute_dtype):
    """The four bilinear neighbours of every sampling point: (indices, weights), each `[B, H, Q, K]`.

    K = L * P * 4, ordered (level, point, corner). `indices` (int32) are rows of
    the flattened value maps, always in bounds; `weights` are the bilinear
    weight times the attention weight, 0 for a neighbour outside its map. A
    differentiable function of the locations and attention weights (the
    floors carry no gradient), so the gather's backward pass gets their
    gradients from its `jax.vjp`.
    """
    batch, num_queries, num_heads = sampling_locations.shape[:3]
    # Per-level constants broadcast against [..., L, P]: the levels differ only in
    # size and offset, so one vectorised pass (and one gather) covers them all.
    heights = jnp.asarray(np.array([h for h, _ in spatial_shapes], np.float32)[:, None])
    widths = jnp.asarray(np.array([w for _, w in spatial_shapes], np.float32)[:, None])
    starts = np.concatenate([[0], np.cumsum([h * w for h, w in spatial_shapes])[:-1]])
    starts = jnp.asarray(starts.astype(np.int32)[:, None])
    widths_int = jnp.asarray(np.array([w for _, w in spatial_shapes], np.int32)[:, None])

    # [B, H, Q, L, P] from here on: heads next to batch, as in the gathers.
    loc = jnp.transpose(sampling_locations.astype(compute_dtype), (0, 2, 1, 3, 4, 5))
    attn = jnp.transpose(attention_weights.astype(compute_dtype), (0, 2, 1, 3, 4))
    # align_corners=False: pixel i covers [i, i + 1) after scaling, its centre at i + 0.5.
    x = loc[..., 0] * widths - 0.5
    y = loc[..., 1] * heights - 0.5
    x0 = jnp.floor(x)
    y0 = jnp.floor(y)
    # floor() has zero gradient, so the location gradient flows through these fractions only.
    fx = x - x0
    fy = y - y0

    indices, weights = [], []
    for dy, wy in ((0, 1.0 - fy), (1, fy)):
        for dx, wx in ((0, 1.0 - fx), (1, fx)):
            xi = x0 + dx
            yi = y0 + dy
            # Decided in float before the int cast, so far-away points cannot overflow int32.
            inside = (xi >= 0) & (xi <= widths - 1) & (yi >= 0) & (yi <= heights - 1)
            # Outside neighbours read some valid row and are weighted 0: padding without padding.
            xi = jnp.clip(xi, 0, widths - 1).astype(jnp.int32)
            yi = jnp.clip(yi, 0, heights - 1).astype(jnp.int32)
            indices.append(starts + yi * widths_int + xi)
            weights.append(jnp.where(inside, wy * wx * attn, 0.0))
    indices = jnp.stack(indices, axis=-1).reshape(batch, num_heads, num_queries, -1)
    weights = jnp.stack(weights, axis=-1).reshape(batch, num_heads, num_queries, -1)
    return indices, weights


def _chunks(x):
    """`[B, H, Q, K]` -> `[K / SAMPLES_PER_CHUNK, B, H, Q, SAMPLES_PER_CHUNK]`, the scans' sequence axis first."""
    *lead, k = x.shape
    return jnp.moveaxis(x.reshape(*lead, k // SAMPLES_PER_CHUNK, SAMPLES_PER_CHUNK), -2, 0)


def _gathered(value_bhsd, indices):
    """Rows of `value_bhsd [B, H, S, Dh]` at `indices [B, H, Q, k]`: `[B, H, Q, k, Dh]`."""
    batch, heads, queries, k = indices.shape
    # Indices are in bounds by construction; promising so skips XLA's own clamping.
    rows = jnp.take_along_axis(value_bhsd, indices.reshape(batch, heads, -1, 1), axis=2, mode="promise_in_bounds")
    return rows.reshape(batch, heads, queries, k, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_attention(spatial_shapes, value, sampling_locations, attention_weights):
    return _gather_attention_forward(spatial_shapes, value, sampling_locations, attention_weights)[0]


def _gather_attention_forward(spatial_shapes, value, sampling_locations, attention_weights):
    compute_dtype = accumulation_dtype(value, sampling_locations, attention_weights)
    indices, weights = _corners(spatial_shapes, sampling_locations, attention_weights, compute_dtype)
    value_bhsd = jnp.transpose(value, (0, 2, 1, 3))

    def accumulate(out, chunk):
        chunk_indices, chunk_weights = chunk
        rows = _gathered(value_bhsd, chunk_indices).astype(compute_dtype)
        for i in range(SAMPLES_PER_CHUNK):
            out = out + rows[:, :, :, i] * chunk_weights[..., i, None]
        return out, None

    batch, heads, queries, _ = indices.shape
    out = jnp.zeros((batch, heads, queries, value.shape[-1]), compute_dtype)
    out, _ = jax.lax.scan(accumulate, out, (_chunks(indices), _chunks(weights)))
    # Only the inputs are kept for the backward pass, never per-sample rows.
    return _heads_last(out).astype(value.dtype), (value, sampling_locations, attention_weights)


def _gather_attention_backward(spatial_shapes, residuals, out_grad):
    value, sampling_locations, attention_weights = residuals
    compute_dtype = accumulation_dtype(value, sampling_locations, attention_weights)
    batch, num_values, heads, head_dim = value.shape
    # The corners are recomputed from locations and weights that depend on the
    # gradient: from the inputs themselves, XLA would merge them with the
    # forward pass's corners and keep every layer's until the backward pass
    # (XLA:CPU drops optimisation barriers). Float rules keep x * 0 unfolded;
    # each query and head takes its own gradient's element, so a heads or
    # tokens sharding needs no communication for it.
    zero = out_grad.reshape(*out_grad.shape[:2], heads, head_dim)[..., :1] * 0  # [B, Q, H, 1]
    sampling_locations = sampling_locations + zero[..., None, None].astype(sampling_locations.dtype)
    attention_weights = attention_weights + zero[..., None].astype(attention_weights.dtype)
    corners = lambda loc, attn: _corners(spatial_shapes, loc, attn, compute_dtype)[::-1]
    weights, corners_vjp, indices = jax.vjp(corners, sampling_locations, attention_weights, has_aux=True)
    value_bhsd = jnp.transpose(value, (0, 2, 1, 3))
    grad_bhqd = jnp.transpose(out_grad.reshape(batch, -1, heads, head_dim).astype(compute_dtype), (0, 2, 1, 3))
    queries = grad_bhqd.shape[2]

    def head_scatter(rows_grad, head_indices, head_updates):  # [S, Dh], [Q * k], [Q * k, Dh]
        return rows_grad.at[head_indices].add(head_updates, mode="promise_in_bounds")

    def accumulate(value_grad, chunk):
        chunk_indices, chunk_weights = chunk
        rows = _gathered(value_bhsd, chunk_indices).astype(compute_dtype)
        # d out / d weight of a sample: the sampled row against the output's gradient.
        weights_grad = jnp.sum(rows * grad_bhqd[:, :, :, None, :], axis=-1)
        updates = (chunk_weights[..., None] * grad_bhqd[:, :, :, None, :]).reshape(batch, heads, -1, head_dim)
        value_grad = jax.vmap(jax.vmap(head_scatter))(value_grad, chunk_indices.reshape(batch, heads, -1), updates)
        return value_grad, weights_grad

    value_grad = jnp.zeros((batch, heads, num_values, head_dim), compute_dtype)
    value_grad, weights_grad = jax.lax.scan(accumulate, value_grad, (_chunks(indices), _chunks(weights)))
    weights_grad = jnp.moveaxis(weights_grad, 0, -2).reshape(batch, heads, queries, -1)
    locations_grad, attention_weights_grad = corners_vjp(weights_grad)
    value_grad = jnp.transpose(value_grad, (0, 2, 1, 3)).astype(value.dtype)
    return value_grad, locations_grad, attention_weights_grad


_gather_attention.defvjp(_gather_attention_forward, _gather_attention_backward)
