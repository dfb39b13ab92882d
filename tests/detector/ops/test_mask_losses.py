"""Mask losses on point-sampled logits against straightforward numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detector.ops import mask_losses

# float32 against float64 references: measured errors are up to ~2e-7 relative (to the largest value compared);
# 1e-6 leaves a margin, no more.
RTOL = 1e-6


def _assert_close(got, want):
    """Equal to float32 rounding: RTOL relative to each value and to the largest one (sums of several terms)."""
    want = np.asarray(want)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * np.abs(want).max())


def _numpy_grid_sample(image, y, x):
    """torch grid_sample(align_corners=False, padding_mode='zeros') of one [H, W] map at one (y, x) in [0, 1].

    Zero padding made literal: the map is padded with zeros and sampled
    bilinearly there, with no masking of out-of-map taps. The pixel
    coordinates are rounded to float32 as the function's (and torch's) are,
    the rest is float64: a float32 coordinate is off by up to ~5e-7 cells,
    which moves a sample by that times the map's slope.
    """
    height, width = image.shape
    pad = 2 * (height + width)
    padded = np.pad(np.asarray(image, np.float64), pad)
    py = float(np.float32(y) * np.float32(height) - np.float32(0.5)) + pad
    px = float(np.float32(x) * np.float32(width) - np.float32(0.5)) + pad
    y0, x0 = int(np.floor(py)), int(np.floor(px))
    if not (0 <= y0 and y0 + 1 < padded.shape[0] and 0 <= x0 and x0 + 1 < padded.shape[1]):
        return 0.0
    fy, fx = py - y0, px - x0
    return (
        (1 - fy) * (1 - fx) * padded[y0, x0]
        + (1 - fy) * fx * padded[y0, x0 + 1]
        + fy * (1 - fx) * padded[y0 + 1, x0]
        + fy * fx * padded[y0 + 1, x0 + 1]
    )


def _numpy_point_sample(maps, points):
    """`_numpy_grid_sample` of maps [B, N, H, W] at points [B, P, 2] (shared per image) or [B, N, P, 2] -> [B, N, P]."""
    batch, count = maps.shape[:2]
    points = np.broadcast_to(points[:, None] if points.ndim == 3 else points, (batch, count, *points.shape[-2:]))
    out = np.zeros(points.shape[:-1])
    for b, n, p in np.ndindex(*out.shape):
        out[b, n, p] = _numpy_grid_sample(maps[b, n], *points[b, n, p])
    return out


def _test_points(rng, batch, height, width):
    """[B, P, 2] points: inside, near and outside every border, exact cell centres, corners, far away."""
    points = [rng.uniform(-0.3, 1.3, (batch, 24, 2))]
    centres = np.stack([(rng.integers(0, height, 6) + 0.5) / height, (rng.integers(0, width, 6) + 0.5) / width], -1)
    points.append(np.broadcast_to(centres, (batch, 6, 2)))
    edges = np.array([[0, 0], [1, 1], [0, 1], [1, 0], [-0.5 / height, 0.3], [1 + 0.5 / height, 0.3], [0.4, -0.01]])
    edges = np.concatenate([edges, [[0.4, 1 + 0.49 / width], [5.0, 0.5], [0.5, -7.0]]])
    points.append(np.broadcast_to(edges, (batch, *edges.shape)))
    return np.concatenate(points, axis=1).astype(np.float32)


def test_unpack_masks_inverts_packbits():
    rng = np.random.default_rng(0)
    for width in (13, 16, 1):
        cells = rng.uniform(size=(2, 3, 5, width)) < 0.5
        packed = np.packbits(cells, axis=-1)
        got = jax.jit(mask_losses.unpack_masks, static_argnums=1)(packed, width)
        assert got.dtype == jnp.bool_ and got.shape == cells.shape
        np.testing.assert_array_equal(got, cells)
        np.testing.assert_array_equal(got, np.unpackbits(packed, axis=-1, count=width).astype(bool))
    with pytest.raises(ValueError, match="cannot hold"):
        mask_losses.unpack_masks(np.zeros((4, 2), np.uint8), 17)
    with pytest.raises(ValueError, match="cannot hold"):
        mask_losses.unpack_masks(np.zeros((4, 2), np.uint8), 8)


def test_point_sample_matches_grid_sample_inside_near_and_outside_borders():
    rng = np.random.default_rng(1)
    batch, maps, height, width = 2, 3, 5, 7
    images = rng.normal(size=(batch, maps, height, width)).astype(np.float32)
    points = _test_points(rng, batch, height, width)
    sample = jax.jit(mask_losses.point_sample)
    got = np.asarray(sample(images, points))
    want = _numpy_point_sample(images, points)
    assert got.shape == (batch, maps, points.shape[1]) and got.dtype == np.float32
    _assert_close(got, want)
    # Hand-checked cases: a cell centre reads its cell; the map corner (0, 0) reads a quarter of cell (0, 0);
    # a point half a cell beyond the last row reads half of it; far away reads 0.
    centre = [(2 + 0.5) / height, (4 + 0.5) / width]
    corner, below, far = [0.0, 0.0], [1.0, (3 + 0.5) / width], [5.0, 0.5]
    got = np.asarray(sample(images, np.array([[centre, corner, below, far]] * batch, np.float32)))
    np.testing.assert_allclose(got[..., 0], images[:, :, 2, 4], rtol=RTOL)
    np.testing.assert_allclose(got[..., 1], images[:, :, 0, 0] / 4, rtol=RTOL)
    np.testing.assert_allclose(got[..., 2], images[:, :, -1, 3] / 2, rtol=RTOL)
    np.testing.assert_array_equal(got[..., 3], 0.0)


def test_point_sample_per_map_uses_each_maps_points():
    rng = np.random.default_rng(2)
    batch, maps, height, width = 2, 3, 4, 6
    images = rng.normal(size=(batch, maps, height, width)).astype(np.float32)
    points = np.stack([_test_points(rng, batch, height, width) for _ in range(maps)], axis=1)
    got = np.asarray(jax.jit(mask_losses.point_sample_per_map)(images, points))
    want = _numpy_point_sample(images, points)
    _assert_close(got, want)


def test_mask_targets_at_points_are_bilinear_samples_of_the_binary_maps():
    rng = np.random.default_rng(3)
    batch, masks, height, width = 2, 3, 5, 9
    cells = rng.uniform(size=(batch, masks, height, width)) < 0.4
    points = _test_points(rng, batch, height, width)
    got = np.asarray(jax.jit(mask_losses.mask_targets_at_points)(cells, points))
    assert got.dtype == np.float32
    want = _numpy_point_sample(cells, points)
    _assert_close(got, want)
    # Per-mask points: each mask's own, here the shared ones rolled by a different amount per mask.
    per_mask = np.stack([np.roll(points, m, axis=1) for m in range(masks)], axis=1)
    got = np.asarray(jax.jit(mask_losses.mask_targets_at_mask_points)(cells, per_mask))
    _assert_close(got, np.stack([np.roll(want[:, m], m, axis=-1) for m in range(masks)], 1))


def test_sampled_pixel_embedding_dot_equals_sampled_logit_map():
    rng = np.random.default_rng(4)
    batch, queries, height, width, channels = 2, 5, 6, 8, 16
    pixel_embedding = rng.normal(size=(batch, height, width, channels)).astype(np.float32)
    mask_embedding = rng.normal(size=(batch, queries, channels)).astype(np.float32)
    points = _test_points(rng, batch, height, width)
    sampled = np.asarray(jax.jit(mask_losses.sample_pixel_embedding)(pixel_embedding, points))
    # Channels-last sampling is point_sample of each channel.
    per_channel = jax.jit(mask_losses.point_sample)(pixel_embedding.transpose(0, 3, 1, 2), points)
    _assert_close(sampled, np.asarray(per_channel).transpose(0, 2, 1))
    logit_maps = np.einsum("bqc,bhwc->bqhw", mask_embedding.astype(np.float64), pixel_embedding)
    want = _numpy_point_sample(logit_maps, points)
    got = np.asarray(jax.jit(mask_losses.mask_logits_at_points)(mask_embedding, pixel_embedding, points))
    _assert_close(got, want)


def test_gradients_through_sampled_embedding_equal_those_through_the_logit_map():
    rng = np.random.default_rng(5)
    batch, masks, height, width, channels, num_points = 2, 3, 5, 7, 8, 20
    pixel_embedding = jnp.asarray(rng.normal(size=(batch, height, width, channels)), jnp.float32)
    mask_embedding = jnp.asarray(rng.normal(size=(batch, masks, channels)), jnp.float32)
    points = jnp.asarray(_test_points(rng, batch, height, width)[:, :num_points])
    targets = jnp.asarray(rng.uniform(size=(batch, masks, num_points)) < 0.5, jnp.float32)
    weights = jnp.array([[1, 1, 0], [1, 0, 1]], jnp.float32)

    def loss_of(logits):
        return mask_losses.sigmoid_bce_loss(logits, targets, weights, 4) + mask_losses.dice_loss(
            logits, targets, weights, 4
        )

    def via_points(mask_emb, pixel_emb):
        return loss_of(mask_losses.mask_logits_at_points(mask_emb, pixel_emb, points))

    def via_map(mask_emb, pixel_emb):
        return loss_of(mask_losses.point_sample(jnp.einsum("bqc,bhwc->bqhw", mask_emb, pixel_emb), points))

    got = jax.jit(jax.grad(via_points, argnums=(0, 1)))(mask_embedding, pixel_embedding)
    want = jax.jit(jax.grad(via_map, argnums=(0, 1)))(mask_embedding, pixel_embedding)
    for g, w in zip(got, want, strict=True):
        assert float(jnp.max(jnp.abs(w))) > 1e-3
        _assert_close(g, w)


def _numpy_bce(x, t):
    x = np.asarray(x, np.float64)
    return t * np.logaddexp(0, -x) + (1 - t) * np.logaddexp(0, x)


def _numpy_dice(x, t):
    p = 1 / (1 + np.exp(-np.asarray(x, np.float64)))
    return 1 - (2 * np.sum(p * t) + 1) / (np.sum(p) + np.sum(t) + 1)


def test_bce_and_dice_losses_match_numpy_with_zero_weights():
    rng = np.random.default_rng(6)
    batch, masks, num_points = 2, 4, 11
    logits = rng.normal(0, 4, (batch, masks, num_points)).astype(np.float32)
    logits[0, 0, :3] = [60.0, -60.0, 0.0]  # saturated sigmoids stay exact
    targets = rng.uniform(size=(batch, masks, num_points)).astype(np.float32)
    targets[1] = targets[1] < 0.5  # soft targets (sampled at edges) and binary ones
    weights = np.array([[1, 0, 1, 0.5], [0, 1, 1, 1]], np.float32)
    num_masks = 4.5
    bce_loss, dice_loss = jax.jit(mask_losses.sigmoid_bce_loss), jax.jit(mask_losses.dice_loss)
    bce = bce_loss(logits, targets, weights, num_masks)
    dice = dice_loss(logits, targets, weights, num_masks)
    want_bce = sum(
        weights[b, m] * _numpy_bce(logits[b, m], targets[b, m]).mean() for b in range(batch) for m in range(masks)
    )
    want_dice = sum(
        weights[b, m] * _numpy_dice(logits[b, m], targets[b, m]) for b in range(batch) for m in range(masks)
    )
    np.testing.assert_allclose(bce, want_bce / num_masks, rtol=RTOL)
    np.testing.assert_allclose(dice, want_dice / num_masks, rtol=RTOL)
    # A zero weight removes a mask whatever its logits; no counted mask at all gives 0 (normaliser at least 1).
    changed = logits.copy()
    changed[0, 1] = -changed[0, 1] * 3
    np.testing.assert_allclose(bce_loss(changed, targets, weights, num_masks), bce, rtol=RTOL)
    np.testing.assert_allclose(dice_loss(changed, targets, weights, num_masks), dice, rtol=RTOL)
    zero = np.zeros_like(weights)
    assert float(bce_loss(logits, targets, zero, 0)) == 0.0
    assert float(dice_loss(logits, targets, zero, 0)) == 0.0


def test_matching_costs_match_numpy_pairs():
    rng = np.random.default_rng(7)
    queries, masks, num_points = 6, 4, 13
    logits = rng.normal(0, 3, (queries, num_points)).astype(np.float32)
    targets = rng.uniform(size=(masks, num_points)).astype(np.float32)
    targets[:2] = targets[:2] < 0.5
    targets[3] = 0.0  # an empty target
    bce = np.asarray(jax.jit(mask_losses.mask_bce_cost)(logits, targets))
    dice_cost = jax.jit(mask_losses.mask_dice_cost)
    dice = np.asarray(dice_cost(logits, targets))
    assert bce.shape == dice.shape == (queries, masks)
    want_bce = np.array([[_numpy_bce(logits[q], targets[m]).mean() for m in range(masks)] for q in range(queries)])
    want_dice = np.array([[_numpy_dice(logits[q], targets[m]) for m in range(masks)] for q in range(queries)])
    np.testing.assert_allclose(bce, want_bce, rtol=RTOL)
    np.testing.assert_allclose(dice, want_dice, rtol=RTOL)
    # Leading batch axes: each image's queries against its own targets.
    batched = dice_cost(np.stack([logits, logits[::-1]]), np.stack([targets, targets[::-1]]))
    np.testing.assert_allclose(batched[1], want_dice[::-1, ::-1], rtol=RTOL)


def test_uniform_points_of_an_image_do_not_depend_on_its_batch():
    image_ids = jnp.array([17, 4, 123456, 17 + 2**20], jnp.int32)

    @jax.jit
    def points_of(step, ids):
        return mask_losses.uniform_points(mask_losses.image_keys(7, step, ids), 32)

    together = np.asarray(points_of(jnp.int32(3), image_ids))
    assert together.shape == (4, 32, 2) and together.min() >= 0 and together.max() < 1
    for i in range(4):
        np.testing.assert_array_equal(points_of(jnp.int32(3), image_ids[i : i + 1])[0], together[i])
    reordered = np.asarray(points_of(jnp.int32(3), image_ids[::-1]))
    np.testing.assert_array_equal(reordered, together[::-1])
    # Other images, steps, seeds and uses draw other points.
    assert len({together[i].tobytes() for i in range(4)}) == 4
    assert not np.array_equal(points_of(jnp.int32(4), image_ids), together)
    other_seed = jax.jit(lambda ids: mask_losses.uniform_points(mask_losses.image_keys(8, 3, ids), 32))(image_ids)
    assert not np.array_equal(other_seed, together)
    keys = jax.jit(mask_losses.image_keys, static_argnums=0)(7, 3, image_ids)
    other_use = mask_losses.uniform_points(jax.jit(mask_losses.fold_in_keys)(keys, 1), 32)
    assert not np.array_equal(other_use, together)
    # image_keys equals folding the ids into the train step's rng.
    step_rng = jax.random.fold_in(jax.random.key(7), 3)
    for i in range(4):
        want = jax.random.fold_in(step_rng, int(image_ids[i]))
        np.testing.assert_array_equal(jax.random.key_data(keys[i]), jax.random.key_data(want))


def test_uncertain_points_keep_the_most_uncertain_candidates_then_fresh_points():
    num_points, ratio, importance = 16, 3.0, 0.75
    assert mask_losses.point_pool_sizes(num_points, ratio, importance) == (48, 12, 4)
    assert mask_losses.point_pool_sizes(10, 2.56, 0.78) == (25, 7, 3)  # Mask2Former's int(), not round()
    batch, masks, height, width, channels = 2, 3, 6, 5, 4
    keys = jax.jit(mask_losses.image_keys, static_argnums=0)(0, 11, jnp.array([5, 9]))
    pool = np.asarray(jax.jit(mask_losses.importance_point_pool, static_argnums=(1, 2, 3))(keys, 16, ratio, importance))
    assert pool.shape == (batch, 52, 2) and pool.min() >= 0 and pool.max() < 1
    rng = np.random.default_rng(8)
    pixel_embedding = rng.normal(size=(batch, height, width, channels)).astype(np.float32)
    mask_embedding = rng.normal(size=(batch, masks, channels)).astype(np.float32)
    pool_logits = np.asarray(jax.jit(mask_losses.mask_logits_at_points)(mask_embedding, pixel_embedding, pool))

    index = np.asarray(
        jax.jit(mask_losses.uncertain_points, static_argnums=(1, 2, 3))(pool_logits, 16, ratio, importance)
    )
    assert index.shape == (batch, masks, num_points) and index.dtype == np.int32
    for b in range(batch):
        for m in range(masks):
            chosen = index[b, m]
            # 12 importance points, all candidates, exactly the 12 smallest |logit| among the 48 candidates.
            assert (chosen[:12] < 48).all() and len(set(chosen[:12])) == 12
            most_uncertain = np.argsort(np.abs(pool_logits[b, m, :48]), kind="stable")[:12]
            assert set(chosen[:12]) == set(most_uncertain)
            assert np.abs(pool_logits[b, m, chosen[:12]]).max() < np.sort(np.abs(pool_logits[b, m, :48]))[12]
            # then the 4 fresh points, outside the candidates.
            np.testing.assert_array_equal(chosen[12:], np.arange(48, 52))
    assert not np.array_equal(index[0, 0, :12], index[0, 1, :12])  # each mask chooses its own

    # Selected coordinates: logits and targets taken from the pool equal sampling at each mask's own points.
    mask_points = np.asarray(jax.jit(mask_losses.points_of_pool)(pool, index))
    assert mask_points.shape == (batch, masks, num_points, 2)
    np.testing.assert_array_equal(mask_points, np.stack([pool[b][index[b]] for b in range(batch)]))
    logit_maps = np.einsum("bqc,bhwc->bqhw", mask_embedding, pixel_embedding)
    _assert_close(
        jax.jit(mask_losses.point_sample_per_map)(logit_maps, mask_points), np.take_along_axis(pool_logits, index, -1)
    )
    cells = rng.uniform(size=(batch, masks, height, width)) < 0.5
    _assert_close(
        jax.jit(mask_losses.mask_targets_at_mask_points)(cells, mask_points),
        np.take_along_axis(np.asarray(jax.jit(mask_losses.mask_targets_at_points)(cells, pool)), index, axis=-1),
    )
    # A row's targets at its points straight from the pool's [B, M, K] targets, for rows trained on any of
    # the image's masks (denoising and one-to-many rows repeat them).
    pool_targets = np.asarray(jax.jit(mask_losses.mask_targets_at_points)(cells, pool))
    source = np.array([[2, 0, 2], [1, 1, 0]], np.int32)
    want = np.stack([[pool_targets[b, source[b, r], index[b, r]] for r in range(masks)] for b in range(batch)])
    np.testing.assert_array_equal(jax.jit(mask_losses.pool_targets_of_rows)(pool_targets, source, index), want)
    with pytest.raises(ValueError, match="pool logits hold 51 points"):
        mask_losses.uncertain_points(pool_logits[..., :51], 16, ratio, importance)
