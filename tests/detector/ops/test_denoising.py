"""Contrastive denoising queries and the attention mask that keeps them from leaking."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detector.ops import denoising

G, M, N, C = 3, 4, 5, 7


def gt(batch=2):
    rng = np.random.default_rng(0)
    centres = rng.uniform(0.3, 0.7, (batch, M, 2))
    sizes = rng.uniform(0.05, 0.3, (batch, M, 2))
    mask = np.array([[True, True, True, False], [True, False, False, False]])[:batch]
    labels = rng.integers(0, C, (batch, M))
    return np.concatenate([centres, sizes], -1).astype(np.float32), labels.astype(np.int32), mask


def corners(boxes_cxcywh):
    boxes = np.asarray(boxes_cxcywh)
    return np.concatenate([boxes[..., :2] - boxes[..., 2:] / 2, boxes[..., :2] + boxes[..., 2:] / 2], -1)


def test_layout_and_noise_bounds_of_positive_and_negative_copies():
    boxes, labels, mask = gt()
    out = denoising.contrastive_denoising_queries(
        jax.random.key(1), boxes, labels, mask, num_groups=G, num_classes=C, label_noise_ratio=0.0
    )
    d = denoising.num_denoising_queries(G, M)
    assert out["labels"].shape == (2, d) and out["boxes_cxcywh"].shape == (2, d, 4)
    np.testing.assert_array_equal(out["gt_index"][0], np.tile(np.arange(M), 2 * G))
    np.testing.assert_array_equal(out["positive"][0], np.tile(np.repeat([True, False], M), G))
    np.testing.assert_array_equal(out["valid"], mask[:, np.tile(np.arange(M), 2 * G)])
    np.testing.assert_array_equal(out["labels"], labels[:, np.tile(np.arange(M), 2 * G)])  # no label noise

    source = corners(boxes)[:, np.tile(np.arange(M), 2 * G)]
    half = np.concatenate([boxes[..., 2:], boxes[..., 2:]], -1)[:, np.tile(np.arange(M), 2 * G)] / 2
    moved = np.abs(corners(out["boxes_cxcywh"]) - source) / half
    positive = np.asarray(out["positive"])
    assert np.all(moved[positive] < 1.0 + 1e-5)  # within one half size (clipping only shortens)
    clipped = np.isclose(corners(out["boxes_cxcywh"]), 0.0) | np.isclose(corners(out["boxes_cxcywh"]), 1.0)
    negative_moves = moved[~positive & ~clipped.any(-1)]
    assert negative_moves.size and np.all(negative_moves >= 1.0 - 1e-5) and np.all(negative_moves < 2.0 + 1e-5)


def test_labels_flip_at_half_the_noise_ratio():
    boxes, labels, mask = gt(1)
    out = denoising.contrastive_denoising_queries(
        jax.random.key(2),
        np.tile(boxes, (256, 1, 1)),
        np.zeros((256, M), np.int32),
        np.tile(mask, (256, 1)),
        num_groups=G,
        num_classes=C,
        label_noise_ratio=0.5,
    )
    changed = np.mean(np.asarray(out["labels"]) != 0)
    # Flipped with probability 0.25, to a uniform class (1/C of which is 0 again).
    assert changed == pytest.approx(0.25 * (C - 1) / C, abs=0.02)


def masked_attention(x, mask):
    """One head of self-attention over `x` [B, T, F] with the given boolean mask [B, T, T]."""
    keys = jax.random.split(jax.random.key(3), 3)
    wq, wk, wv = (jax.random.normal(k, (x.shape[-1], 8)) for k in keys)
    scores = jnp.einsum("btf,fd,bsg,gd->bts", x, wq, x, wk)
    scores = jnp.where(mask, scores, -jnp.inf)
    return jnp.einsum("bts,bsf,fd->btd", jax.nn.softmax(scores, axis=-1), x, wv)


def test_the_mask_leaks_nothing_between_groups_or_into_the_matching_queries():
    boxes, labels, mask = gt()
    out = denoising.contrastive_denoising_queries(jax.random.key(4), boxes, labels, mask, num_groups=G, num_classes=C)
    attention = denoising.denoising_attention_mask(G, M, N, out["valid"])
    d = denoising.num_denoising_queries(G, M)
    x = jax.random.normal(jax.random.key(5), (2, d + N, 16))
    base = masked_attention(x, attention)
    group = np.concatenate([np.repeat(np.arange(G), 2 * M), np.full(N, -1)])

    # Changing every denoising query's input changes no matching query's output.
    changed = masked_attention(x.at[:, :d].add(5.0), attention)
    np.testing.assert_array_equal(changed[:, d:], base[:, d:])
    assert not np.allclose(changed[:, :d], base[:, :d])  # ... while the denoising outputs do change

    # Changing group 0 changes no other group's output.
    changed = masked_attention(x.at[:, group == 0].add(5.0), attention)
    np.testing.assert_array_equal(changed[:, group != 0], base[:, group != 0])

    # An invalid copy (of a padding slot) is seen by no other query.
    invalid = int(np.flatnonzero(~np.asarray(out["valid"][1]))[0])
    changed = masked_attention(x.at[1, invalid].add(5.0), attention)
    others = np.arange(d + N) != invalid
    np.testing.assert_array_equal(changed[1, others], base[1, others])

    # Denoising queries do see the matching ones (the mask is not simply block-diagonal).
    changed = masked_attention(x.at[:, d:].add(5.0), attention)
    assert not np.allclose(changed[:, :d], base[:, :d])
    assert np.all(np.isfinite(base))
