"""One-to-one matching of predictions to ground truth, as DETR-style detectors (DINO) train.

:func:`hungarian_assignment` is an exact minimum-cost bipartite assignment in
pure JAX: the Jonker-Volgenant shortest-augmenting-path method (the
``O(n^2 m)`` Hungarian algorithm with row/column potentials), with the
ground-truth slots as the side that is augmented one at a time. For M gt
slots and N >= M queries it runs M outer steps; the Dijkstra search of gt slot
``i`` visits at most ``i`` queries (each step either reaches a free query or a
query already matched to an earlier gt), and every step is an ``O(N)``
vector operation. So the work is ``O(M * M * N)`` and the number of sequential
loop iterations is bounded by ``M * (M + 1) / 2`` whatever N is, typically
close to M when N >> M (most searches end at a free query at once).

Every function has static shapes, no host round trip, and works under ``jit``
and ``vmap``. Under ``vmap`` the ``while_loop``s run until every element of the
batch has finished, the finished ones idling (their state is selected, not
updated), so results are those of the per-image calls; a batch costs the
slowest image's iteration count.

:func:`dino_matching_cost` is DINO's (Deformable DETR's) matching cost and
:func:`match_batch` composes the two for a batch of images.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from detector.ops import box_ops


def _sanitize(cost, valid_columns):
    """Replaces non-finite entries and zeroes padding columns.

    A NaN makes every comparison in the search false, which could select an
    already-visited query and loop until the iteration cap with a wrong
    answer; an infinity makes the potentials infinite. Non-finite entries
    become one more than the largest finite real cost, so they are matched
    only when nothing else is left. Padding columns are never searched, but
    their values must not poison that maximum.
    """
    finite = jnp.isfinite(cost) & valid_columns[None, :]
    big = jnp.max(jnp.where(finite, jnp.abs(cost), 0.0)) + 1.0
    cost = jnp.where(jnp.isfinite(cost), cost, big)
    return jnp.where(valid_columns[None, :], cost, 0.0)


def hungarian_assignment(cost, valid_columns=None):
    """Exact minimum-cost assignment of every real column (gt) to a distinct row (query).

    Minimises ``sum_g cost[query_for_gt[g], g]`` over the real columns.

    Args:
        cost: float ``[N, M]`` cost of matching query ``n`` to gt slot ``m``,
            N >= M (both static). Computed in float32, or float64 if given
            float64 with x64 enabled. Non-finite entries are treated as one
            more than the largest finite real entry.
        valid_columns: bool ``[M]``, True for real gt slots (any positions,
            not necessarily a prefix); None means all real. Padding columns'
            costs are ignored.

    Returns:
        ``(query_for_gt, gt_for_query)``: int32 ``[M]`` matched query index
        per gt slot, -1 for padding slots; int32 ``[N]`` matched gt slot per
        query, -1 for unmatched queries. Ties between optimal assignments are
        broken deterministically (the lowest index wins each search step).
    """
    cost = jnp.asarray(cost)
    if cost.ndim != 2:
        raise ValueError(f"cost must be [N, M], got shape {cost.shape}")
    n, m = cost.shape
    if n < m:
        raise ValueError(f"need at least as many queries as gt slots, got cost of shape {cost.shape}")
    dtype = cost.dtype if cost.dtype == jnp.float64 else jnp.float32
    cost = cost.astype(dtype)
    if valid_columns is None:
        valid_columns = jnp.ones((m,), bool)
    valid_columns = jnp.asarray(valid_columns, bool)
    if m == 0:
        return jnp.zeros((0,), jnp.int32), jnp.full((n,), -1, jnp.int32)

    # 1-based layout of the textbook algorithm: gt slot i is row i, query j is
    # column j, and row/column 0 are a virtual start the search grows from.
    # owner[j] is the row matched to column j (0: free); owner[0] holds the row
    # being inserted.
    a = jnp.zeros((m + 1, n + 1), dtype).at[1:, 1:].set(_sanitize(cost, valid_columns).T)
    inf = jnp.array(jnp.inf, dtype)

    def insert_row(i, carry):
        u, v, owner = carry
        owner = owner.at[0].set(i)

        def searching(state):
            _, _, _, _, _, owner, j0, steps = state
            # Exact arithmetic needs at most i steps; the cap only guards
            # against a pathological float input never reaching a free column.
            return (owner[j0] != 0) & (steps <= m)

        def search_step(state):
            used, minv, way, u, v, owner, j0, steps = state
            used = used.at[j0].set(True)
            i0 = owner[j0]
            reduced = a[i0] - u[i0] - v
            improve = ~used & (reduced < minv)
            minv = jnp.where(improve, reduced, minv)
            way = jnp.where(improve, j0, way)
            candidates = jnp.where(used, inf, minv)
            j1 = jnp.argmin(candidates).astype(jnp.int32)
            delta = candidates[j1]
            # Rows in the search tree are the owners of the visited columns
            # (distinct, and owner[0] == i); free columns own row 0, which
            # receives only zeros.
            u = u.at[owner].add(jnp.where(used, delta, 0))
            v = jnp.where(used, v - delta, v)
            minv = jnp.where(used, minv, minv - delta)
            return used, minv, way, u, v, owner, j1, steps + 1

        init = (
            jnp.zeros((n + 1,), bool),
            jnp.full((n + 1,), inf),
            jnp.zeros((n + 1,), jnp.int32),
            u,
            v,
            owner,
            jnp.int32(0),
            jnp.where(valid_columns[i - 1], 0, m + 1).astype(jnp.int32),  # padding rows: no search
        )
        _, _, way, u, v, owner, j0, _ = jax.lax.while_loop(searching, search_step, init)

        # Flip the alternating path from the free column j0 back to the root.
        # The path has at most i edges; the cap turns a corrupted `way` into a
        # wrong answer instead of a hung device.
        def augmenting(state):
            _, j0, steps = state
            return (j0 != 0) & (steps <= m)

        def augment_step(state):
            owner, j0, steps = state
            j1 = way[j0]
            return owner.at[j0].set(owner[j1]), j1, steps + 1

        j0 = jnp.where(valid_columns[i - 1], j0, 0)
        owner, _, _ = jax.lax.while_loop(augmenting, augment_step, (owner, j0, jnp.int32(0)))
        return u, v, owner

    init = (jnp.zeros((m + 1,), dtype), jnp.zeros((n + 1,), dtype), jnp.zeros((n + 1,), jnp.int32))
    _, _, owner = jax.lax.fori_loop(1, m + 1, insert_row, init)

    gt_for_query = owner[1:] - 1
    # Free queries all scatter into slot 0, which is dropped.
    column_of_row = jnp.zeros((m + 1,), jnp.int32).at[owner[1:]].set(jnp.arange(1, n + 1, dtype=jnp.int32))
    query_for_gt = jnp.where(valid_columns, column_of_row[1:] - 1, -1)
    return query_for_gt, gt_for_query


def dino_matching_cost(
    pred_logits,
    pred_boxes_cxcywh,
    gt_labels,
    gt_boxes_cxcywh,
    *,
    class_weight: float = 2.0,
    l1_weight: float = 5.0,
    giou_weight: float = 2.0,
    focal_alpha: float = 0.25,
    focal_gamma: float = 2.0,
):
    """DINO / Deformable DETR matching cost of every query against every gt box.

    ``class_weight * focal + l1_weight * L1 - giou_weight * GIoU`` with, at the
    gt's class and ``p = sigmoid(logit)``,
    ``focal = alpha * (1-p)^gamma * (-log p) - (1-alpha) * p^gamma * (-log(1-p))``
    (log-sigmoid instead of the reference's ``log(p + 1e-8)``: the same to
    ~1e-8 for moderate logits, finite for extreme ones).

    Args:
        pred_logits: float ``[N, C]`` per-class sigmoid logits.
        pred_boxes_cxcywh: float ``[N, 4]`` ``(cx, cy, w, h)`` normalised to the
            image size.
        gt_labels: int ``[M]`` class ids in ``[0, C)``; padding slots may hold
            anything (clipped into range).
        gt_boxes_cxcywh: float ``[M, 4]`` normalised ``(cx, cy, w, h)``.
        class_weight, l1_weight, giou_weight: DINO's defaults (2, 5, 2).
        focal_alpha, focal_gamma: the focal cost's alpha and gamma.

    Returns:
        float32 ``[N, M]`` cost, lower is better. Column ``m`` depends only on
        gt slot ``m``, so padding slots never change real columns.
    """
    pred_logits = jnp.asarray(pred_logits, jnp.float32)
    pred_boxes = jnp.asarray(pred_boxes_cxcywh, jnp.float32)
    gt_boxes = jnp.asarray(gt_boxes_cxcywh, jnp.float32)
    num_classes = pred_logits.shape[-1]
    labels = jnp.clip(jnp.asarray(gt_labels, jnp.int32), 0, num_classes - 1)

    logits = pred_logits[:, labels]  # [N, M]
    p = jax.nn.sigmoid(logits)
    pos = focal_alpha * (1.0 - p) ** focal_gamma * -jax.nn.log_sigmoid(logits)
    neg = (1.0 - focal_alpha) * p**focal_gamma * -jax.nn.log_sigmoid(-logits)
    class_cost = pos - neg

    l1_cost = jnp.sum(jnp.abs(pred_boxes[:, None, :] - gt_boxes[None, :, :]), axis=-1)
    # GIoU is scale-invariant, so normalised coordinates are as good as pixels.
    giou = box_ops.generalized_iou(
        box_ops.cxcywh_to_yxyx(pred_boxes)[:, None, :], box_ops.cxcywh_to_yxyx(gt_boxes)[None, :, :]
    )
    return class_weight * class_cost + l1_weight * l1_cost - giou_weight * giou


def match_batch(pred_logits, pred_boxes, gt_labels, gt_boxes, gt_mask, extra_cost=None, **cost_kwargs):
    """Hungarian matching of a batch of images under DINO's cost.

    Args:
        pred_logits: float ``[B, N, C]`` sigmoid logits.
        pred_boxes: float ``[B, N, 4]`` normalised ``(cx, cy, w, h)``.
        gt_labels: int ``[B, M]`` class ids.
        gt_boxes: float ``[B, M, 4]`` normalised ``(cx, cy, w, h)``.
        gt_mask: bool ``[B, M]``, True for real boxes; images may have
            different numbers of them (including none).
        extra_cost: float ``[B, N, M]`` added to DINO's cost (Mask DINO's
            mask terms), or None.
        **cost_kwargs: weights for :func:`dino_matching_cost` (static).

    Returns:
        ``(query_for_gt, gt_for_query)``: int32 ``[B, M]`` (-1 for padding)
        and int32 ``[B, N]`` (-1 for unmatched queries).
    """

    def one_image(logits, boxes, labels, gts, mask, extra):
        cost = dino_matching_cost(logits, boxes, labels, gts, **cost_kwargs)
        return hungarian_assignment(cost if extra is None else cost + extra, mask)

    return jax.vmap(one_image)(pred_logits, pred_boxes, gt_labels, gt_boxes, jnp.asarray(gt_mask, bool), extra_cost)
