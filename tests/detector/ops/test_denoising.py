"""Contrastive denoising queries and the attention mask that keeps their groups apart."""

import jax
import numpy as np
import pytest

from detector.ops import denoising

P, M, C = 6, 4, 7  # pairs budget, box slots, classes


def gt(batch=2):
    """Image 0: 3 real boxes in slots 0, 2, 3 (padding in the middle); image 1: one box in slot 0."""
    rng = np.random.default_rng(0)
    centres = rng.uniform(0.3, 0.7, (batch, M, 2))
    sizes = rng.uniform(0.05, 0.3, (batch, M, 2))
    mask = np.array([[True, False, True, True], [True, False, False, False]])[:batch]
    labels = rng.integers(0, C, (batch, M))
    return np.concatenate([centres, sizes], -1).astype(np.float32), labels.astype(np.int32), mask


def corners(boxes_cxcywh):
    boxes = np.asarray(boxes_cxcywh)
    return np.concatenate([boxes[..., :2] - boxes[..., 2:] / 2, boxes[..., :2] + boxes[..., 2:] / 2], -1)


def queries(rng=1, label_noise_ratio=0.0, pairs=P, **gt_kwargs):
    boxes, labels, mask = gt(**gt_kwargs)
    out = denoising.contrastive_denoising_queries(
        jax.random.key(rng),
        boxes,
        labels,
        mask,
        denoising_pairs=pairs,
        num_classes=C,
        label_noise_ratio=label_noise_ratio,
    )
    return boxes, labels, mask, {k: np.asarray(v) for k, v in out.items()}


def test_each_image_fills_the_budget_with_whole_groups_of_its_own_boxes():
    boxes, labels, mask, out = queries()
    d = denoising.num_denoising_queries(P, M)
    assert d == 2 * max(P, M) == 12
    assert out["labels"].shape == (2, d) and out["boxes_cxcywh"].shape == (2, d, 4)
    # Image 0: 3 boxes, 6 // 3 = 2 groups of (3 positives, 3 negatives); image 1: 1 box, 6 groups.
    np.testing.assert_array_equal(out["num_groups"], [2, 6])
    np.testing.assert_array_equal(out["gt_index"][0], np.tile([0, 2, 3], 4))
    np.testing.assert_array_equal(out["positive"][0], np.tile(np.repeat([True, False], 3), 2))
    np.testing.assert_array_equal(out["group"][0], np.repeat([0, 1], 6))
    np.testing.assert_array_equal(out["gt_index"][1], np.zeros(12))
    np.testing.assert_array_equal(out["positive"][1], np.tile([True, False], 6))
    np.testing.assert_array_equal(out["group"][1], np.repeat(np.arange(6), 2))
    assert out["valid"].all()
    np.testing.assert_array_equal(out["labels"], np.take_along_axis(labels, out["gt_index"], 1))  # no label noise

    source = corners(np.take_along_axis(boxes, out["gt_index"][..., None], 1))
    half = np.concatenate([boxes[..., 2:], boxes[..., 2:]], -1)
    half = np.take_along_axis(half, out["gt_index"][..., None], 1) / 2
    moved = np.abs(corners(out["boxes_cxcywh"]) - source) / half
    positive = out["positive"]
    assert np.all(moved[positive] < 1.0 + 1e-5)  # within one half size (clipping only shortens)
    clipped = np.isclose(corners(out["boxes_cxcywh"]), 0.0) | np.isclose(corners(out["boxes_cxcywh"]), 1.0)
    negative_moves = moved[~positive & ~clipped.any(-1)]
    assert negative_moves.size and np.all(negative_moves >= 1.0 - 1e-5) and np.all(negative_moves < 2.0 + 1e-5)


def test_leftover_slots_and_images_without_boxes_are_invalid():
    boxes, labels, mask = gt()
    mask = np.array([[True, True, True, True], [False, False, False, False]])
    out = denoising.contrastive_denoising_queries(
        jax.random.key(1), boxes, labels, mask, denoising_pairs=5, num_classes=C
    )
    out = {k: np.asarray(v) for k, v in out.items()}
    # 4 boxes in a budget of max(5, 4) = 5 pairs: one group, 2 of the 10 slots left over.
    np.testing.assert_array_equal(out["num_groups"], [1, 0])
    np.testing.assert_array_equal(out["valid"][0], np.arange(10) < 8)
    np.testing.assert_array_equal(out["group"][0], np.where(np.arange(10) < 8, 0, -1))
    assert not out["valid"][1].any() and np.all(out["group"][1] == -1)
    # More boxes than pairs: the slots still hold one whole group.
    assert denoising.num_denoising_queries(2, M) == 2 * M and denoising.num_denoising_queries(0, M) == 0


@pytest.mark.slow  # 5-7 s of compiling: the slow tier
def test_an_images_queries_do_not_depend_on_the_rest_of_its_batch():
    *_, together = queries(rng=3)
    boxes, labels, mask = gt()
    alone = denoising.contrastive_denoising_queries(
        jax.random.key(3), boxes[:1], labels[:1], mask[:1], denoising_pairs=P, num_classes=C
    )
    for key in ("gt_index", "positive", "valid", "group", "num_groups"):
        np.testing.assert_array_equal(np.asarray(alone[key])[0], together[key][0])


def test_labels_flip_at_half_the_noise_ratio():
    boxes, labels, mask = gt(1)
    out = denoising.contrastive_denoising_queries(
        jax.random.key(2),
        np.tile(boxes, (256, 1, 1)),
        np.zeros((256, M), np.int32),
        np.tile(mask, (256, 1)),
        denoising_pairs=P,
        num_classes=C,
        label_noise_ratio=0.5,
    )
    changed = np.mean(np.asarray(out["labels"]) != 0)
    # Flipped with probability 0.25, to a uniform class (1/C of which is 0 again).
    assert changed == pytest.approx(0.25 * (C - 1) / C, abs=0.02)


def test_the_group_mask_lets_each_denoising_query_see_its_own_group_and_no_leftover_slot():
    boxes, labels, mask = gt()
    mask = mask.copy()
    mask[1] = [True, True, True, True]  # image 1: one group of 4 boxes, 4 slots left over
    out = denoising.contrastive_denoising_queries(
        jax.random.key(4), boxes, labels, mask, denoising_pairs=P, num_classes=C
    )
    group = np.asarray(out["group"])
    d = denoising.num_denoising_queries(P, M)
    np.testing.assert_array_equal(group[0], np.repeat([0, 1], 6))  # image 0: 2 groups of its 3 boxes
    np.testing.assert_array_equal(group[1], np.where(np.arange(d) < 8, 0, -1))
    attention = np.asarray(denoising.group_attention_mask(out["group"]))
    assert attention.shape == (2, d, d) and attention.dtype == bool
    np.testing.assert_array_equal(attention[0], np.kron(np.eye(2, dtype=bool), np.ones((6, 6), bool)))
    # Image 1's valid slots see each other; a leftover slot sees only itself and no one sees it.
    want = np.eye(d, dtype=bool)
    want[:8, :8] = True
    np.testing.assert_array_equal(attention[1], want)
