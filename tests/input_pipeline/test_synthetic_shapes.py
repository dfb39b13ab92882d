"""The synthetic shapes dataset: generator geometry and the TFDS builder."""

import os

import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds

from input_pipeline import datasets
from input_pipeline.datasets import synthetic_shapes as ss

SIZE = 64
N_TRAIN, N_EVAL = 64, 20


def _config(data_dir, num_train=N_TRAIN, num_eval=N_EVAL):
    return ml_collections.ConfigDict(
        {
            "dataset": {
                "name": "synthetic_shapes",
                "data_dir": str(data_dir),
                "train_split": "train",
                "eval_split": "validation",
                "num_train_examples": num_train,
                "num_eval_examples": num_eval,
                "image_size": SIZE,
                "cache_dir": None,
            },
            "input": {"max_bad_fraction": 0.5},
        }
    )


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("synthetic")
    config = _config(data_dir)
    return config, datasets.get_builder(config)


def _read_all(builder, split):
    """{image_id: (image uint8 [S,S,3], bbox [N,4] normalized, label [N])}."""
    out = {}
    for ex in tfds.as_numpy(builder.as_dataset(split=split, shuffle_files=False)):
        out[int(ex["image/id"])] = (ex["image"], ex["objects"]["bbox"], ex["objects"]["label"])
    return out


def _dilate(mask, r):
    out = mask.copy()
    for dy in range(-r, r + 1):
        for dx in range(-r, r + 1):
            shifted = np.zeros_like(mask)
            shifted[max(0, dy) : mask.shape[0] + min(0, dy), max(0, dx) : mask.shape[1] + min(0, dx)] = mask[
                max(0, -dy) : mask.shape[0] + min(0, -dy), max(0, -dx) : mask.shape[1] + min(0, -dx)
            ]
            out |= shifted
    return out


def test_generator_is_deterministic():
    a = ss.generate_example("train", 5, SIZE)
    b = ss.generate_example("train", 5, SIZE)
    np.testing.assert_array_equal(a.image, b.image)
    np.testing.assert_array_equal(a.boxes, b.boxes)
    np.testing.assert_array_equal(a.labels, b.labels)
    c = ss.generate_example("train", 6, SIZE)
    d = ss.generate_example("validation", 5, SIZE)
    assert not np.array_equal(a.image, c.image)
    assert not np.array_equal(a.image, d.image)


@pytest.mark.parametrize("size", [64, 128])
def test_boxes_tightly_bound_drawn_pixels(size):
    for index in range(12):
        ex = ss.generate_example("train", index, size)
        n = len(ex.labels)
        assert ex.image.shape == (size, size, 3) and ex.image.dtype == np.uint8
        assert ex.boxes.shape == (n, 4) and ex.masks.shape == (n, size, size)
        # Later shapes never hide most of an earlier one.
        assert (ex.masks.sum((1, 2)) >= 0.6 * ex.shape_pixels).all()
        covered = np.zeros((size, size), bool)
        for box, mask, color in zip(ex.boxes, ex.masks, ex.colors):
            assert mask.any()
            assert not (mask & covered).any()  # Visible masks are disjoint.
            covered |= mask
            y0, x0, y1, x1 = box.astype(int)
            np.testing.assert_array_equal(box, [y0, x0, y1, x1])  # whole pixels
            # The drawn pixels are exactly the object's colour ...
            np.testing.assert_array_equal(ex.image[mask], np.broadcast_to(color, (mask.sum(), 3)))
            # ... and the box is their exact extent: every box edge row/column
            # holds a drawn pixel and nothing is drawn outside the box.
            assert mask[y0].any() and mask[y1 - 1].any()
            assert mask[:, x0].any() and mask[:, x1 - 1].any()
            inside = np.zeros_like(mask)
            inside[y0:y1, x0:x1] = True
            assert not (mask & ~inside).any()
            # The object's colour does not reappear just outside its box.
            ring = _dilate(inside, 1) & ~inside
            assert not (ex.image[ring] == color).all(-1).any()


def test_objects_counts_classes_sizes_contrast():
    counts, labels, filled = [], [], []
    for index in range(100):
        ex = ss.generate_example("train", index, SIZE)
        counts.append(len(ex.labels))
        labels.extend(ex.labels.tolist())
        filled.extend(ex.filled.tolist())
        # The last object is never occluded: its box is the full drawn shape.
        h, w = ex.boxes[-1, 2:] - ex.boxes[-1, :2]
        assert 0.1 * SIZE <= min(h, w) and max(h, w) <= 0.56 * SIZE
        assert 0.4 <= w / h <= 2.5
        everything = ex.masks.any(0)
        for mask, color in zip(ex.masks, ex.colors):
            ring = _dilate(mask, 2) & ~everything
            if ring.sum() >= 5:  # Contrast against the nearby background.
                dist = np.linalg.norm(ex.image[ring].astype(np.float32) - color, axis=-1)
                assert np.median(dist) >= 60.0
    assert min(counts) >= 1 and max(counts) <= 8
    assert len(set(counts)) >= 6  # Counts vary over the range.
    assert set(labels) == {0, 1, 2, 3}
    assert set(filled) == {True, False}


def test_builder_layout_and_content(prepared):
    config, builder = prepared
    assert builder.name == "synthetic_shapes"
    assert builder.builder_config.name == ss.config_name(N_TRAIN, N_EVAL, SIZE)
    assert builder.info.splits["train"].num_examples == N_TRAIN
    assert builder.info.splits["validation"].num_examples == N_EVAL
    features = builder.info.features
    assert set(features.keys()) == {"image", "image/id", "objects"}
    assert features["objects"]["label"].names == list(ss.CLASS_NAMES)
    assert isinstance(features["objects"]["bbox"], tfds.features.BBoxFeature)
    assert features["image"].encoding_format == "png"
    stored = _read_all(builder, "validation")
    assert sorted(stored) == list(range(1, N_EVAL + 1))
    for image_id, (image, bbox, label) in stored.items():
        ex = ss.generate_example("validation", image_id - 1, SIZE)
        np.testing.assert_array_equal(image, ex.image)  # PNG is lossless
        np.testing.assert_allclose(bbox * SIZE, ex.boxes, atol=1e-3)
        np.testing.assert_array_equal(label, ex.labels)
    assert datasets.get_dataset_info(config).num_eval_examples == N_EVAL


def test_two_builds_are_identical(prepared, tmp_path):
    _, first = prepared
    second = datasets.get_builder(_config(tmp_path))
    a, b = _read_all(first, "train"), _read_all(second, "train")
    assert sorted(a) == sorted(b) == list(range(1, N_TRAIN + 1))
    for image_id in a:
        for x, y in zip(a[image_id], b[image_id]):
            np.testing.assert_array_equal(x, y)


def test_sizes_are_part_of_the_identity(prepared):
    config, builder = prepared
    data_dir = config.dataset.data_dir
    small = datasets.get_builder(_config(data_dir, num_train=16, num_eval=4))
    assert small.data_dir != builder.data_dir
    assert small.info.splits["train"].num_examples == 16
    assert small.info.splits["validation"].num_examples == 4
    again = datasets.get_builder(config)
    assert again.info.splits["train"].num_examples == N_TRAIN


def test_prepare_is_reused(prepared, monkeypatch):
    config, builder = prepared

    def snapshot():
        return {
            os.path.join(root, f): os.stat(os.path.join(root, f)).st_mtime_ns
            for root, _, files in os.walk(builder.data_dir)
            for f in files
        }

    before = snapshot()
    assert any("tfrecord" in f for f in before)

    def fail(*args, **kwargs):
        raise AssertionError("the prepared dataset was generated again")

    monkeypatch.setattr(ss, "generate_example", fail)
    again = datasets.get_builder(config)
    assert again.info.splits["train"].num_examples == N_TRAIN
    assert snapshot() == before


def test_default_data_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DETECTOR_DATA_DIR", str(tmp_path / "cache"))
    config = _config(None)
    config.dataset.data_dir = None
    assert datasets.resolve_data_dir(config) == str(tmp_path / "cache")
    assert (tmp_path / "cache").is_dir()
