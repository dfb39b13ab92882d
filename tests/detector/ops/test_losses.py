"""Focal loss, smooth L1 and the RetinaNet loss."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from detector.ops import anchors as anchors_lib
from detector.ops import losses

NUM_CLASSES = 3
ANCHORS = jnp.asarray(anchors_lib.generate_anchors(32, 32, 3, 4, 1, (0.5, 1.0, 2.0), 4.0))
# Two images, up to 3 boxes each; the second image has one padded slot.
GT_BOXES = jnp.array(
    [
        [[0, 0, 32, 32], [8, 4, 24, 12], [16, 16, 28, 30]],
        [[2, 2, 20, 14], [10, 10, 31, 31], [0, 0, 0, 0]],
    ],
    jnp.float32,
)
GT_LABELS = jnp.array([[0, 2, 1], [1, 1, 0]], jnp.int32)
GT_MASK = jnp.array([[True, True, True], [True, True, False]])


def _numpy_focal(x, t, alpha, gamma):
    x = np.asarray(x, np.float64)
    p = 1 / (1 + np.exp(-x))
    ce = -(t * np.log(p) + (1 - t) * np.log(1 - p))
    p_t = p * t + (1 - p) * (1 - t)
    loss = ce * (1 - p_t) ** gamma
    if alpha >= 0:
        loss *= alpha * t + (1 - alpha) * (1 - t)
    return loss


@pytest.mark.parametrize("alpha,gamma", [(0.25, 2.0), (0.5, 1.5), (-1.0, 2.0), (0.25, 0.0)])
def test_focal_loss_matches_numpy(alpha, gamma):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (5, 7)).astype(np.float32)
    targets = (rng.uniform(size=(5, 7)) < 0.3).astype(np.float32)
    got = losses.sigmoid_focal_loss(logits, targets, alpha, gamma)
    assert got.shape == (5, 7)
    np.testing.assert_allclose(got, _numpy_focal(logits, targets, alpha, gamma), rtol=1e-5, atol=1e-7)


def test_focal_loss_without_focusing_is_bce_and_stable():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 4, (6, 5)).astype(np.float32)
    targets = (rng.uniform(size=(6, 5)) < 0.5).astype(np.float32)
    np.testing.assert_allclose(
        losses.sigmoid_focal_loss(logits, targets, alpha=-1.0, gamma=0.0),
        optax.sigmoid_binary_cross_entropy(logits, targets),
        rtol=1e-5,
        atol=1e-7,
    )
    extreme = jnp.array([-200.0, -30.0, 30.0, 200.0])
    for t in (0.0, 1.0):
        value, grad = jax.value_and_grad(lambda x: losses.sigmoid_focal_loss(x, jnp.full(4, t)).sum())(extreme)
        assert np.isfinite(value) and np.all(np.isfinite(grad))
    # Confidently wrong costs about |logit| nats (times alpha_t * 1).
    wrong = losses.sigmoid_focal_loss(jnp.array([-200.0]), jnp.array([1.0]), alpha=-1.0)
    np.testing.assert_allclose(wrong, [200.0], rtol=1e-5)


def test_huber_known_values():
    pred = jnp.array([0.0, 0.05, -0.05, 0.3, -2.0])
    np.testing.assert_allclose(
        losses.huber_loss(pred, 0.0, 0.1), [0.0, 0.5 * 0.05**2 / 0.1, 0.5 * 0.05**2 / 0.1, 0.25, 1.95], rtol=1e-6
    )
    np.testing.assert_allclose(losses.huber_loss(pred, 0.0, 0.0), jnp.abs(pred))
    np.testing.assert_allclose(losses.huber_loss(jnp.array([1.0]), jnp.array([0.5]), 1.0), [0.125])
    # Continuous at the switch point.
    below, above = losses.huber_loss(jnp.array([0.1 - 1e-6, 0.1 + 1e-6]), 0.0, 0.1)
    assert float(below) == pytest.approx(float(above), abs=1e-5)


@jax.jit
def _assign():
    return jax.vmap(lambda b, l, m: anchors_lib.assign_targets(ANCHORS, b, l, m))(GT_BOXES, GT_LABELS, GT_MASK)


def _perfect_predictions(assigned, wrong_class=False):
    labels = assigned["labels"]
    if wrong_class:
        labels = jnp.where(labels >= 0, (labels + 1) % NUM_CLASSES, -1)
    one_hot = jax.nn.one_hot(labels, NUM_CLASSES)
    logits = jnp.where(one_hot > 0, 30.0, -30.0)
    return logits, assigned["box_targets"]


_jitted_loss = jax.jit(functools.partial(losses.retinanet_loss, num_classes=NUM_CLASSES), static_argnames=("box_loss",))


def loss_fn(*args, box_loss="huber", box_loss_weight=1.0, example_mask=None):
    # Always passing the weight and the mask keeps one compilation per shape and
    # box_loss, far cheaper than eager dispatch or a compile per call pattern.
    if example_mask is None:
        example_mask = jnp.ones(args[0].shape[0], jnp.float32)
    return _jitted_loss(
        *args, box_loss=box_loss, box_loss_weight=box_loss_weight, example_mask=jnp.asarray(example_mask, jnp.float32)
    )


@pytest.mark.parametrize("box_loss", ["huber", "giou"])
def test_perfect_predictions_give_zero_loss(box_loss):
    assigned = _assign()
    assert int(assigned["positive"].sum()) >= 4
    logits, deltas = _perfect_predictions(assigned)
    total, terms = loss_fn(logits, deltas, ANCHORS, GT_BOXES, GT_LABELS, GT_MASK, box_loss=box_loss)
    assert float(total) < 1e-4
    assert float(terms["num_positives"]) == float(assigned["positive"].sum())
    assert float(total) == pytest.approx(float(terms["cls_loss"] + terms["box_loss"]), abs=1e-7)

    wrong_logits, _ = _perfect_predictions(assigned, wrong_class=True)
    wrong_total, wrong_terms = loss_fn(wrong_logits, deltas, ANCHORS, GT_BOXES, GT_LABELS, GT_MASK, box_loss=box_loss)
    assert float(wrong_terms["cls_loss"]) > 5.0
    assert float(wrong_terms["box_loss"]) < 1e-4
    # Bad boxes with the right classes: only the box term grows.
    _, bad_box_terms = loss_fn(
        logits, deltas + 0.5, ANCHORS, GT_BOXES, GT_LABELS, GT_MASK, box_loss=box_loss, box_loss_weight=2.0
    )
    assert float(bad_box_terms["box_loss"]) > 0.1 and float(bad_box_terms["cls_loss"]) < 1e-4


def test_loss_invariant_to_padded_gts_and_masked_examples():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(2, ANCHORS.shape[0], NUM_CLASSES)), jnp.float32)
    deltas = jnp.asarray(rng.normal(scale=0.2, size=(2, ANCHORS.shape[0], 4)), jnp.float32)
    total, terms = loss_fn(logits, deltas, ANCHORS, GT_BOXES, GT_LABELS, GT_MASK)

    # Extra padded slots, some of them copies of anchors, change nothing.
    extra = jnp.broadcast_to(ANCHORS[:4], (2, 4, 4))
    padded_total, padded_terms = loss_fn(
        logits,
        deltas,
        ANCHORS,
        jnp.concatenate([GT_BOXES, extra], 1),
        jnp.concatenate([GT_LABELS, jnp.full((2, 4), 2, jnp.int32)], 1),
        jnp.concatenate([GT_MASK, jnp.zeros((2, 4), bool)], 1),
    )
    np.testing.assert_allclose(padded_total, total, rtol=1e-6)
    np.testing.assert_allclose(padded_terms["num_positives"], terms["num_positives"])

    # A masked example contributes nothing, whatever its inputs and gts.
    keep_first = jnp.array([1.0, 0.0])
    masked_total, masked_terms = loss_fn(logits, deltas, ANCHORS, GT_BOXES, GT_LABELS, GT_MASK, example_mask=keep_first)
    other_total, _ = loss_fn(
        logits.at[1].set(3.0),
        deltas.at[1].set(-1.0),
        ANCHORS,
        GT_BOXES.at[1].set(GT_BOXES[0]),
        GT_LABELS,
        GT_MASK.at[1].set(True),
        example_mask=keep_first,
    )
    np.testing.assert_allclose(other_total, masked_total, rtol=1e-6)
    np.testing.assert_allclose(masked_terms["num_positives"], _assign()["positive"][0].sum())
    assert float(masked_total) != pytest.approx(float(total))


def test_gradient_finite_under_jit_with_bf16_inputs():
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(2, ANCHORS.shape[0], NUM_CLASSES)), jnp.bfloat16)
    # Huge deltas at some anchors exercise the decode clamp on the giou path.
    deltas = jnp.asarray(rng.normal(scale=3.0, size=(2, ANCHORS.shape[0], 4)), jnp.bfloat16)
    deltas = deltas.at[0, :5].set(50.0)

    # Both box losses in one compilation.
    @jax.jit
    def grads(logits, deltas):
        out = {}
        for box_loss in ("huber", "giou"):
            f = functools.partial(
                losses.retinanet_loss,
                anchors_yxyx=ANCHORS,
                gt_boxes_yxyx=GT_BOXES,
                gt_labels=GT_LABELS,
                gt_mask=GT_MASK,
                num_classes=NUM_CLASSES,
                box_loss=box_loss,
                example_mask=jnp.array([True, True]),
            )
            out[box_loss] = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(logits, deltas)
        return out

    for (total, terms), grad in grads(logits, deltas).values():
        assert total.dtype == jnp.float32 and total.shape == ()
        assert np.isfinite(float(total)) and float(terms["box_loss"]) > 0
        for g in grad:
            assert g.shape[:2] == (2, ANCHORS.shape[0])
            assert np.all(np.isfinite(np.asarray(g, np.float32)))
            assert float(jnp.abs(g.astype(jnp.float32)).sum()) > 0


def test_no_positives_is_finite():
    logits = jnp.full((2, ANCHORS.shape[0], NUM_CLASSES), -5.0)
    deltas = jnp.zeros((2, ANCHORS.shape[0], 4))
    total, terms = loss_fn(logits, deltas, ANCHORS, GT_BOXES, GT_LABELS, jnp.zeros((2, 3), bool))
    assert float(terms["num_positives"]) == 0.0 and float(terms["box_loss"]) == 0.0
    assert np.isfinite(float(total)) and float(total) > 0


def _numpy_set_loss(
    logits, boxes, gt_labels, gt_boxes, query_to_gt, num_boxes, weight, alpha=0.25, gamma=2.0, class_loss="focal"
):
    """DINO's set loss written out per query in numpy (float64), each query's terms times its weight.

    Class losses from their papers: focal (Lin et al.), varifocal (VarifocalNet,
    alpha 0.75, gamma 2: positives towards their IoU, weighted by it) and
    DEIM's matchability-aware loss (gamma 1.5: positives towards IoU**1.5, weight 1).
    """
    logits, boxes, gt_boxes = (np.asarray(a, np.float64) for a in (logits, boxes, gt_boxes))

    def corners(box):
        cx, cy, w, h = box
        return cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2

    cls = l1 = giou = 0.0
    for b in range(logits.shape[0]):
        for n in range(logits.shape[1]):
            w = float(weight[b, n])
            if not w:
                continue
            g = query_to_gt[b, n]
            target = np.zeros(logits.shape[-1])
            iou = 0.0
            if g >= 0:
                target[gt_labels[b, g]] = 1.0
                ax0, ay0, ax1, ay1 = corners(boxes[b, n])
                bx0, by0, bx1, by1 = corners(gt_boxes[b, g])
                inter = max(0, min(ax1, bx1) - max(ax0, bx0)) * max(0, min(ay1, by1) - max(ay0, by0))
                union = (ax1 - ax0) * (ay1 - ay0) + (bx1 - bx0) * (by1 - by0) - inter
                hull = (max(ax1, bx1) - min(ax0, bx0)) * (max(ay1, by1) - min(ay0, by0))
                iou = inter / union
                l1 += w * np.abs(boxes[b, n] - gt_boxes[b, g]).sum()
                giou += w * (1 - (iou - (hull - union) / hull))
            p = 1 / (1 + np.exp(-logits[b, n]))

            def bce(t):
                return -(t * np.log(p) + (1 - t) * np.log(1 - p))

            if class_loss == "focal":
                p_t = p * target + (1 - p) * (1 - target)
                per_class = (alpha * target + (1 - alpha) * (1 - target)) * (1 - p_t) ** gamma * bce(target)
            elif class_loss == "varifocal":
                soft = target * iou
                per_class = np.where(target > 0, iou, 0.75 * p**2.0) * bce(soft)
            else:
                soft = target * iou**1.5
                per_class = np.where(target > 0, 1.0, p**1.5) * bce(soft)
            cls += w * per_class.sum()
    n = max(num_boxes, 1)
    return cls / n, 5 * l1 / n, 2 * giou / n


@pytest.mark.parametrize("weighted", [False, True], ids=["mask", "weights"])
def test_set_prediction_loss_matches_a_per_query_reference(weighted):
    rng = np.random.default_rng(0)
    b, n, m, c = 2, 6, 3, 4
    logits = rng.normal(size=(b, n, c)).astype(np.float32)
    boxes = np.concatenate([rng.uniform(0.2, 0.8, (b, n, 2)), rng.uniform(0.05, 0.4, (b, n, 2))], -1)
    gt_boxes = np.concatenate([rng.uniform(0.2, 0.8, (b, m, 2)), rng.uniform(0.05, 0.4, (b, m, 2))], -1)
    gt_labels = rng.integers(0, c, (b, m)).astype(np.int32)
    query_to_gt = np.array([[2, -1, 0, -1, 1, -1], [-1, -1, 0, -1, -1, -1]], np.int32)
    mask = np.ones((b, n), bool)
    mask[1, 5] = False  # e.g. an invalid denoising copy
    boxes[1, 5] = np.nan  # ... whose box must not reach the loss
    if weighted:  # e.g. denoising queries of an image with 4 groups: 1/4 each
        mask = np.where(mask, rng.choice([0.25, 0.5, 1.0], (b, n)), 0.0).astype(np.float32)
    total, terms = losses.set_prediction_loss(
        logits,
        boxes.astype(np.float32),
        gt_labels,
        gt_boxes.astype(np.float32),
        query_to_gt,
        num_boxes=4,
        query_weight=mask,
    )
    expected = _numpy_set_loss(logits, boxes, gt_labels, gt_boxes, query_to_gt, 4, mask)
    for key, value in zip(("cls_loss", "l1_loss", "giou_loss"), expected):
        np.testing.assert_allclose(terms[key], value, rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(total, sum(expected), rtol=1e-5)


def test_set_prediction_loss_of_exact_boxes_is_classification_only():
    gt_boxes = np.array([[[0.5, 0.5, 0.2, 0.3], [0.3, 0.6, 0.1, 0.1]]], np.float32)
    pred = np.concatenate([gt_boxes, np.full((1, 2, 4), 0.5, np.float32)], axis=1)  # 2 exact, 2 unassigned
    _, terms = losses.set_prediction_loss(
        np.zeros((1, 4, 3), np.float32), pred, np.array([[1, 2]]), gt_boxes, np.array([[0, 1, -1, -1]]), num_boxes=2
    )
    assert float(terms["l1_loss"]) == 0.0
    assert float(terms["giou_loss"]) == pytest.approx(0.0, abs=1e-6)
    assert float(terms["cls_loss"]) > 0


@pytest.mark.parametrize("class_loss", ["varifocal", "mal"])
def test_quality_aware_class_losses_match_their_papers(class_loss):
    rng = np.random.default_rng(3)
    b, n, m, c = 2, 7, 3, 5
    logits = rng.normal(size=(b, n, c)).astype(np.float32) * 3
    gt_boxes = np.concatenate([rng.uniform(0.3, 0.7, (b, m, 2)), rng.uniform(0.1, 0.4, (b, m, 2))], -1)
    boxes = np.concatenate([rng.uniform(0.2, 0.8, (b, n, 2)), rng.uniform(0.05, 0.4, (b, n, 2))], -1)
    query_to_gt = np.array([[0, -1, 1, 2, -1, -1, -1], [2, 1, -1, -1, 0, -1, -1]], np.int32)
    boxes[0, 0] = gt_boxes[0, 0]  # a perfect box: quality 1
    boxes[1, 0] = [0.05, 0.05, 0.02, 0.02]  # a matched box far from its ground truth: quality 0
    gt_labels = rng.integers(0, c, (b, m)).astype(np.int32)
    weight = rng.choice([0.5, 1.0], (b, n)).astype(np.float32)
    args = (logits, boxes.astype(np.float32), gt_labels, gt_boxes.astype(np.float32), query_to_gt)
    total, terms = losses.set_prediction_loss(*args, num_boxes=5, query_weight=weight, class_loss=class_loss)
    expected = _numpy_set_loss(logits, boxes, gt_labels, gt_boxes, query_to_gt, 5, weight, class_loss=class_loss)
    for key, value in zip(("cls_loss", "l1_loss", "giou_loss"), expected):
        np.testing.assert_allclose(terms[key], value, rtol=1e-5, err_msg=key)
    focal = losses.set_prediction_loss(*args, num_boxes=5, query_weight=weight)[1]["cls_loss"]
    assert abs(float(focal) - float(terms["cls_loss"])) > 1e-3  # a different loss, not focal again

    # The quality is a target, not a path: the class term sends no gradient to the boxes.
    def cls_term(pred_boxes):
        return losses.set_prediction_loss(
            logits, pred_boxes, gt_labels, gt_boxes.astype(np.float32), query_to_gt, num_boxes=5, class_loss=class_loss
        )[1]["cls_loss"]

    assert not np.any(np.asarray(jax.grad(cls_term)(jnp.asarray(boxes, jnp.float32))))


def test_quality_aware_losses_elementwise_edges():
    logits = jnp.array([[-30.0, 0.0, 30.0]])
    targets = jnp.array([[0.0, 1.0, 1.0]])
    # A perfect positive with a confident score and a confident negative cost (almost) nothing.
    for fn in (losses.varifocal_loss, losses.matchability_aware_loss):
        out = np.asarray(fn(logits, targets, jnp.array([[1.0]])))
        assert np.all(np.isfinite(out)) and out[0, 0] < 1e-12 and out[0, 2] < 1e-12
        assert out[0, 1] == pytest.approx(np.log(2.0), rel=1e-6)  # p = 0.5 against target 1, weight 1
    # Quality 0: varifocal drops the positive (weight 0), MAL pulls it towards 0 with weight 1.
    zero = jnp.array([[0.0]])
    assert float(losses.varifocal_loss(logits, targets, zero)[0, 1]) == 0.0
    assert float(losses.matchability_aware_loss(logits, targets, zero)[0, 1]) == pytest.approx(np.log(2.0), rel=1e-6)


def test_dino_rejects_an_unknown_class_loss():
    from configs import dino_tiny
    from detector.errors import ConfigError
    from detector.models import families

    config = dino_tiny.get_config()
    config.loss.set_prediction.class_loss = "softmax"
    with pytest.raises(ConfigError, match="class_loss='softmax'; use one of focal, varifocal, mal"):
        families.objective(config, families.create_model(config, 3), 3)
