"""Box-aware transforms: boxes must follow the pixels under every transform."""

import dataclasses

import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from input_pipeline import transforms


def _opts(**kw):
    base = dict(image_size=(64, 64), max_boxes=8, scale_jitter=(1.0, 1.0), horizontal_flip=False, min_box_size=0.0)
    base.update(kw)
    return transforms.TransformOptions(**base)


def _example(h, w, rects, labels=None):
    """uint8 image with each [y0, x0, y1, x1] rectangle filled with 255."""
    image = np.zeros((h, w, 3), np.uint8)
    for y0, x0, y1, x1 in rects:
        image[y0:y1, x0:x1] = 255
    labels = list(range(len(rects))) if labels is None else labels
    return {
        "image": tf.constant(image),
        "boxes": tf.constant(np.asarray(rects, np.float32).reshape(-1, 4)),
        "labels": tf.constant(labels, tf.int32),
        "image_id": tf.constant(7, tf.int32),
    }


def _bright_extent(image, box=None, pad=3):
    """Extent (y0, x0, y1, x1) of pixels > 127, optionally near `box` only."""
    bright = np.asarray(image)[..., 0] > 127
    if box is not None:
        keep = np.zeros_like(bright)
        y0, x0, y1, x1 = np.round(box).astype(int)
        keep[max(0, y0 - pad) : y1 + pad, max(0, x0 - pad) : x1 + pad] = True
        bright &= keep
    if not bright.any():
        return None
    rows = np.flatnonzero(bright.any(1))
    cols = np.flatnonzero(bright.any(0))
    return np.array([rows[0], cols[0], rows[-1] + 1, cols[-1] + 1], np.float32)


def test_decode_example_converts_to_pixels_and_drops_crowd():
    image = np.zeros((40, 80, 3), np.uint8)
    example = {
        "image": tf.io.encode_png(image),
        "image/id": tf.constant(123456, tf.int64),
        "objects": {
            "bbox": tf.constant([[0.25, 0.5, 0.75, 1.0], [0.0, 0.0, 0.5, 0.25]]),
            "label": tf.constant([3, 1], tf.int64),
            "is_crowd": tf.constant([False, True]),
        },
    }
    out = transforms.decode_example(example, drop_crowd=False)
    assert out["image"].dtype == tf.uint8 and out["image"].shape == (40, 80, 3)
    np.testing.assert_allclose(out["boxes"], [[10, 40, 30, 80], [0, 0, 20, 20]])
    np.testing.assert_array_equal(out["labels"], [3, 1])
    assert int(out["image_id"]) == 123456
    dropped = transforms.decode_example(example, drop_crowd=True)
    np.testing.assert_allclose(dropped["boxes"], [[10, 40, 30, 80]])
    np.testing.assert_array_equal(dropped["labels"], [3])


def test_flip_boxes_mirrors_exactly():
    boxes = tf.constant([[1.0, 2.0, 5.0, 9.0], [0.0, 0.0, 10.0, 20.0]])
    flipped = transforms.flip_boxes_left_right(boxes, 20)
    np.testing.assert_array_equal(flipped, [[1, 11, 5, 18], [0, 0, 10, 20]])


def test_random_flip_moves_pixels_and_boxes_together():
    ex = _example(30, 50, [[5, 3, 12, 10]])
    outcomes = set()
    for s in range(12):
        image, boxes = transforms.random_horizontal_flip(ex["image"], ex["boxes"], tf.constant([s, 0]))
        box = boxes.numpy()[0]
        np.testing.assert_array_equal(_bright_extent(image), box)
        outcomes.add(tuple(box))
    # Both outcomes happen: unflipped and mirrored (x -> 50 - x).
    assert outcomes == {(5, 3, 12, 10), (5, 40, 12, 47)}


@pytest.mark.parametrize("hw", [(60, 90), (120, 45), (64, 64)])
def test_train_transform_boxes_follow_pixels(hw):
    h, w = hw
    rects = [[10, 12, 30, 40], [h - 20, w - 25, h - 4, w - 6]]
    ex = _example(h, w, rects)
    opts = _opts(scale_jitter=(0.5, 2.0), horizontal_flip=True)
    seen_crop = seen_pad = False
    for s in range(16):
        out = transforms.train_transform(ex, tf.constant([s, 1], tf.int64), opts)
        image = out["image"].numpy()
        assert image.shape == (64, 64, 3) and image.dtype == np.uint8
        mask = out["boxes_mask"].numpy()
        for box, keep, label in zip(out["boxes"].numpy(), mask, out["labels"].numpy()):
            if not keep:
                assert label == -1 and not box.any()
                continue
            assert 0 <= box[0] <= box[2] <= 64 and 0 <= box[1] <= box[3] <= 64
            extent = _bright_extent(image, box)
            assert extent is not None
            # Bilinear resampling may spread a rectangle edge by one pixel.
            np.testing.assert_allclose(extent, box, atol=1.5)
        scale = float(out["scale"])
        content_h, content_w = round(h * scale), round(w * scale)
        seen_crop |= content_h > 64 or content_w > 64
        seen_pad |= content_h < 64 or content_w < 64
        np.testing.assert_array_equal(out["original_size"], [h, w])
        assert bool(out["example_mask"])
    assert seen_crop and seen_pad  # Both code paths ran.


def test_train_transform_clips_and_drops_boxes():
    # 50 px -> 160 px (fit 1.28 x jitter 2.5), then a random 64 px crop: the
    # whole-image box is clipped to the crop, the corner box [96, 160) is kept
    # (clipped) only when the crop reaches far enough, else dropped.
    ex = _example(50, 50, [[0, 0, 50, 50], [30, 30, 50, 50]])
    opts = _opts(scale_jitter=(2.5, 2.5), min_box_size=6.0)
    corner_kept = set()
    for s in range(20):
        out = transforms.train_transform(ex, tf.constant([s, 2]), opts)
        boxes, mask = out["boxes"].numpy(), out["boxes_mask"].numpy()
        labels = out["labels"].numpy()
        np.testing.assert_allclose(boxes[0], [0, 0, 64, 64])
        assert labels[0] == 0
        if mask[1]:
            assert labels[1] == 1
            box = boxes[1]
            assert min(box[2] - box[0], box[3] - box[1]) >= 6.0
            assert box[2] == 64 and box[3] == 64 and box.min() >= 0
        else:
            assert labels[1] == -1
        corner_kept.add(bool(mask[1]))
    assert corner_kept == {True, False}


def test_min_box_size_drops_small_boxes():
    ex = _example(64, 64, [[5, 5, 8, 8], [20, 20, 40, 50], [50, 10, 62, 12]])
    out = transforms.train_transform(ex, tf.constant([0, 0]), _opts(min_box_size=4.0))
    np.testing.assert_array_equal(out["labels"], [1] + [-1] * 7)
    np.testing.assert_allclose(out["boxes"][0], [20, 20, 40, 50])
    out = transforms.train_transform(ex, tf.constant([0, 0]), _opts(min_box_size=0.0))
    np.testing.assert_array_equal(out["labels"], [0, 1, 2] + [-1] * 5)


def test_pad_and_truncate_boxes():
    boxes = tf.constant(np.arange(20, dtype=np.float32).reshape(5, 4))
    labels = tf.constant([4, 3, 2, 1, 0])
    b, l, m = transforms.pad_boxes(boxes, labels, 3)
    np.testing.assert_array_equal(b, boxes[:3])
    np.testing.assert_array_equal(l, [4, 3, 2])
    np.testing.assert_array_equal(m, [True] * 3)
    b, l, m = transforms.pad_boxes(boxes, labels, 8)
    np.testing.assert_array_equal(b[:5], boxes)
    np.testing.assert_array_equal(b[5:], np.zeros((3, 4)))
    np.testing.assert_array_equal(l, [4, 3, 2, 1, 0, -1, -1, -1])
    np.testing.assert_array_equal(m, [True] * 5 + [False] * 3)
    b, l, m = transforms.pad_boxes(tf.zeros([0, 4]), tf.zeros([0], tf.int32), 2)
    np.testing.assert_array_equal(l, [-1, -1])
    assert not m.numpy().any()


def test_train_transform_truncates_to_max_boxes():
    rects = [[2 * i, 2 * i, 2 * i + 20, 2 * i + 20] for i in range(6)]
    out = transforms.train_transform(_example(64, 64, rects), tf.constant([1, 1]), _opts(max_boxes=4))
    np.testing.assert_array_equal(out["labels"], [0, 1, 2, 3])
    assert out["boxes"].shape == (4, 4) and out["boxes_mask"].numpy().all()


def test_eval_transform_records_scale_and_maps_back():
    h, w = 100, 200
    rects = [[10, 20, 60, 90], [70, 150, 100, 200]]
    ex = _example(h, w, rects)
    out = transforms.eval_transform(ex, _opts(image_size=(128, 128)))
    scale = float(out["scale"])
    assert scale == pytest.approx(0.64)
    np.testing.assert_array_equal(out["original_size"], [h, w])
    boxes = out["boxes"].numpy()[out["boxes_mask"].numpy()]
    np.testing.assert_allclose(boxes / scale, rects, atol=1e-4)
    image = out["image"].numpy()
    # Content fills the top 64 rows; padding (bottom) is exactly zero.
    assert not image[64:].any()
    for box in boxes:
        np.testing.assert_allclose(_bright_extent(image, box), box, atol=1.5)
    # Deterministic.
    again = transforms.eval_transform(ex, _opts(image_size=(128, 128)))
    np.testing.assert_array_equal(again["image"], image)


def test_eval_transform_tall_image_pads_right():
    ex = _example(256, 64, [[0, 0, 256, 64]])
    out = transforms.eval_transform(ex, _opts(image_size=(64, 64)))
    assert float(out["scale"]) == 0.25
    np.testing.assert_allclose(out["boxes"][0], [0, 0, 64, 16])
    image = out["image"].numpy()
    assert not image[:, 16:].any() and (image[:, :16] > 127).all()


def test_pixels_stay_uint8_and_the_transforms_are_deterministic():
    ex = _example(64, 64, [[0, 0, 32, 32]])
    opts = _opts(scale_jitter=(0.7, 1.4), horizontal_flip=True)
    a = transforms.train_transform(ex, tf.constant([3, 9]), opts)
    b = transforms.train_transform(ex, tf.constant([3, 9]), opts)
    c = transforms.train_transform(ex, tf.constant([4, 9]), opts)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["image"], c["image"])
    # Without jitter the 64x64 image maps 1:1, pixel for pixel.
    out = transforms.eval_transform(ex, opts)
    assert out["image"].dtype == tf.uint8
    np.testing.assert_array_equal(out["image"], ex["image"])
    np.testing.assert_array_equal(out["image_hw"], [64, 64])


# --- Large-scale jitter, visibility, colour jitter, truncation, config. ---

BG = 60  # Background grey of _channel_example.


def _channel_example(h, w, rects):
    """Grey (BG) image where rectangle k raises channel k to 255 (k < 3).

    Resampling is linear per channel, so after any resize (raw - BG) / (255 -
    BG) in channel k is the fraction of the pixel covered by box k.
    """
    image = np.full((h, w, 3), BG, np.uint8)
    for k, (y0, x0, y1, x1) in enumerate(rects):
        image[y0:y1, x0:x1, k] = 255
    return _example(h, w, rects) | {"image": tf.constant(image)}


def _content_size(out, h, w):
    """(rows, cols) of the network image holding resized pixels (not padding)."""
    scale = np.float32(out["scale"])
    new_h = int(np.round(np.float32(h) * scale))
    new_w = int(np.round(np.float32(w) * scale))
    return new_h, new_w


@pytest.mark.parametrize("hw", [(48, 80), (96, 40)])
def test_lsj_boxes_follow_pixels_with_zoom_out_and_zoom_in(hw):
    h, w = hw
    # The last box overflows the image (as annotations sometimes do): it must
    # end at the content edge, not in the padding.
    rects = [[4, 6, h // 2, w // 2], [h // 2 + 2, 3, h - 3, w // 3 + 4], [6, w // 2 + 5, h + 4, w + 3]]
    ex = _channel_example(h, w, rects)
    opts = _opts(scale_jitter=(0.1, 2.0), horizontal_flip=True)
    seen_zoom_out = seen_zoom_in = False
    for s in range(24):
        out = transforms.train_transform(ex, tf.constant([s, 5], tf.int64), opts)
        image = out["image"].numpy()
        assert image.shape == (64, 64, 3)
        new_h, new_w = _content_size(out, h, w)
        ch, cw = min(new_h, 64), min(new_w, 64)
        # Padding (bottom/right) is zeros and image_hw says where it starts; content (grey BG) is not zero.
        np.testing.assert_array_equal(out["image_hw"], [ch, cw])
        assert not image[ch:].any() and not image[:, cw:].any()
        assert image[:ch, :cw].sum(-1).all()
        seen_zoom_out |= new_h * new_w < 0.25 * 64 * 64  # Mostly padding.
        seen_zoom_in |= min(new_h - 64, new_w - 64) > 0 or max(new_h, new_w) > 96
        cover = (image[:ch, :cw].astype(np.float32) - BG) / (255 - BG)
        yc = np.arange(ch)[:, None] + 0.5  # Pixel centres.
        xc = np.arange(cw)[None, :] + 0.5
        boxes, labels = out["boxes"].numpy(), out["labels"].numpy()
        mask = out["boxes_mask"].numpy()
        assert sorted(labels[mask]) == sorted(set(labels[mask]))
        for k in range(3):
            outside = np.ones((ch, cw), bool)
            for box in boxes[mask & (labels == k)]:
                y0, x0, y1, x1 = box
                # Inside the visible content, never into padding or past the image.
                assert 0 <= y0 < y1 <= ch and 0 <= x0 < x1 <= cw, (s, box)
                # Pixels centred at least half a pixel inside are mostly box k; the
                # pixel under the centre carries box k even for a 1-pixel box.
                inside = (yc >= y0 + 0.5) & (yc <= y1 - 0.5) & (xc >= x0 + 0.5) & (xc <= x1 - 0.5)
                assert (cover[..., k][inside] > 0.5).all(), (s, k, box)
                cy = min(int((y0 + y1) / 2), ch - 1)
                cx = min(int((x0 + x1) / 2), cw - 1)
                assert cover[cy, cx, k] > 0.4, (s, k, box)
                outside &= ~((yc > y0 - 0.5) & (yc < y1 + 0.5) & (xc > x0 - 0.5) & (xc < x1 + 0.5))
            # Everything else (incl. a dropped box's colour) is mostly background.
            assert (cover[..., k][outside] < 0.5).all(), (s, k)
    assert seen_zoom_out and seen_zoom_in


def test_drop_hidden_boxes_keeps_at_least_the_visible_fraction():
    boxes = tf.constant([[0, 0, 10, 10]] * 4 + [[2, 2, 4, 4]], tf.float32)
    clipped = tf.constant([[0, 0, 10, 10], [0, 0, 10, 5], [0, 0, 10, 3.9], [0, 0, 4, 10], [2, 2, 2, 4]], tf.float32)
    labels = tf.constant([0, 1, 2, 3, 4])
    # Visible fractions 1, 0.5, 0.39, 0.4, 0 (fully hidden).
    kept, kept_labels = transforms.drop_hidden_boxes(boxes, clipped, labels, 0.4)
    np.testing.assert_array_equal(kept_labels, [0, 1, 3])
    np.testing.assert_array_equal(kept, clipped.numpy()[[0, 1, 3]])
    _, kept_labels = transforms.drop_hidden_boxes(boxes, clipped, labels, 0.6)
    np.testing.assert_array_equal(kept_labels, [0])
    _, kept_labels = transforms.drop_hidden_boxes(boxes, clipped, labels, 0.0)
    np.testing.assert_array_equal(kept_labels, [0, 1, 2, 3, 4])


@pytest.mark.parametrize("fraction,kept", [(0.4, True), (0.5, True), (0.6, False)])
def test_min_visible_fraction_drops_half_cut_box(fraction, kept):
    # 32x64 image, fit 1, jitter 2 -> 64x128: the crop is always all rows and a
    # random half of the columns, so the full-width box is exactly half
    # visible; the small box [20, 20, 28, 28] -> [40, 40, 56, 56] is fully
    # visible or partly cut depending on the seed.
    ex = _example(32, 64, [[0, 0, 32, 64], [20, 20, 28, 28]])
    opts = _opts(scale_jitter=(2.0, 2.0), min_visible_fraction=fraction)
    for s in range(4):
        out = transforms.train_transform(ex, tf.constant([s, 3]), opts)
        labels = out["labels"].numpy()
        assert (0 in labels) == kept, s
        if kept:
            np.testing.assert_array_equal(out["boxes"][0], [0, 0, 64, 64])
        # Same seed without the rule: same crop, the rule only removes boxes.
        ref = transforms.train_transform(ex, tf.constant([s, 3]), _opts(scale_jitter=(2.0, 2.0)))
        small = ref["boxes"].numpy()[ref["labels"].numpy() == 1]
        if len(small):
            visible = np.prod(small[0, 2:] - small[0, :2]) / (16 * 16)
            assert (1 in labels) == (visible >= fraction), (s, visible)
        np.testing.assert_array_equal(out["image"], ref["image"])


def test_min_visible_fraction_combines_with_min_box_size():
    # 64 px -> 128 px crop: full-width box half visible (kept at 0.4), thin box
    # [0, 40, 64, 41] -> 2 px wide: visible or not, min_box_size 3 drops it.
    ex = _example(32, 64, [[0, 0, 32, 64], [0, 40, 32, 41]])
    opts = _opts(scale_jitter=(2.0, 2.0), min_visible_fraction=0.4, min_box_size=3.0)
    for s in range(4):
        out = transforms.train_transform(ex, tf.constant([s, 4]), opts)
        np.testing.assert_array_equal(out["labels"], [0] + [-1] * 7)


def test_random_color_jitter_ranges_and_determinism():
    grey = tf.fill([8, 8, 3], 100.0)
    ratios = []
    for s in range(32):
        out = transforms.random_color_jitter(grey, tf.constant([s, 0]), 0.5)
        out = out.numpy()
        # Contrast and saturation leave flat grey alone: only brightness acts.
        np.testing.assert_allclose(out, out[0, 0, 0], rtol=1e-5)
        ratios.append(out[0, 0, 0] / 100.0)
    assert 0.8 <= min(ratios) < 0.85 and 1.15 < max(ratios) <= 1.2
    image = tf.constant(np.random.default_rng(0).uniform(0, 255, (16, 16, 3)), tf.float32)
    a = transforms.random_color_jitter(image, tf.constant([1, 2]), 1.0)
    b = transforms.random_color_jitter(image, tf.constant([1, 2]), 1.0)
    c = transforms.random_color_jitter(image, tf.constant([2, 2]), 1.0)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c) and not np.allclose(a, image)
    assert a.numpy().min() >= 0 and a.numpy().max() <= 255
    same = transforms.random_color_jitter(image, tf.constant([1, 2]), 0.0)
    assert same is image
    with pytest.raises(ValueError, match="strength"):
        transforms.random_color_jitter(image, tf.constant([1, 2]), 1.5)


def test_train_color_jitter_changes_only_visible_pixels():
    rects = [[4, 4, 30, 40], [20, 30, 50, 70]]
    ex = _channel_example(56, 80, rects)
    base = _opts(scale_jitter=(0.3, 1.5), horizontal_flip=True)
    jitter = dataclasses.replace(base, color_jitter=1.0)
    off = dataclasses.replace(base, color_jitter=0.0)
    saw_clip = saw_pad = False
    for s in range(4):
        seed = tf.constant([s, 7], tf.int64)
        plain = transforms.train_transform(ex, seed, base)
        jittered = transforms.train_transform(ex, seed, jitter)
        again = transforms.train_transform(ex, seed, jitter)
        other = transforms.train_transform(ex, tf.constant([s, 8], tf.int64), jitter)
        # Strength 0 is exactly the no-jitter output.
        zero = transforms.train_transform(ex, seed, off)
        for k in plain:
            np.testing.assert_array_equal(zero[k], plain[k], err_msg=k)
            np.testing.assert_array_equal(again[k], jittered[k], err_msg=k)
            if k != "image":  # Geometry and boxes untouched by colour.
                np.testing.assert_array_equal(jittered[k], plain[k], err_msg=k)
        image = jittered["image"].numpy()
        new_h, new_w = _content_size(jittered, 56, 80)
        ch, cw = min(new_h, 64), min(new_w, 64)
        content = image[:ch, :cw]
        assert not np.array_equal(content, plain["image"].numpy()[:ch, :cw])
        assert not np.array_equal(image, other["image"].numpy())
        saw_clip |= bool((content == 255).any())
        # Padding stays exactly zero (jitter runs before padding).
        assert not image[ch:].any() and not image[:, cw:].any()
        saw_pad |= ch < 64 or cw < 64
    assert saw_clip and saw_pad


def test_boxes_truncated_flag():
    rects = [[2 * i, 2 * i, 2 * i + 20, 2 * i + 20] for i in range(6)]
    ex = _example(64, 64, rects)
    for max_boxes, truncated in [(4, True), (5, True), (6, False), (8, False)]:
        opts = _opts(max_boxes=max_boxes)
        out = transforms.train_transform(ex, tf.constant([1, 1]), opts)
        assert out["boxes_truncated"].dtype == tf.bool
        assert out["boxes_truncated"].shape == ()
        assert bool(out["boxes_truncated"]) == truncated, max_boxes
        out = transforms.eval_transform(ex, opts)
        assert bool(out["boxes_truncated"]) == truncated, max_boxes
    # Counted after dropping: 2 of 5 boxes are below min_box_size.
    ex = _example(64, 64, [[0, 0, 2, 2], [5, 5, 30, 30], [1, 1, 3, 3], [10, 10, 40, 40], [20, 20, 60, 60]])
    out = transforms.train_transform(ex, tf.constant([0, 0]), _opts(max_boxes=3, min_box_size=4.0))
    assert not bool(out["boxes_truncated"])
    np.testing.assert_array_equal(out["labels"], [1, 3, 4])
    out = transforms.train_transform(ex, tf.constant([0, 0]), _opts(max_boxes=2, min_box_size=4.0))
    assert bool(out["boxes_truncated"])


def test_train_and_eval_graph_outputs_have_identical_static_specs():
    # As in tf.data: graph mode, image size unknown when tracing (no
    # tensor-dependent Python control flow, so autograph would not change it).
    ex = _channel_example(40, 72, [[3, 4, 20, 30], [10, 40, 38, 70]])
    opts = _opts(
        scale_jitter=(0.1, 2.0), horizontal_flip=True, min_visible_fraction=0.3, color_jitter=0.5, min_box_size=1.0
    )
    example_spec = {
        "image": tf.TensorSpec([None, None, 3], tf.uint8),
        "boxes": tf.TensorSpec([None, 4], tf.float32),
        "labels": tf.TensorSpec([None], tf.int32),
        "image_id": tf.TensorSpec([], tf.int32),
    }
    train = tf.function(lambda e, s: transforms.train_transform(e, s, opts), autograph=False).get_concrete_function(
        example_spec, tf.TensorSpec([2], tf.int64)
    )
    evals = tf.function(lambda e: transforms.eval_transform(e, opts), autograph=False).get_concrete_function(
        example_spec
    )
    spec = lambda f: {
        k: tf.TensorSpec(t.shape, t.dtype)  # noqa: E731
        for k, t in f.structured_outputs.items()
    }
    assert spec(train) == spec(evals)
    assert spec(train)["boxes_truncated"] == tf.TensorSpec([], tf.bool)
    for s in range(2):  # Graph mode matches eager.
        seed = tf.constant([0, s], tf.int64)
        graph, eager = train(ex, seed), transforms.train_transform(ex, seed, opts)
        for k in eager:
            np.testing.assert_allclose(graph[k], eager[k], rtol=1e-5, atol=1e-5, err_msg=k)


def _config(**input_overrides):
    inp = dict(
        image_size=(64, 64),
        max_boxes=8,
        scale_jitter=(0.1, 2.0),
        horizontal_flip=True,
        mean_rgb=(120.0, 110.0, 100.0),
        std_rgb=(50.0, 60.0, 70.0),
        min_box_size=1.0,
        min_visible_fraction=0.0,
        color_jitter=0.0,
        resize_on_device=False,
        source_size=None,
        mask_stride=0,
    )
    inp.update(input_overrides)
    return ml_collections.ConfigDict({"input": inp})


def test_from_config_reads_and_validates_new_keys():
    opts = transforms.TransformOptions.from_config(_config())
    assert opts.min_visible_fraction == 0.0 and opts.color_jitter == 0.0
    opts = transforms.TransformOptions.from_config(_config(min_visible_fraction=0.25, color_jitter=1.0))
    assert opts.min_visible_fraction == 0.25 and opts.color_jitter == 1.0
    for key, value in [
        ("min_visible_fraction", -0.1),
        ("min_visible_fraction", 1.5),
        ("min_visible_fraction", float("nan")),
        ("color_jitter", -0.5),
        ("color_jitter", 2.0),
    ]:
        with pytest.raises(ValueError, match=rf"input\.{key} must be in \[0, 1\]") as err:
            transforms.TransformOptions.from_config(_config(**{key: value}))
        assert "\n" not in str(err.value)
    assert transforms.TransformOptions.from_config(_config(mask_stride=4)).mask_stride == 4
    with pytest.raises(ValueError, match=r"input\.mask_stride must be >= 0"):
        transforms.TransformOptions.from_config(_config(mask_stride=-4))


def test_source_size_needs_resize_on_device_and_must_hold_the_image_size():
    opts = transforms.TransformOptions.from_config(_config(resize_on_device=True, source_size=(96, 64)))
    assert opts.training_image_size == (96, 64) and opts.image_size == (64, 64)
    assert transforms.TransformOptions.from_config(_config(resize_on_device=True)).training_image_size == (64, 64)
    with pytest.raises(ValueError, match=r"input\.source_size=\(96, 64\) applies only with input\.resize_on_device"):
        transforms.TransformOptions.from_config(_config(source_size=(96, 64)))
    with pytest.raises(ValueError, match=r"input\.source_size=\(96, 32\) must be \(H, W\) at least input\.image_size"):
        transforms.TransformOptions.from_config(_config(resize_on_device=True, source_size=(96, 32)))


def test_resizing_on_the_device_refuses_colour_jitter_it_cannot_apply():
    assert transforms.TransformOptions.from_config(_config(resize_on_device=True)).resize_on_device
    with pytest.raises(ValueError, match=r"input\.color_jitter=0\.4 needs the host to resize.*resize_on_device=False"):
        transforms.TransformOptions.from_config(_config(resize_on_device=True, color_jitter=0.4))


def test_mosaic_tiles_four_examples_with_their_boxes_on_their_pixels():
    """Each tile is a training-transformed example at half size; its boxes move with it and stay on its pixels."""
    h, w = 64, 64
    examples = [_example(h, w, [[8 + 4 * i, 10, 30 + 4 * i, 40]], labels=[i]) for i in range(4)]
    opts = _opts(scale_jitter=(0.5, 2.0), horizontal_flip=True)
    single = transforms.train_transform(examples[0], tf.constant([1, 2], tf.int64), opts)
    seen_tiles = set()
    for s in range(12):
        out = transforms.mosaic_transform(examples, tf.constant([s, 2], tf.int64), opts)
        assert {k: (v.shape, v.dtype) for k, v in out.items()} == {k: (v.shape, v.dtype) for k, v in single.items()}
        image = out["image"].numpy()
        np.testing.assert_array_equal(out["image_hw"], [64, 64])
        np.testing.assert_array_equal(out["source_hw"], [64, 64])
        boxes, labels = out["boxes"].numpy()[out["boxes_mask"]], out["labels"].numpy()[out["boxes_mask"]]
        for box, label in zip(boxes, labels):
            # Label i is example i's box: it lies in tile i (row-major halves of the 64 x 64 canvas).
            row, column = divmod(int(label), 2)
            assert row * 32 <= box[0] <= box[2] <= row * 32 + 32 and column * 32 <= box[1] <= box[3] <= column * 32 + 32
            tile = image[row * 32 : row * 32 + 32, column * 32 : column * 32 + 32]  # not a neighbour's edge
            offset = np.float32([row * 32, column * 32] * 2)
            np.testing.assert_allclose(_bright_extent(tile, box - offset) + offset, box, atol=1.5)
            seen_tiles.add(int(label))
        # No bright pixel belongs to no box: every tile's pixels came with its boxes.
        covered = np.zeros((64, 64), bool)
        for y0, x0, y1, x1 in np.round(boxes).astype(int):
            covered[max(0, y0 - 1) : y1 + 1, max(0, x0 - 1) : x1 + 1] = True
        assert not (image[..., 0] > 127)[~covered].any()
        again = transforms.mosaic_transform(examples, tf.constant([s, 2], tf.int64), opts)
        for key in out:
            np.testing.assert_array_equal(again[key], out[key], err_msg=key)
    assert seen_tiles == {0, 1, 2, 3}


def test_mosaic_keeps_the_first_max_boxes_and_says_when_it_cut():
    rects = [[4, 4 + 10 * i, 20, 12 + 10 * i] for i in range(3)]  # 3 boxes an example, 12 a mosaic
    examples = [_example(64, 64, rects) for _ in range(4)]
    out = transforms.mosaic_transform(examples, tf.constant([0, 0], tf.int64), _opts(max_boxes=8))
    assert int(out["boxes_mask"].numpy().sum()) == 8 and bool(out["boxes_truncated"])
    # The kept ones are tiles 0, 1 and 2's, in tile order: tile 0's first.
    assert np.all(out["boxes"].numpy()[:3, :2] < 32)
    roomy = transforms.mosaic_transform(examples, tf.constant([0, 0], tf.int64), _opts(max_boxes=16))
    assert int(roomy["boxes_mask"].numpy().sum()) == 12 and not bool(roomy["boxes_truncated"])
