"""Box-aware transforms: boxes must follow the pixels under every transform."""

import numpy as np
import pytest
import tensorflow as tf

from input_pipeline import transforms

RAW = dict(mean_rgb=(0.0, 0.0, 0.0), std_rgb=(1.0, 1.0, 1.0))  # identity norm


def _opts(**kw):
  base = dict(image_size=(64, 64), max_boxes=8, scale_jitter=(1.0, 1.0),
              horizontal_flip=False, min_box_size=0.0, **RAW)
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
    keep[max(0, y0 - pad):y1 + pad, max(0, x0 - pad):x1 + pad] = True
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
    image, boxes = transforms.random_horizontal_flip(
        ex["image"], ex["boxes"], tf.constant([s, 0]))
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
    assert image.shape == (64, 64, 3) and image.dtype == np.float32
    mask = out["boxes_mask"].numpy()
    for box, keep, label in zip(out["boxes"].numpy(), mask,
                                out["labels"].numpy()):
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
  out = transforms.train_transform(ex, tf.constant([0, 0]),
                                   _opts(min_box_size=4.0))
  np.testing.assert_array_equal(out["labels"], [1] + [-1] * 7)
  np.testing.assert_allclose(out["boxes"][0], [20, 20, 40, 50])
  out = transforms.train_transform(ex, tf.constant([0, 0]),
                                   _opts(min_box_size=0.0))
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
  out = transforms.train_transform(_example(64, 64, rects), tf.constant([1, 1]),
                                   _opts(max_boxes=4))
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


def test_normalization_and_determinism():
  ex = _example(64, 64, [[0, 0, 32, 32]])
  opts = _opts(mean_rgb=(100.0, 50.0, 0.0), std_rgb=(2.0, 5.0, 255.0),
               scale_jitter=(0.7, 1.4), horizontal_flip=True)
  a = transforms.train_transform(ex, tf.constant([3, 9]), opts)
  b = transforms.train_transform(ex, tf.constant([3, 9]), opts)
  c = transforms.train_transform(ex, tf.constant([4, 9]), opts)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  assert not np.array_equal(a["image"], c["image"])
  # Without jitter the 64x64 image maps 1:1; black pixels -> -mean/std.
  out = transforms.eval_transform(ex, opts)
  np.testing.assert_allclose(out["image"][40, 40], [-50.0, -10.0, 0.0])
  np.testing.assert_allclose(out["image"][5, 5],
                             [155 / 2, 205 / 5, 1.0], rtol=1e-6)
