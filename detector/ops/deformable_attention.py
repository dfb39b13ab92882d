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

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# `method="auto"` uses the sampling matrix up to this many value positions (all
# levels together): its matmul and scalar scatter beat the row gather and its
# scatter-add gradient by 4-5x on a CPU at S = 340, and the [B, H, Q, S]
# matrix stays small; larger maps gather.
DENSE_MAX_POSITIONS = 1024
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

    Cost: one gather of ``B * H * Q * L * P * 4`` rows of Dh channels from
    ``value`` (batched over batch and heads, so heads stay a separate axis and a
    ``heads`` sharding splits the gather without communication), a multiply and
    a sum; gradients scatter-add into ``value``. Under ``grad`` the gathered
    ``[B, H, Q, L * P * 4, Dh]`` block is kept for the backward pass (the
    location and weight gradients need it): for encoder self-attention, where
    Q = S, wrap the caller in ``jax.checkpoint`` if that does not fit. Plain
    XLA ops, usable under ``jit``, ``vmap`` and ``grad``, static shapes throughout.

    ``method``: "gather" as above; "matrix" adds the same bilinear x
    attention weights into a ``[B, H, Q, S]`` sampling matrix (a scatter of
    scalars, not of Dh-wide rows) and applies it with one matmul per batch
    and head (``B * H * Q * S * Dh`` multiply-adds); "auto" takes "matrix"
    when S is at most ``DENSE_MAX_POSITIONS``. Both give the same values and
    gradients.
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

    # Per-level constants broadcast against [..., L, P]: the levels differ only in
    # size and offset, so one vectorised pass (and one gather) covers them all.
    heights = jnp.asarray(np.array([h for h, _ in spatial_shapes], np.float32)[:, None])
    widths = jnp.asarray(np.array([w for _, w in spatial_shapes], np.float32)[:, None])
    starts = np.concatenate([[0], np.cumsum([h * w for h, w in spatial_shapes])[:-1]])
    starts = jnp.asarray(starts.astype(np.int32)[:, None])
    widths_int = jnp.asarray(np.array([w for _, w in spatial_shapes], np.int32)[:, None])

    # [B, H, Q, L, P] from here on: heads next to batch, as in the gather below.
    # float32 at least (float64 stays float64, for gradient checks).
    compute_dtype = jnp.promote_types(jnp.float32, jnp.result_type(value, sampling_locations, attention_weights))
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
    # [B, H, Q, K] with K = L * P * 4 samples per query and head.
    indices = jnp.stack(indices, axis=-1).reshape(batch, num_heads, num_queries, -1)
    weights = jnp.stack(weights, axis=-1).reshape(batch, num_heads, num_queries, -1)

    value_bhsd = jnp.transpose(value, (0, 2, 1, 3))
    if method == "matrix" or (method == "auto" and num_values <= DENSE_MAX_POSITIONS):
        # Batch and heads stay scatter batch axes (so a heads sharding splits the
        # scatter without communication); within one, a single flat index per
        # sample is cheaper for XLA than index vectors.
        rows = jnp.arange(num_queries, dtype=jnp.int32)[:, None] * num_values

        def head_matrix(head_indices, head_weights):  # [Q, K] -> [Q, S]
            flat = jnp.zeros((num_queries * num_values,), head_weights.dtype)
            flat = flat.at[(rows + head_indices).reshape(-1)].add(head_weights.reshape(-1), mode="promise_in_bounds")
            return flat.reshape(num_queries, num_values)

        matrix = jax.vmap(jax.vmap(head_matrix))(indices, weights)  # [B, H, Q, S]
        out = jnp.einsum("bhqs,bhsd->bhqd", matrix, value_bhsd.astype(compute_dtype))
        out = jnp.transpose(out, (0, 2, 1, 3)).reshape(batch, num_queries, num_heads * head_dim)
        return out.astype(value.dtype)
    flat_indices = indices.reshape(batch, num_heads, -1, 1)
    # Indices are clipped above; promising so skips XLA's own clamping.
    sampled = jnp.take_along_axis(value_bhsd, flat_indices, axis=2, mode="promise_in_bounds")
    sampled = sampled.reshape(batch, num_heads, num_queries, -1, head_dim)
    # Multiply-and-sum rather than einsum: a dot would force the gathered [.., K, Dh]
    # block into memory, an elementwise reduce lets XLA fuse the gather into it.
    out = jnp.sum(sampled.astype(compute_dtype) * weights[..., None], axis=3)  # [B, H, Q, Dh]
    out = jnp.transpose(out, (0, 2, 1, 3)).reshape(batch, num_queries, num_heads * head_dim)
    return out.astype(value.dtype)
