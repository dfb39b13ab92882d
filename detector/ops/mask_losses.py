"""Mask DINO's mask losses and matching costs on point-sampled logits (Mask2Former's recipe), in jnp.

A query's mask logits are the dot product of its mask embedding [C] with the
pixel embedding map [Hm, Wm, C] (stride 4). Mask2Former and Mask DINO never
train on whole maps: the matcher compares predictions and ground truth at P
uniform points per image, and the loss at P points per matched mask, most of
them where the prediction is uncertain (|logit| small). Here a logit map is
never built either: bilinear sampling is linear, so sampling the pixel
embedding at the points and then taking the dot products gives the sampled
logit map's values exactly, at [P, C] + [Q, P] memory instead of [Q, Hm, Wm]
per decoder layer; the backward pass scatters [P, C] into the embedding's
gradient, which exists anyway.

Points are (y, x) in [0, 1] of the map they sample; sampling follows
detectron2's `point_sample` (torch `grid_sample`, align_corners=False, zero
padding): a point (y, x) is at cell coordinates (y * H - 0.5, x * W - 0.5),
cell centres at integers. The ground-truth grid and the pixel embedding must
therefore cover the same extent of the network image (the same stride, or
an image size both strides divide).

One set of points per image for every set of queries. A detector scores
many sets of queries per image (Mask DINO: every decoder layer, the encoder
proposals, the denoising groups). Mask2Former draws each layer's points
anew; here every set is matched at one set of uniform points and trained
from one importance pool per image and step, so the pixel embedding and the
ground truth are sampled there once, not once per set (at 1024 px, 19 sets
and P = 112^2 the per-set samples were 9 GB of a step's peak). Each set's
expected loss is unchanged; only the sets' random points are shared.

Matching (no gradient; Q queries, M ground-truth slots):

    points = uniform_points(keys, P)                                       # [B, P, 2], once
    sampled = sample_pixel_embedding(pixel_embedding, points)              # [B, P, C], once
    targets = mask_targets_at_points(gt_masks, points)                     # [B, M, P], once
    logits = logits_at_samples(query_mask_embedding, sampled)              # [B, Q, P], per set
    cost = w_bce * mask_bce_cost(logits, targets) + w_dice * mask_dice_cost(logits, targets)   # [B, Q, M]

Importance sampling without per-mask samples of the embedding: Mask2Former
draws each mask's 3P candidate points and P/4 fresh points independently,
which would need the embedding sampled at [M, 3.25P] points ([M, 3.25P, C]:
GBs for 100 masks at P = 112^2). Here all masks of an image draw from one
shared pool of 3.25P uniform points (`importance_point_pool`): its first
int(oversample_ratio * P) points are every mask's candidates, the rest every
mask's fresh points, and each mask selects its P points as indices into the
pool (`uncertain_points`). Each mask alone still sees exactly Mask2Former's
distribution (iid uniform candidates, its own most uncertain kept, iid
uniform fresh points), so the expected loss is unchanged; only the masks of
one image now share their random points. The loss, with `rows` [B, R, C]
the mask embeddings of the queries trained on a mask, `source` [B, R] the
ground-truth mask each is trained on and `weights` [B, R] 1 where a row is
a matched box with a valid mask:

    pool = importance_point_pool(keys, P)                                  # [B, K, 2], once
    pool_embedding = sample_pixel_embedding(pixel_embedding, pool)         # [B, K, C], once
    pool_targets = mask_targets_at_points(gt_masks, pool)                  # [B, M, K], once
    pool_logits = logits_at_samples(rows, pool_embedding)                  # [B, R, K], per set
    index = uncertain_points(pool_logits, P)                               # [B, R, P] (no gradient)
    logits = jnp.take_along_axis(pool_logits, index, axis=-1)             # [B, R, P], with gradient
    targets = pool_targets_of_rows(pool_targets, source, index)           # [B, R, P]
    loss = w_bce * sigmoid_bce_loss(logits, targets, weights, num_masks) + w_dice * dice_loss(...)

Randomness: the point-drawing functions take one key per image ([B] typed
keys), which the caller derives from (config seed, step, image id) with
`jax.random.fold_in` (`image_keys`), then per use (matching or loss) with
`fold_in_keys`. An image's points therefore do not depend on its batch
position, micro-batch or device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def unpack_masks(packed, width: int):
    """Bit-packed mask rows -> bool cells (numpy `unpackbits` along the last axis, cropped).

    Args:
      packed: uint8 [..., Hm, ceil(Wm / 8)], 8 cells to a byte, the first cell
        in the high bit (numpy `packbits` order; `input_pipeline.masks`).
      width: Wm, the cells of a row (static).

    Returns:
      bool [..., Hm, Wm].
    """
    packed = jnp.asarray(packed, jnp.uint8)
    num_bytes = packed.shape[-1]
    if not 8 * (num_bytes - 1) < width <= 8 * num_bytes:
        raise ValueError(f"{num_bytes} bytes per row cannot hold {width} cells packed 8 to a byte")
    # Shifts 7..0: the high bit is the first cell of a byte.
    shifts = jnp.arange(7, -1, -1, dtype=jnp.uint8)
    bits = (packed[..., None] >> shifts) & 1
    return bits.reshape(*packed.shape[:-1], 8 * num_bytes)[..., :width].astype(bool)


def _bilinear_taps(points, height: int, width: int):
    """The four cells around each point and their bilinear weights (grid_sample, align_corners=False, zero padding).

    Args:
      points: float [..., 2] (y, x) in [0, 1] of the map (any value allowed; outside reads zeros).
      height, width: the map's size, cells.

    Returns:
      (index int32 [..., 4] into the row-major flattened map, weight float32
      [..., 4]); a tap outside the map gets weight 0 and a clamped index.
    """
    points = jax.lax.stop_gradient(jnp.asarray(points, jnp.float32))
    y = points[..., 0] * height - 0.5
    x = points[..., 1] * width - 0.5
    y0, x0 = jnp.floor(y), jnp.floor(x)
    dy, dx = y - y0, x - x0
    # Taps in the order (y0, x0), (y0, x0+1), (y0+1, x0), (y0+1, x0+1).
    rows = y0[..., None] + jnp.array([0.0, 0.0, 1.0, 1.0])
    cols = x0[..., None] + jnp.array([0.0, 1.0, 0.0, 1.0])
    weight_y = jnp.stack([1.0 - dy, 1.0 - dy, dy, dy], axis=-1)
    weight_x = jnp.stack([1.0 - dx, dx, 1.0 - dx, dx], axis=-1)
    inside = (rows >= 0) & (rows <= height - 1) & (cols >= 0) & (cols <= width - 1)
    weight = jnp.where(inside, weight_y * weight_x, 0.0)
    index = jnp.clip(rows, 0, height - 1).astype(jnp.int32) * width + jnp.clip(cols, 0, width - 1).astype(jnp.int32)
    return index, weight


def _sample_maps(maps, points):
    """maps [..., H, W] at points [..., P, 2] -> [..., P]; the leading axes of points broadcast against the maps'."""
    height, width = maps.shape[-2:]
    index, weight = _bilinear_taps(points, height, width)
    flat = maps.reshape(*maps.shape[:-2], height * width)
    # One gather of the 4 taps of every point (broadcast over the maps' leading axes), then their weighted sum.
    taps = jnp.take_along_axis(flat, index.reshape(*index.shape[:-2], -1), axis=-1, mode="promise_in_bounds")
    taps = taps.reshape(*taps.shape[:-1], -1, 4)
    # bool ground truth and bfloat16 maps are summed in float32.
    return jnp.sum(taps.astype(jnp.promote_types(taps.dtype, jnp.float32)) * weight, axis=-1)


def point_sample(maps, points):
    """Bilinear samples of each image's maps at that image's points (detectron2's `point_sample`).

    Args:
      maps: [B, N, H, W] (float or bool), N maps per image.
      points: float [B, P, 2] (y, x) normalised to [0, 1] of the map, shared by the N maps of an image.
        A point (y, x) reads cell coordinates (y * H - 0.5, x * W - 0.5); taps outside the map read 0.

    Returns:
      float32 [B, N, P] (float64 with float64 maps).
    """
    return _sample_maps(jnp.asarray(maps), jnp.asarray(points)[:, None])


def point_sample_per_map(maps, points):
    """Like `point_sample`, with its own points for each map.

    Args:
      maps: [B, N, H, W] (float or bool).
      points: float [B, N, P, 2] (y, x) in [0, 1].

    Returns:
      float32 [B, N, P].
    """
    return _sample_maps(jnp.asarray(maps), jnp.asarray(points))


def sample_pixel_embedding(pixel_embedding, points):
    """The channels-last pixel embedding bilinearly sampled at each image's points (`point_sample` semantics).

    Args:
      pixel_embedding: float [B, H, W, C] (the network's layout).
      points: float [B, P, 2] (y, x) in [0, 1].

    Returns:
      float32 [B, P, C]: row p is the embedding at point p, zeros outside the map.
    """
    pixel_embedding = jnp.asarray(pixel_embedding)
    batch, height, width, channels = pixel_embedding.shape
    index, weight = _bilinear_taps(points, height, width)
    flat = pixel_embedding.reshape(batch, height * width, channels)
    dtype = jnp.promote_types(flat.dtype, jnp.float32)
    # One tap at a time: gathering all four at once would hold [B, 4P, C] (GBs at 1024 px and 40k points)
    # twice, for the gather and its weighting. A weighted sum, not an einsum: a 4-term contraction lowered
    # to a matmul could run in TF32 on GPUs. The indices are clamped into the map by _bilinear_taps.
    sampled = None
    for tap in range(4):
        rows = jnp.take_along_axis(flat, index[..., tap, None], axis=1, mode="promise_in_bounds")
        term = rows.astype(dtype) * weight[..., tap, None]
        sampled = term if sampled is None else sampled + term
    return sampled


def logits_at_samples(mask_embedding, sampled_embedding, precision=None):
    """Mask logits of N queries at points where the pixel embedding was sampled (`sample_pixel_embedding`).

    Args:
      mask_embedding: float [B, N, C], one embedding per query (or per matched mask).
      sampled_embedding: float [B, P, C], the pixel embedding at each image's P points.
      precision: the einsum's `jax.lax.Precision` (None: the default).

    Returns:
      float32 [B, N, P] logits.
    """
    return jnp.einsum(
        "bnc,bpc->bnp",
        jnp.asarray(mask_embedding, jnp.float32),
        jnp.asarray(sampled_embedding, jnp.float32),
        precision=precision,
    )


def mask_logits_at_points(mask_embedding, pixel_embedding, points, precision=None):
    """Mask logits of N queries at each image's points, without their [N, H, W] logit maps.

    A query's logit map is the dot product of its mask embedding with the
    pixel embedding at every pixel; bilinear sampling is linear, so its
    samples are the dot products with the sampled pixel embedding.

    Args:
      mask_embedding: float [B, N, C], one embedding per query (or per matched mask).
      pixel_embedding: float [B, H, W, C].
      points: float [B, P, 2] (y, x) in [0, 1].
      precision: the einsum's `jax.lax.Precision` (None: the default).

    Returns:
      float32 [B, N, P] logits.
    """
    return logits_at_samples(mask_embedding, sample_pixel_embedding(pixel_embedding, points), precision)


def mask_targets_at_points(masks, points):
    """Ground-truth masks at each image's points (Mask2Former's `point_sample(tgt_masks, ...)`), soft at edges.

    Args:
      masks: bool [B, M, Hm, Wm] (`unpack_masks` of the batch's `masks`).
      points: float [B, P, 2] (y, x) in [0, 1], shared by the M masks of an image.

    Returns:
      float32 [B, M, P] in [0, 1]: the bilinear sample of each 0/1 map.
    """
    return point_sample(masks, points)


def mask_targets_at_mask_points(masks, points):
    """Ground-truth masks at each mask's own points (importance-sampled points differ per mask).

    Args:
      masks: bool [B, M, Hm, Wm].
      points: float [B, M, P, 2] (y, x) in [0, 1].

    Returns:
      float32 [B, M, P] in [0, 1].
    """
    return point_sample_per_map(masks, points)


def image_keys(seed: int, step, image_ids):
    """One PRNG key per image: fold_in(fold_in(key(seed), step), image_id).

    The same image at the same step gets the same key whichever batch
    position, micro-batch or device it has (the train step's `step_rng` is
    fold_in(key(seed), step), so this equals folding the image ids into it).

    Args:
      seed: the config's seed.
      step: int scalar (may be traced), the train step.
      image_ids: int32 [B] (padding images, id -1, share a key: their masks carry no weight).

    Returns:
      typed keys [B].
    """
    step_key = jax.random.fold_in(jax.random.key(seed), step)
    return fold_in_keys(jnp.broadcast_to(step_key, jnp.shape(image_ids)), image_ids)


def fold_in_keys(keys, data):
    """`jax.random.fold_in` of each key (typed keys [B]) with `data` (int scalar or [B]); e.g. a layer index."""
    data = jnp.broadcast_to(jnp.asarray(data, jnp.int32), keys.shape)
    return jax.vmap(jax.random.fold_in)(keys, data)


def uniform_points(keys, num_points: int):
    """`num_points` uniform points per image, each image's from its own key (the matcher's points).

    Args:
      keys: typed keys [B], one per image (`image_keys`, then `fold_in_keys` per use).
      num_points: P (static).

    Returns:
      float32 [B, P, 2] (y, x) in [0, 1).
    """
    return jax.vmap(lambda key: jax.random.uniform(key, (num_points, 2), jnp.float32))(keys)


def point_pool_sizes(num_points: int, oversample_ratio: float = 3.0, importance_sample_ratio: float = 0.75):
    """(candidates, importance, fresh) point counts of Mask2Former's importance sampling.

    Mask2Former's integer rounding: candidates = int(P * oversample_ratio),
    importance = int(importance_sample_ratio * P) most uncertain of them,
    fresh = P - importance uniform points.
    """
    if oversample_ratio < 1:
        raise ValueError(f"oversample_ratio={oversample_ratio} must be at least 1")
    if not 0 <= importance_sample_ratio <= 1:
        raise ValueError(f"importance_sample_ratio={importance_sample_ratio} must be in [0, 1]")
    num_candidates = int(num_points * oversample_ratio)
    num_importance = int(importance_sample_ratio * num_points)
    return num_candidates, num_importance, num_points - num_importance


def importance_point_pool(keys, num_points: int, oversample_ratio: float = 3.0, importance_sample_ratio: float = 0.75):
    """Each image's pool of uniform points that its masks' importance-sampled points are taken from.

    All the pool's points are iid uniform: its first `candidates` (see
    `point_pool_sizes`) are every mask's oversampled candidates, the remaining
    `fresh` every mask's fresh random points. The caller evaluates the logits
    (and ground truth) of the matched masks at the pool once, then selects
    each mask's points with `uncertain_points`.

    Args:
      keys: typed keys [B], one per image and use (`image_keys`, `fold_in_keys`).
      num_points: P, points per mask in the loss.
      oversample_ratio, importance_sample_ratio: Mask2Former's 3.0 and 0.75.

    Returns:
      float32 [B, candidates + fresh, 2] (y, x) in [0, 1).
    """
    num_candidates, _, num_fresh = point_pool_sizes(num_points, oversample_ratio, importance_sample_ratio)
    return uniform_points(keys, num_candidates + num_fresh)


def uncertain_points(
    pool_logits, num_points: int, oversample_ratio: float = 3.0, importance_sample_ratio: float = 0.75
):
    """Each mask's P loss points, as indices into its image's pool: the most uncertain candidates, then fresh ones.

    Mask2Former's `get_uncertain_point_coords_with_randomness` with its
    uncertainty -|logit|, choosing among the pool's shared candidates
    instead of per-mask ones (see the module docstring).

    Args:
      pool_logits: float [..., candidates + fresh], each mask's logits at its
        image's `importance_point_pool` (only the candidates' are read; no
        gradient flows through the choice).
      num_points, oversample_ratio, importance_sample_ratio: as given to `importance_point_pool`.

    Returns:
      int32 [..., P]: the `importance` candidates with the smallest |logit|
      (most uncertain first), then the pool's `fresh` points (indices
      candidates.. candidates + fresh - 1, the same for every mask). Select
      logits or targets with `jnp.take_along_axis(values_at_pool, index, -1)`,
      coordinates with `points_of_pool`.
    """
    num_candidates, num_importance, num_fresh = point_pool_sizes(num_points, oversample_ratio, importance_sample_ratio)
    pool_logits = jax.lax.stop_gradient(jnp.asarray(pool_logits))
    if pool_logits.shape[-1] != num_candidates + num_fresh:
        raise ValueError(
            f"pool logits hold {pool_logits.shape[-1]} points; a pool of {num_points} points at oversample_ratio="
            f"{oversample_ratio}, importance_sample_ratio={importance_sample_ratio} holds {num_candidates + num_fresh}"
        )
    uncertainty = -jnp.abs(pool_logits[..., :num_candidates])
    _, important = jax.lax.top_k(uncertainty, num_importance)
    fresh = jnp.broadcast_to(
        jnp.arange(num_candidates, num_candidates + num_fresh, dtype=jnp.int32), (*important.shape[:-1], num_fresh)
    )
    return jnp.concatenate([important.astype(jnp.int32), fresh], axis=-1)


def points_of_pool(pool, index):
    """Coordinates of each mask's selected points: pool float [B, K, 2], index int [B, M, P] -> float [B, M, P, 2]."""
    return jnp.take_along_axis(jnp.asarray(pool)[:, None], jnp.asarray(index)[..., None], axis=-2)


def pool_targets_of_rows(pool_targets, source, index):
    """The ground truth at each row's selected pool points, without a [B, R, K] copy of the pool's targets.

    Args:
      pool_targets: float [B, M, K], each ground-truth mask at its image's pool
        (`mask_targets_at_points(masks, pool)`).
      source: int [B, R], the ground-truth mask each row is trained on (in [0, M)).
      index: int [B, R, P], the row's points as indices into the pool (`uncertain_points`).

    Returns:
      float [B, R, P]: pool_targets[b, source[b, r], index[b, r, p]].
    """
    pool_targets = jnp.asarray(pool_targets)
    batch, num_masks, pool_size = pool_targets.shape
    flat_index = jnp.asarray(source, jnp.int32)[..., None] * pool_size + jnp.asarray(index, jnp.int32)
    flat = pool_targets.reshape(batch, num_masks * pool_size)
    selected = jnp.take_along_axis(flat, flat_index.reshape(batch, -1), axis=1, mode="promise_in_bounds")
    return selected.reshape(flat_index.shape)


def _normalizer(num_masks):
    # As Mask2Former (and the set loss here): at least 1, so a batch without masks gives 0, not 0 / 0.
    return jnp.maximum(jnp.asarray(num_masks, jnp.float32), 1.0)


def _point_bce(logits, targets):
    """Elementwise BCE of sigmoid(logits) against (soft) targets, from softplus (exact for large |logits|)."""
    return targets * jax.nn.softplus(-logits) + (1.0 - targets) * jax.nn.softplus(logits)


def sigmoid_bce_per_mask(logits, targets):
    """Each mask's mean BCE of sigmoid(logits) against targets over its points: float [..., N, P] x2 -> [..., N]."""
    logits = jnp.asarray(logits, jnp.float32)
    targets = jnp.asarray(targets, jnp.float32)
    return jnp.mean(_point_bce(logits, targets), axis=-1)


def dice_per_mask(logits, targets):
    """Each mask's dice loss 1 - (2 sum(p t) + 1) / (sum(p) + sum(t) + 1), p = sigmoid(logits).

    float [..., N, P] logits and targets -> [..., N].
    """
    logits = jnp.asarray(logits, jnp.float32)
    targets = jnp.asarray(targets, jnp.float32)
    probabilities = jax.nn.sigmoid(logits)
    numerator = 2.0 * jnp.sum(probabilities * targets, axis=-1)
    denominator = jnp.sum(probabilities, axis=-1) + jnp.sum(targets, axis=-1)
    return 1.0 - (numerator + 1.0) / (denominator + 1.0)


def total_over_masks(weighted_per_mask, num_masks, axis=None):
    """Weighted per-mask losses summed (over `axis`, None: all) and divided by the global mask count (at least 1)."""
    return jnp.sum(jnp.asarray(weighted_per_mask, jnp.float32), axis=axis) / _normalizer(num_masks)


def sigmoid_bce_loss(logits, targets, weights, num_masks):
    """Mask2Former's `sigmoid_ce_loss`: per mask the mean BCE over its points, weighted, summed, / num_masks.

    Args:
      logits: float [..., N, P] mask logits at each mask's P points.
      targets: float [..., N, P] the ground truth there, in [0, 1].
      weights: float or bool [..., N], each mask's weight; 0 for masks that
        must not count (padding, boxes without a mask, unmatched).
      num_masks: scalar, the global count of counted masks (at least 1 is used).

    Returns:
      float32 scalar, nats per mask.
    """
    return total_over_masks(sigmoid_bce_per_mask(logits, targets) * jnp.asarray(weights, jnp.float32), num_masks)


def dice_loss(logits, targets, weights, num_masks):
    """Mask2Former's `dice_loss`: per mask 1 - (2 sum(p t) + 1) / (sum(p) + sum(t) + 1), p = sigmoid(logits).

    Args: as `sigmoid_bce_loss`.

    Returns:
      float32 scalar, per mask (each mask's term in [0, 1)).
    """
    return total_over_masks(dice_per_mask(logits, targets) * jnp.asarray(weights, jnp.float32), num_masks)


# Matching costs are contracted at full float32: a TF32 matmul's ~1e-3 relative error on a cost of P terms is
# larger than the gaps that decide some assignments, and the costs are computed once per layer.
_COST_PRECISION = jax.lax.Precision.HIGHEST


def mask_bce_cost(logits, targets):
    """Mask2Former's `batch_sigmoid_ce_loss`: the mean BCE over points of each query against each target.

    BCE(x, t) = t softplus(-x) + (1 - t) softplus(x) is linear in t, so all
    pairs are two matmuls over the points: no [Q, M, P] tensor.

    Args:
      logits: float [..., Q, P] query mask logits at the image's points.
      targets: float [..., M, P] ground-truth masks at the same points, in [0, 1].

    Returns:
      float32 [..., Q, M], nats per point.
    """
    logits = jnp.asarray(logits, jnp.float32)
    targets = jnp.asarray(targets, jnp.float32)
    positive = jnp.einsum("...qp,...mp->...qm", jax.nn.softplus(-logits), targets, precision=_COST_PRECISION)
    negative = jnp.einsum("...qp,...mp->...qm", jax.nn.softplus(logits), 1.0 - targets, precision=_COST_PRECISION)
    return (positive + negative) / logits.shape[-1]


def mask_dice_cost(logits, targets):
    """Mask2Former's `batch_dice_loss`: the dice loss of each query against each target, as one matmul.

    Args:
      logits: float [..., Q, P].
      targets: float [..., M, P] in [0, 1].

    Returns:
      float32 [..., Q, M] in [0, 1).
    """
    probabilities = jax.nn.sigmoid(jnp.asarray(logits, jnp.float32))
    targets = jnp.asarray(targets, jnp.float32)
    numerator = 2.0 * jnp.einsum("...qp,...mp->...qm", probabilities, targets, precision=_COST_PRECISION)
    denominator = jnp.sum(probabilities, axis=-1)[..., :, None] + jnp.sum(targets, axis=-1)[..., None, :]
    return 1.0 - (numerator + 1.0) / (denominator + 1.0)
