"""Greedy NMS against TensorFlow's, and class-aware detection post-processing."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detector.ops import postprocess


def _random_boxes_and_scores(rng, n, extent, clustered=False):
    if clustered:
        # Jittered copies of a few boxes: the duplicate-detection case NMS exists for.
        base, _ = _random_boxes_and_scores(rng, 6, extent)
        boxes = base[rng.integers(0, 6, n)] + rng.normal(0, 2.0, (n, 4)).astype(np.float32)
        return boxes.astype(np.float32), rng.uniform(0, 1, n).astype(np.float32)
    y0 = rng.uniform(0, extent, n)
    x0 = rng.uniform(0, extent, n)
    h = rng.uniform(5, 30, n)
    w = rng.uniform(5, 30, n)
    boxes = np.stack([y0, x0, y0 + h, x0 + w], -1).astype(np.float32)
    return boxes, rng.uniform(0, 1, n).astype(np.float32)


# Only shapes are static, so parametrized cases share compilations.
@functools.partial(jax.jit, static_argnames=("max_output_size",))
def _nms(boxes, scores, iou_threshold, max_output_size):
    return postprocess.non_max_suppression(boxes, scores, iou_threshold, max_output_size)


@pytest.mark.parametrize(
    "seed,clustered,extent,iou_threshold,max_output_size",
    [
        (0, True, 100.0, 0.5, 60),  # clusters of near-duplicates
        (1, True, 100.0, 0.8, 60),
        (2, False, 30.0, 0.3, 10),  # dense; output size binds
        (3, False, 100.0, 0.7, 60),
        (4, False, 300.0, 0.5, 60),  # sparse: most boxes survive
        (5, False, 30.0, 0.0, 60),  # any overlap suppresses
    ],
)
def test_nms_matches_tensorflow(seed, clustered, extent, iou_threshold, max_output_size):
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    boxes, scores = _random_boxes_and_scores(rng, 60, extent, clustered)
    boxes[5] = boxes[4]  # an exact duplicate
    want = tf.image.non_max_suppression(boxes, scores, max_output_size, iou_threshold=iou_threshold).numpy().tolist()
    indices, valid = _nms(boxes, scores, iou_threshold, max_output_size)
    assert indices.shape == (max_output_size,) and valid.shape == (max_output_size,)
    assert indices.dtype == jnp.int32
    indices, valid = np.asarray(indices), np.asarray(valid)
    assert indices[valid].tolist() == want
    # Valid slots come first; the rest are padding with index 0.
    assert valid.sum() == len(want) and valid[: len(want)].all()
    np.testing.assert_array_equal(indices[~valid], 0)


def test_nms_threshold_is_strict_like_tensorflow():
    # IoU exactly 0.5 does not suppress at threshold 0.5 (TF: "greater than").
    boxes = np.array([[0, 0, 10, 10], [0, 0, 10, 5]], np.float32)
    indices, valid = _nms(boxes, np.array([0.9, 0.8], np.float32), 0.5, 3)
    assert np.asarray(indices)[np.asarray(valid)].tolist() == [0, 1]
    indices, valid = _nms(boxes, np.array([0.9, 0.8], np.float32), 0.49, 3)
    assert np.asarray(indices)[np.asarray(valid)].tolist() == [0]


def test_nms_never_selects_minus_inf():
    rng = np.random.default_rng(5)
    boxes, scores = _random_boxes_and_scores(rng, 20, 500.0)
    scores[::2] = -np.inf
    indices, valid = _nms(boxes, scores, 0.5, 20)
    chosen = np.asarray(indices)[np.asarray(valid)]
    assert len(chosen) > 0 and np.all(np.isfinite(scores[chosen]))
    indices, valid = _nms(boxes, np.full(20, -np.inf, np.float32), 0.5, 20)
    assert not np.any(valid)


# Two heavily overlapping anchors (IoU 0.9) and one far away.
ANCHORS = jnp.array([[0, 0, 10, 10], [0, 0, 10, 9], [50, 50, 60, 60]], jnp.float32)
LOW = -10.0  # sigmoid(-10) ~ 4.5e-5, below any threshold used here


def _logit(p):
    return math.log(p / (1 - p))


_detect = jax.jit(postprocess.detect, static_argnames=("pre_nms_top_k", "max_detections"))
SIZE_64 = jnp.array([64.0, 64.0])


def test_detect_is_class_aware():
    logits = np.full((2, 3, 2), LOW, np.float32)
    # Image 0: the overlapping anchors predict different classes: both survive.
    logits[0, 0, 0] = _logit(0.9)
    logits[0, 1, 1] = _logit(0.8)
    # Image 1: they predict the same class: the lower score is suppressed.
    logits[1, 0, 1] = _logit(0.9)
    logits[1, 1, 1] = _logit(0.8)
    logits[1, 2, 0] = _logit(0.7)
    deltas = jnp.zeros((2, 3, 4))
    out = _detect(jnp.asarray(logits), deltas, ANCHORS, SIZE_64, SIZE_64, score_threshold=0.05, max_detections=4)

    assert out["boxes"].shape == (2, 4, 4) and out["scores"].shape == (2, 4)
    assert out["classes"].shape == (2, 4) and out["valid"].shape == (2, 4)
    assert out["classes"].dtype == jnp.int32 and out["valid"].dtype == jnp.bool_
    np.testing.assert_array_equal(out["valid"], [[1, 1, 0, 0], [1, 1, 0, 0]])
    np.testing.assert_array_equal(out["classes"][:, :2], [[0, 1], [1, 0]])
    np.testing.assert_allclose(out["scores"][:, :2], [[0.9, 0.8], [0.9, 0.7]], rtol=1e-5)
    np.testing.assert_allclose(out["boxes"][0, :2], ANCHORS[:2], atol=1e-4)
    np.testing.assert_allclose(out["boxes"][1, :2], ANCHORS[jnp.array([0, 2])], atol=1e-4)
    np.testing.assert_array_equal(out["boxes"][:, 2:], 0.0)
    np.testing.assert_array_equal(out["scores"][:, 2:], 0.0)


def test_detect_score_threshold_top_k_and_clipping():
    logits = np.full((2, 3, 2), LOW, np.float32)
    logits[:, 2, 0] = _logit(0.3)
    logits[:, 2, 1] = _logit(0.6)
    logits[:, 0, 0] = _logit(0.45)
    # Large deltas push the boxes out of the image: they must come back clipped.
    deltas = jnp.zeros((2, 3, 4)).at[:, :, 2:].set(3.0)
    out = _detect(
        jnp.asarray(logits),
        deltas,
        ANCHORS,
        jnp.array([64.0, 40.0]),
        jnp.array([64.0, 58.0]),
        score_threshold=0.4,
        max_detections=4,
        pre_nms_top_k=1000,
    )  # more than A*C = 6: clamped
    np.testing.assert_array_equal(out["valid"], [[1, 1, 0, 0]] * 2)
    np.testing.assert_allclose(out["scores"][:, :2], [[0.6, 0.45]] * 2, rtol=1e-5)
    np.testing.assert_array_equal(out["classes"][:, :2], [[1, 0]] * 2)
    boxes = np.asarray(out["boxes"])
    assert boxes.min() >= 0.0
    assert boxes[0, :, [0, 2]].max() <= 64.0 and boxes[1, :, [0, 2]].max() <= 40.0
    assert boxes[1, :, [1, 3]].max() <= 58.0
    # Anchor 2 grown e**3 times around (55, 55) covers the whole 40 x 58 image.
    np.testing.assert_allclose(boxes[1, 0], [0.0, 0.0, 40.0, 58.0], atol=1e-4)

    # pre_nms_top_k smaller than the candidates keeps only the best ones.
    out = _detect(
        jnp.asarray(logits), deltas, ANCHORS, SIZE_64, SIZE_64, score_threshold=0.05, max_detections=4, pre_nms_top_k=2
    )
    np.testing.assert_array_equal(out["valid"], [[1, 1, 0, 0]] * 2)
    np.testing.assert_allclose(out["scores"][0, :2], [0.6, 0.45], rtol=1e-5)


def test_detect_random_inputs_are_sorted_and_static():
    rng = np.random.default_rng(6)
    num_anchors, num_classes = 40, 4
    anchors = jnp.asarray(_random_boxes_and_scores(rng, num_anchors, 60.0)[0])
    logits = jnp.asarray(rng.normal(-1.0, 2.0, (3, num_anchors, num_classes)), jnp.float32)
    deltas = jnp.asarray(rng.normal(0.0, 0.2, (3, num_anchors, 4)), jnp.float32)
    out = _detect(logits, deltas, anchors, 80, 80, pre_nms_top_k=50, max_detections=20)
    for key, shape in (("boxes", (3, 20, 4)), ("scores", (3, 20)), ("classes", (3, 20)), ("valid", (3, 20))):
        assert out[key].shape == shape
    scores = np.asarray(out["scores"])
    valid = np.asarray(out["valid"])
    assert valid.sum() > 0
    for i in range(3):
        s = scores[i][valid[i]]
        assert np.all(np.diff(s) <= 0) and np.all(s > 0.05)
    classes = np.asarray(out["classes"])
    assert classes.min() >= 0 and classes.max() < num_classes


def _detect_from_queries_reference(logits, boxes_cxcywh, height, width, max_detections, score_threshold):
    """Per image: sigmoid over every (query, class) pair, the max_detections best (query-major flat index
    q * C + c), their query's box in yxyx pixels clipped to the image, valid above the threshold."""
    logits = np.asarray(logits, np.float64)
    batch, num_queries, num_classes = logits.shape
    out = {"boxes": [], "scores": [], "classes": [], "valid": []}
    for b in range(batch):
        scores = 1 / (1 + np.exp(-logits[b].reshape(-1)))
        best = np.argsort(-scores, kind="stable")[:max_detections]
        cx, cy, w, h = np.asarray(boxes_cxcywh, np.float64)[b, best // num_classes].T
        yxyx = np.stack([cy - h / 2, cx - w / 2, cy + h / 2, cx + w / 2], -1) * [height, width, height, width]
        out["boxes"].append(np.clip(yxyx, 0, [height, width, height, width]))
        out["scores"].append(scores[best])
        out["classes"].append(best % num_classes)
        out["valid"].append(scores[best] > score_threshold)
    return {k: np.stack(v) for k, v in out.items()}


_detect_from_queries = jax.jit(
    postprocess.detect_from_queries,
    static_argnames=(
        "image_height",
        "image_width",
        "max_detections",
        "nms_iou_threshold",
        "pre_nms_top_k",
        "return_queries",
    ),
)


@pytest.mark.parametrize("max_detections", [7, 5 * 3])  # some, and all N * C pairs
def test_detect_from_queries_matches_numpy(max_detections):
    """Random logits and boxes (some past the image's edges) on a non-square 48 x 80 input."""
    rng = np.random.default_rng(7)
    num_queries, num_classes, height, width = 5, 3, 48, 80
    logits = rng.normal(0.0, 2.0, (2, num_queries, num_classes)).astype(np.float32)
    centres = rng.uniform(0.0, 1.0, (2, num_queries, 2))
    sizes = rng.uniform(0.05, 0.9, (2, num_queries, 2))
    boxes = np.concatenate([centres, sizes], -1).astype(np.float32)
    out = _detect_from_queries(
        logits, boxes, image_height=height, image_width=width, max_detections=max_detections, score_threshold=0.6
    )
    want = _detect_from_queries_reference(logits, boxes, height, width, max_detections, 0.6)
    assert out["boxes"].shape == (2, max_detections, 4) and out["boxes"].dtype == jnp.float32
    assert out["scores"].dtype == jnp.float32 and out["classes"].dtype == jnp.int32 and out["valid"].dtype == jnp.bool_
    np.testing.assert_allclose(out["scores"], want["scores"], rtol=1e-6)
    np.testing.assert_array_equal(out["classes"], want["classes"])
    np.testing.assert_allclose(out["boxes"], want["boxes"], rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(out["valid"], want["valid"])
    assert np.all(np.diff(np.asarray(out["scores"]), axis=-1) <= 0)
    # The case exercises what it claims: clipping on both axes, invalid slots, repeated queries.
    assert (want["boxes"] == 0).any()
    assert (want["boxes"][..., 2] == height).any() and (want["boxes"][..., 3] == width).any()
    assert want["valid"].any() and not want["valid"].all()
    assert max_detections < num_queries * num_classes or len(np.unique(want["classes"][0])) == num_classes


def test_detect_from_queries_one_query_can_give_several_classes_and_threshold_is_strict():
    """Query 1 scores 0.9 for class 2 and 0.8 for class 0: two detections with the same box. A score equal
    to the threshold (logit 0 -> 0.5) is invalid."""
    logits = np.full((1, 3, 4), LOW, np.float32)
    logits[0, 1, 2] = _logit(0.9)
    logits[0, 1, 0] = _logit(0.8)
    logits[0, 2, 3] = 0.0
    boxes = np.array([[[0.5, 0.5, 0.2, 0.2], [0.25, 0.5, 0.5, 0.25], [0.5, 0.5, 1.0, 1.0]]], np.float32)
    out = _detect_from_queries(logits, boxes, image_height=40, image_width=100, max_detections=4, score_threshold=0.5)
    np.testing.assert_allclose(out["scores"][0, :3], [0.9, 0.8, 0.5], rtol=1e-6)
    np.testing.assert_array_equal(out["classes"][0, :3], [2, 0, 3])
    np.testing.assert_array_equal(out["valid"][0], [True, True, False, False])
    # cx 0.25, cy 0.5, w 0.5, h 0.25 of 40 x 100 -> y 15..25, x 0..50.
    np.testing.assert_allclose(out["boxes"][0, :2], [[15.0, 0.0, 25.0, 50.0]] * 2, atol=1e-4)
    np.testing.assert_allclose(out["boxes"][0, 2], [0.0, 0.0, 40.0, 100.0], atol=1e-4)


def _numpy_iou(a, b):
    """IoU of yxyx boxes `[4]` and `[K, 4]`."""
    inter = np.clip(np.minimum(a[2], b[:, 2]) - np.maximum(a[0], b[:, 0]), 0, None) * np.clip(
        np.minimum(a[3], b[:, 3]) - np.maximum(a[1], b[:, 1]), 0, None
    )
    area = lambda x: (x[..., 2] - x[..., 0]) * (x[..., 3] - x[..., 1])  # noqa: E731
    return inter / (area(a) + area(b) - inter)


@pytest.mark.parametrize("iou_threshold,pre_nms_top_k", [(0.5, 1000), (0.7, 12)])
def test_detect_from_queries_with_nms_matches_numpy(iou_threshold, pre_nms_top_k):
    """Queries in clusters of near-duplicates: the pre_nms_top_k best (query, class) pairs above the score
    threshold, then greedy NMS within each class, in score order, the first max_detections kept."""
    rng = np.random.default_rng(3)
    num_queries, num_classes, height, width, max_detections = 24, 3, 48, 80, 10
    centres = rng.uniform(0.2, 0.8, (2, 4, 2))[:, rng.integers(0, 4, num_queries)]
    boxes = np.concatenate([centres + rng.normal(0, 0.01, centres.shape), np.full_like(centres, 0.3)], -1)
    boxes = boxes.astype(np.float32)
    logits = rng.normal(0.0, 2.0, (2, num_queries, num_classes)).astype(np.float32)
    out = _detect_from_queries(
        logits,
        boxes,
        image_height=height,
        image_width=width,
        max_detections=max_detections,
        score_threshold=0.2,
        nms_iou_threshold=iou_threshold,
        pre_nms_top_k=pre_nms_top_k,
    )
    assert out["boxes"].shape == (2, max_detections, 4) and out["valid"].shape == (2, max_detections)
    plain = _detect_from_queries_reference(logits, boxes, height, width, num_queries * num_classes, 0.2)
    suppressed_some = False
    for b in range(2):
        candidates = np.flatnonzero(plain["valid"][b][:pre_nms_top_k])
        kept = []
        for i in candidates:
            same_class = [k for k in kept if plain["classes"][b][k] == plain["classes"][b][i]]
            if not same_class or _numpy_iou(plain["boxes"][b][i], plain["boxes"][b][same_class]).max() <= iou_threshold:
                kept.append(i)
        suppressed_some |= len(kept) < len(candidates)
        kept = kept[:max_detections]
        n = len(kept)
        np.testing.assert_array_equal(out["valid"][b], np.arange(max_detections) < n)
        np.testing.assert_allclose(out["scores"][b, :n], plain["scores"][b][kept], rtol=1e-6)
        np.testing.assert_array_equal(out["classes"][b, :n], plain["classes"][b][kept])
        np.testing.assert_allclose(out["boxes"][b, :n], plain["boxes"][b][kept], rtol=1e-5, atol=1e-4)
        np.testing.assert_array_equal(out["scores"][b, n:], 0.0)
    assert suppressed_some  # the case exercises the suppression


@pytest.mark.parametrize("nms_iou_threshold", [0.0, 0.5])
def test_detect_from_queries_returns_each_detections_query(nms_iou_threshold):
    """The query of every detection (what its mask comes from): its box is that query's, with or without NMS."""
    rng = np.random.default_rng(3)
    logits = rng.normal(0.0, 2.0, (2, 6, 3)).astype(np.float32)
    boxes = np.concatenate([rng.uniform(0.2, 0.8, (2, 6, 2)), rng.uniform(0.05, 0.3, (2, 6, 2))], -1).astype(np.float32)
    options = dict(image_height=40, image_width=60, max_detections=5, score_threshold=0.1)
    out = _detect_from_queries(logits, boxes, **options, nms_iou_threshold=nms_iou_threshold, return_queries=True)
    plain = _detect_from_queries(logits, boxes, **options, nms_iou_threshold=nms_iou_threshold)
    for key in plain:
        np.testing.assert_array_equal(out[key], plain[key])
    queries, valid = np.asarray(out["queries"]), np.asarray(out["valid"])
    assert queries.dtype == np.int32 and queries.shape == (2, 5) and valid.any()
    cx, cy, w, h = np.moveaxis(np.take_along_axis(boxes, queries[..., None], 1), -1, 0)
    expected = np.clip(
        np.stack([cy - h / 2, cx - w / 2, cy + h / 2, cx + w / 2], -1) * [40, 60, 40, 60], 0, [40, 60, 40, 60]
    )
    np.testing.assert_allclose(np.asarray(out["boxes"])[valid], expected[valid], atol=1e-4)
    classes = np.asarray(out["classes"])
    np.testing.assert_allclose(
        np.asarray(out["scores"])[valid],
        (1 / (1 + np.exp(-logits)))[np.nonzero(valid)[0], queries[valid], classes[valid]],
        rtol=1e-5,
    )


@pytest.mark.parametrize("max_output_size", [3, 12])  # fewer and more slots than boxes
def test_nms_program_has_no_scatter(max_output_size):
    """The kept positions come from top-k, not jnp.nonzero's scatter, which ONNX converters do not take."""
    boxes = jnp.array([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [0, 0, 5, 5]] * 2, jnp.float32)
    scores = jnp.linspace(1.0, 0.1, 8)
    program = str(
        jax.make_jaxpr(lambda b, s: postprocess.non_max_suppression(b, s, 0.5, max_output_size))(boxes, scores)
    )
    assert "scatter" not in program
    indices, valid = postprocess.non_max_suppression(boxes, scores, 0.5, max_output_size)
    # 0, 2, 3 survive in the first copy; their twins (4, 6, 7) overlap them fully.
    kept = [0, 2, 3][:max_output_size]
    assert indices[valid].tolist() == kept and int(valid.sum()) == len(kept)
    assert indices[~valid].tolist() == [0] * (max_output_size - len(kept))
