"""DINO's query layout [denoising | one_to_one | one_to_many]: sizes, slices, split and concatenation, and the
decoder self-attention mask, against one written out query by query."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detector.models.query_layout import SEGMENTS, QueryLayout
from detector.ops import denoising

LAYOUTS = [
    QueryLayout(num_one_to_one=5),
    QueryLayout(num_one_to_one=5, num_denoising=12),
    QueryLayout(num_one_to_one=5, num_one_to_many=3),
    QueryLayout(num_one_to_one=5, num_denoising=12, num_one_to_many=3),
]


def test_sizes_slices_and_the_segments_present():
    layout = QueryLayout(num_one_to_one=5, num_denoising=12, num_one_to_many=3)
    assert layout.segments == SEGMENTS == ("denoising", "one_to_one", "one_to_many")
    assert [layout.size(segment) for segment in SEGMENTS] == [12, 5, 3] and layout.total == 20
    assert [layout.slice(segment) for segment in SEGMENTS] == [slice(0, 12), slice(12, 17), slice(17, 20)]
    assert layout.without("denoising") == QueryLayout(num_one_to_one=5, num_one_to_many=3)
    assert hash(layout) == hash(QueryLayout(num_one_to_one=5, num_denoising=12, num_one_to_many=3))

    plain = QueryLayout(num_one_to_one=5)  # prediction's
    assert plain.segments == ("one_to_one",) and plain.total == 5
    assert [plain.slice(segment) for segment in SEGMENTS] == [slice(0, 0), slice(0, 5), slice(5, 5)]
    assert QueryLayout(num_one_to_one=5, num_one_to_many=3).slice("one_to_many") == slice(5, 8)


def test_sizes_that_cannot_be_are_refused():
    with pytest.raises(ValueError, match="no one-to-one queries"):
        QueryLayout(num_one_to_one=0, num_denoising=4)
    with pytest.raises(ValueError, match="denoising size -1"):
        QueryLayout(num_one_to_one=5, num_denoising=-1)
    with pytest.raises(ValueError, match="one_to_many size 2.0"):
        QueryLayout(num_one_to_one=5, num_one_to_many=2.0)
    with pytest.raises(KeyError, match="'matching' is not a query segment"):
        QueryLayout(num_one_to_one=5).size("matching")


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"{layout.segments}")
@pytest.mark.parametrize("axis", [1, -1])
def test_split_then_concatenate_gives_back_the_array(layout, axis):
    x = np.arange(2 * layout.total * 3).reshape(2, layout.total, 3)
    x = x if axis == 1 else np.moveaxis(x, 1, -1)
    parts = layout.split(jnp.asarray(x), axis=axis)
    assert tuple(parts) == layout.segments
    for segment, part in parts.items():
        np.testing.assert_array_equal(part, np.take(x, np.arange(layout.total)[layout.slice(segment)], axis=axis))
    np.testing.assert_array_equal(layout.concatenate(parts, axis=axis), x)


def test_split_and_concatenate_refuse_parts_that_do_not_fit():
    layout = QueryLayout(num_one_to_one=5, num_denoising=2)
    with pytest.raises(ValueError, match="has 6 queries, not 7"):
        layout.split(jnp.zeros((1, 6)), axis=1)
    with pytest.raises(ValueError, match="layout has"):
        layout.concatenate({"one_to_one": jnp.zeros((1, 5))}, axis=1)
    with pytest.raises(ValueError, match="denoising has 3 queries on axis 1, not 2"):
        layout.concatenate({"denoising": jnp.zeros((1, 3)), "one_to_one": jnp.zeros((1, 5))}, axis=1)


def hand_built_mask(group: np.ndarray, num_one_to_one: int, num_one_to_many: int) -> np.ndarray:
    """The decoder mask written out query by query, bool `[B, T, T]`, for denoising slots' `group` `[B, D]`.

    A denoising query sees itself, the valid queries of its own group and every one-to-one query; a one-to-one
    query sees the one-to-one queries; a one-to-many query sees the one-to-many queries.
    """
    batch, num_denoising = group.shape
    kinds = ["denoising"] * num_denoising + ["one_to_one"] * num_one_to_one + ["one_to_many"] * num_one_to_many
    mask = np.zeros((batch, len(kinds), len(kinds)), bool)
    for b in range(batch):
        for row, row_kind in enumerate(kinds):
            for column, column_kind in enumerate(kinds):
                if row_kind == "denoising" and column_kind == "denoising":
                    sees = row == column or (group[b, row] >= 0 and group[b, row] == group[b, column])
                elif row_kind == "denoising":
                    sees = column_kind == "one_to_one"
                else:
                    sees = column_kind == row_kind
                mask[b, row, column] = sees
    return mask


def test_the_mask_of_a_small_layout_written_out():
    # 4 denoising slots (group 0, group 0, group 1, a leftover), 2 one-to-one and 2 one-to-many queries.
    layout = QueryLayout(num_one_to_one=2, num_denoising=4, num_one_to_many=2)
    want = np.array(
        [
            [1, 1, 0, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 1, 1, 0, 0],
            [0, 0, 1, 0, 1, 1, 0, 0],
            [0, 0, 0, 1, 1, 1, 0, 0],
            [0, 0, 0, 0, 1, 1, 0, 0],
            [0, 0, 0, 0, 1, 1, 0, 0],
            [0, 0, 0, 0, 0, 0, 1, 1],
            [0, 0, 0, 0, 0, 0, 1, 1],
        ],
        bool,
    )
    mask = layout.attention_mask(1, jnp.asarray([[0, 0, 1, -1]], jnp.int32))
    assert mask.dtype == jnp.bool_
    np.testing.assert_array_equal(mask[0], want)
    np.testing.assert_array_equal(want[None], hand_built_mask(np.array([[0, 0, 1, -1]]), 2, 2))


@pytest.mark.parametrize(
    ("num_denoising", "num_one_to_one", "num_one_to_many"),
    [(0, 5, 3), (12, 5, 0), (12, 5, 3), (1, 1, 1), (7, 3, 4)],
)
def test_the_mask_is_the_one_written_out(num_denoising, num_one_to_one, num_one_to_many):
    batch = 3
    group = np.random.default_rng(num_denoising).integers(-1, 3, (batch, num_denoising)).astype(np.int32)
    layout = QueryLayout(num_one_to_one, num_denoising=num_denoising, num_one_to_many=num_one_to_many)
    mask = layout.attention_mask(batch, jnp.asarray(group) if num_denoising else None)
    assert mask.shape == (batch, layout.total, layout.total)
    np.testing.assert_array_equal(mask, hand_built_mask(group, num_one_to_one, num_one_to_many))


def test_the_one_to_one_queries_alone_need_no_mask_and_denoising_needs_its_groups():
    assert QueryLayout(num_one_to_one=5).attention_mask(2) is None
    layout = QueryLayout(num_one_to_one=5, num_denoising=4)
    with pytest.raises(ValueError, match=r"denoising_group of shape None, not \(2, 4\)"):
        layout.attention_mask(2)
    with pytest.raises(ValueError, match=r"shape \(2, 3\), not \(2, 4\)"):
        layout.attention_mask(2, jnp.zeros((2, 3), jnp.int32))


def masked_attention(x, mask):
    """One head of self-attention over `x` [B, T, F] with the given boolean mask [B, T, T]."""
    keys = jax.random.split(jax.random.key(3), 3)
    wq, wk, wv = (jax.random.normal(k, (x.shape[-1], 8)) for k in keys)
    scores = jnp.einsum("btf,fd,bsg,gd->bts", x, wq, x, wk)
    scores = jnp.where(mask, scores, -jnp.inf)
    return jnp.einsum("bts,bsf,fd->btd", jax.nn.softmax(scores, axis=-1), x, wv)


def test_through_attention_no_segment_or_group_leaks_where_it_must_not():
    """Denoising groups from `contrastive_denoising_queries` (image 1 has leftover slots), one-to-many on."""
    pairs, max_boxes = 6, 4
    rng = np.random.default_rng(0)
    boxes = np.concatenate([rng.uniform(0.3, 0.7, (2, 4, 2)), rng.uniform(0.05, 0.3, (2, 4, 2))], -1)
    gt_mask = np.array([[True, False, True, True], [True, True, True, True]])
    out = denoising.contrastive_denoising_queries(
        jax.random.key(4),
        boxes.astype(np.float32),
        np.zeros((2, 4), np.int32),
        gt_mask,
        denoising_pairs=pairs,
        num_classes=3,
    )
    layout = QueryLayout(
        num_one_to_one=5, num_denoising=denoising.num_denoising_queries(pairs, max_boxes), num_one_to_many=3
    )
    attention = layout.attention_mask(2, out["group"])
    x = jax.random.normal(jax.random.key(5), (2, layout.total, 16))
    base = masked_attention(x, attention)
    assert np.all(np.isfinite(base))
    queries = layout.split(jnp.arange(layout.total), axis=0)

    def changed_by(rows, where):
        """The outputs after adding to the inputs of queries `where` (image `rows`)."""
        return masked_attention(x.at[rows, where].add(5.0), attention)

    # The denoising queries change neither the one-to-one nor the one-to-many outputs, but their own.
    changed = layout.split(changed_by(slice(None), queries["denoising"]), axis=1)
    before = layout.split(base, axis=1)
    for segment in ("one_to_one", "one_to_many"):
        np.testing.assert_array_equal(changed[segment], before[segment])
    assert not np.allclose(changed["denoising"], before["denoising"])
    # The one-to-many queries change only their own outputs.
    changed = layout.split(changed_by(slice(None), queries["one_to_many"]), axis=1)
    for segment in ("denoising", "one_to_one"):
        np.testing.assert_array_equal(changed[segment], before[segment])
    assert not np.allclose(changed["one_to_many"], before["one_to_many"])
    # The denoising queries do see the one-to-one ones (the mask is not block-diagonal).
    changed = layout.split(changed_by(slice(None), queries["one_to_one"]), axis=1)
    assert not np.allclose(changed["denoising"], before["denoising"])

    # Group 0 of image 0 changes only its own outputs, as do image 1's leftover slots.
    group, slot_query = np.asarray(out["group"]), np.asarray(queries["denoising"])
    assert (group[0] == 0).sum() == 6 and (group[1] == -1).sum() == 4
    for image, slots in ((0, group[0] == 0), (1, group[1] == -1)):
        changed = changed_by(image, slot_query[slots])
        others = np.setdiff1d(np.arange(layout.total), slot_query[slots])
        np.testing.assert_array_equal(changed[image, others], base[image, others])
        assert not np.allclose(changed[image, slot_query[slots]], base[image, slot_query[slots]])
