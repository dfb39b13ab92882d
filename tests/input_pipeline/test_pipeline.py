"""Train/eval iterators, COCO ground truth and configuration errors."""

import collections
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import input_pipeline
import sharding
from input_pipeline import pipeline
from input_pipeline.datasets import synthetic_shapes as ss
from tests.helpers import REPO_ROOT
from tests.helpers.pipeline_config import MAX_BOXES, N_EVAL, N_TRAIN, NET, SIZE, make_config


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("data")
    input_pipeline.get_dataset_info(make_config(path))  # Prepare once per session.
    return path


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_train_batch_shapes_and_dtypes(data_dir):
    batch = next(input_pipeline.create_train_iterator(make_config(data_dir)))
    expected = {
        "image": ((8, *NET, 3), np.uint8),
        "image_hw": ((8, 2), np.int32),
        "source_hw": ((8, 2), np.int32),
        "source_to_image": ((8, 4), np.float32),
        "source_flipped": ((8,), np.bool_),
        "boxes": ((8, MAX_BOXES, 4), np.float32),
        "labels": ((8, MAX_BOXES), np.int32),
        "boxes_mask": ((8, MAX_BOXES), np.bool_),
        "image_id": ((8,), np.int32),
        "scale": ((8,), np.float32),
        "original_size": ((8, 2), np.int32),
        "example_mask": ((8,), np.bool_),
    }
    assert set(batch) == set(expected)
    for key, (shape, dtype) in expected.items():
        assert batch[key].shape == shape, key
        assert batch[key].dtype == dtype, key
    assert batch["example_mask"].all()
    assert batch["boxes_mask"].any(1).all()  # Every image keeps an object.
    labels, mask = batch["labels"], batch["boxes_mask"]
    assert ((labels >= 0) == mask).all() and labels.max() < 4
    boxes = batch["boxes"][mask]
    assert (boxes[:, 2:] - boxes[:, :2] >= 2.0).all()  # min_box_size
    assert boxes[:, [0, 2]].max() <= NET[0] and boxes[:, [1, 3]].max() <= NET[1]
    assert set(batch["image_id"].tolist()) <= set(range(1, N_TRAIN + 1))
    np.testing.assert_array_equal(batch["original_size"], SIZE)
    # Each example draws its own jitter factor: fit (0.75) x [0.8, 1.25].
    assert len(set(batch["scale"].tolist())) == 8
    assert (batch["scale"] >= 0.75 * 0.8 - 1e-6).all()
    assert (batch["scale"] <= 0.75 * 1.25 + 1e-6).all()
    # Pixels, not normalised: images of shapes on a background, zeros beyond each image's size.
    assert 20 < batch["image"].std() < 128
    assert (batch["image_hw"] >= 1).all() and (batch["image_hw"] <= NET).all()
    for image, (height, width) in zip(batch["image"], batch["image_hw"]):
        assert not image[height:].any() and not image[:, width:].any()
    # Resized on the host: nothing left for the device to do.
    np.testing.assert_array_equal(batch["source_hw"], batch["image_hw"])
    np.testing.assert_array_equal(batch["source_to_image"], np.tile([1.0, 1.0, 0.0, 0.0], (8, 1)))
    assert not batch["source_flipped"].any()


def test_train_batches_carry_each_boxs_mask_at_the_mask_stride(data_dir):
    """The embedded dataset's masks reach the batch bit-packed, one per kept box, inside its box."""
    stride = 4
    batch = next(input_pipeline.create_train_iterator(make_config(data_dir, **{"input.mask_stride": stride})))
    grid = (NET[0] // stride, NET[1] // stride)
    assert batch["masks"].shape == (8, MAX_BOXES, grid[0], -(-grid[1] // 8)) and batch["masks"].dtype == np.uint8
    assert batch["masks_valid"].shape == (8, MAX_BOXES)
    np.testing.assert_array_equal(batch["masks_valid"], batch["boxes_mask"])  # every shape has its mask
    cells = np.unpackbits(batch["masks"], axis=-1, count=grid[1]).astype(bool)
    assert not cells[~batch["boxes_mask"]].any()
    centres_y = (np.arange(grid[0]) + 0.5) * stride
    centres_x = (np.arange(grid[1]) + 0.5) * stride
    filled = 0
    for box, box_cells in zip(batch["boxes"][batch["boxes_mask"]], cells[batch["boxes_mask"]]):
        rows, columns = np.nonzero(box_cells)
        # A set cell's centre lies in its box, give or take one cell.
        assert (centres_y[rows] > box[0] - stride).all() and (centres_y[rows] < box[2] + stride).all()
        assert (centres_x[columns] > box[1] - stride).all() and (centres_x[columns] < box[3] + stride).all()
        filled += box_cells.any()
    assert filled >= 0.8 * batch["boxes_mask"].sum()  # outlines under a cell wide may fall between centres


def test_batches_resized_on_the_device_equal_those_resized_on_the_host(data_dir):
    """Same images, boxes and flips; after the train step's resample and normalisation the pixels agree."""
    from detector.ops.images import normalize_images, resample_images

    # 64 px sources into an 80x72 canvas: every crop window's source region fits, both shrunk and grown.
    overrides = {"input.image_size": (80, 72), "input.scale_jitter": (0.3, 2.0)}
    on_host = _take(input_pipeline.create_train_iterator(make_config(data_dir, **overrides)), 2)
    on_device = _take(
        input_pipeline.create_train_iterator(make_config(data_dir, **overrides, **{"input.resize_on_device": True})), 2
    )
    mean, std = (123.675, 116.28, 103.53), (58.395, 57.12, 57.375)
    for host, device in zip(on_host, on_device):
        for key in ("image_hw", "boxes", "labels", "boxes_mask", "image_id", "scale", "original_size"):
            np.testing.assert_array_equal(host[key], device[key], err_msg=key)
        assert (device["source_to_image"][:, :2] != 1.0).any() and device["source_flipped"].any()
        resampled = resample_images(
            device["image"], device["source_hw"], device["source_to_image"], device["source_flipped"]
        )
        got = np.asarray(normalize_images(resampled, device["image_hw"], mean, std))
        want = np.asarray(normalize_images(host["image"], host["image_hw"], mean, std))
        # The host rounds to uint8 (half a grey level); the device does not.
        np.testing.assert_allclose(got, want, atol=(0.5 + 1e-2) / min(std))


@pytest.mark.slow  # 6 s; the fast tier's resume test reads the same stream twice
def test_train_is_deterministic_per_seed(data_dir):
    config = make_config(data_dir)
    a = _take(input_pipeline.create_train_iterator(config), 3)
    b = _take(input_pipeline.create_train_iterator(config), 3)
    for x, y in zip(a, b):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)
    c = _take(input_pipeline.create_train_iterator(make_config(data_dir, seed=1)), 3)
    assert not all(np.array_equal(x["image_id"], y["image_id"]) for x, y in zip(a, c))
    assert not np.array_equal(a[0]["image"], c[0]["image"])
    # Epochs: the stream repeats forever and visits every example each epoch.
    it = input_pipeline.create_train_iterator(config)
    ids = np.concatenate([b["image_id"] for b in _take(it, 2 * N_TRAIN // 8)])
    counts = collections.Counter(ids.tolist())
    assert set(counts) == set(range(1, N_TRAIN + 1))
    assert set(counts.values()) == {2}


def test_train_resumes_at_position(data_dir):
    """Stopping after 9 batches and resuming at the recorded position continues the same stream."""
    config = make_config(data_dir)
    full = _take(input_pipeline.create_train_iterator(config), 12)
    stopped = input_pipeline.create_train_iterator(config)
    _take(stopped, 9)
    assert stopped.position == 9 * 8
    resumed = _take(input_pipeline.create_train_iterator(config, start_position=stopped.position), 3)
    for got, want in zip(resumed, full[9:]):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.parametrize("process_count", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_global_batches_do_not_depend_on_process_count(data_dir, process_count):
    """Each process's rows, side by side, are exactly the one-process global batch."""
    config = make_config(data_dir)
    single = _take(input_pipeline.create_train_iterator(config), 3)
    local = 8 // process_count
    parts = [
        _take(pipeline.train_dataset(config, first_row=k * local, process_count=process_count).as_numpy_iterator(), 3)
        for k in range(process_count)
    ]
    for step, want in enumerate(single):
        for key in want:
            got = np.concatenate([part[step][key] for part in parts])
            np.testing.assert_array_equal(got, want[key], err_msg=key)


def test_negatives_can_be_left_out(data_dir):
    config = make_config(data_dir)
    split = input_pipeline.prepare_split(config, "train")
    assert (split.num_training_boxes() > 0).all()  # Synthetic images all have objects.
    np.testing.assert_array_equal(pipeline.training_record_ids(config, split), np.arange(N_TRAIN))


def test_eval_visits_every_image_once(data_dir):
    config = make_config(data_dir)  # 20 examples, batch 8 -> 3 batches
    batches, num_batches, counts = input_pipeline.create_eval_iterator(config)
    batches = list(batches)
    assert counts.examples == N_EVAL and counts.counts["decode_failed"] == 0
    assert num_batches == 3 and len(batches) == 3
    ids = np.concatenate([b["image_id"] for b in batches])
    mask = np.concatenate([b["example_mask"] for b in batches])
    assert sorted(ids[mask].tolist()) == list(range(1, N_EVAL + 1))
    assert mask.sum() == N_EVAL
    assert (ids[~mask] == -1).all()
    for b in batches:
        pad = ~b["example_mask"]
        assert (b["labels"][pad] == -1).all() and not b["boxes_mask"][pad].any()
        assert (b["scale"] > 0).all()
        assert b["image"].shape == (8, *NET, 3)


@pytest.mark.parametrize("process_count,global_batch", [(2, 6), (3, 6), (4, 4)])
def test_eval_shards_cover_split_once(data_dir, process_count, global_batch):
    config = make_config(data_dir, global_batch_size=global_batch)
    seen, steps = [], set()
    for index in range(process_count):
        ds, num_batches = pipeline.eval_dataset(
            config, first_row=index * (global_batch // process_count), process_count=process_count
        )
        batches = list(ds.as_numpy_iterator())
        steps.add((num_batches, len(batches)))
        for b in batches:
            assert b["image_id"].shape == (global_batch // process_count,)
            seen.extend(b["image_id"][b["example_mask"]].tolist())
    expected_steps = -(-N_EVAL // global_batch)
    assert steps == {(expected_steps, expected_steps)}  # Same on every process.
    assert sorted(seen) == list(range(1, N_EVAL + 1))


def test_coco_ground_truth_matches_dataset(data_dir):
    config = make_config(data_dir)
    gt = input_pipeline.coco_ground_truth(config)
    assert gt["categories"] == [{"id": i + 1, "name": n} for i, n in enumerate(ss.CLASS_NAMES)]
    assert sorted(im["id"] for im in gt["images"]) == list(range(1, N_EVAL + 1))
    assert all(im["height"] == SIZE and im["width"] == SIZE for im in gt["images"])
    ann_ids = [a["id"] for a in gt["annotations"]]
    assert sorted(ann_ids) == list(range(1, len(ann_ids) + 1))
    by_image = collections.defaultdict(list)
    for a in gt["annotations"]:
        by_image[a["image_id"]].append(a)
    for image_id in range(1, N_EVAL + 1):
        ex = ss.generate_example("validation", image_id - 1, SIZE)
        anns = by_image[image_id]
        assert [a["category_id"] for a in anns] == (ex.labels + 1).tolist()
        for a, (y0, x0, y1, x1) in zip(anns, ex.boxes):
            np.testing.assert_allclose(a["bbox"], [x0, y0, x1 - x0, y1 - y0])
            assert a["area"] == pytest.approx((x1 - x0) * (y1 - y0))
            assert a["iscrowd"] == 0


def test_eval_boxes_map_back_to_ground_truth(data_dir):
    config = make_config(data_dir)
    gt = input_pipeline.coco_ground_truth(config)
    by_image = collections.defaultdict(list)
    for a in gt["annotations"]:
        by_image[a["image_id"]].append(a["bbox"])
    checked = 0
    batches = input_pipeline.create_eval_iterator(config).batches
    for b in batches:
        for i in np.flatnonzero(b["example_mask"]):
            boxes = b["boxes"][i][b["boxes_mask"][i]] / b["scale"][i]
            xywh = np.stack([boxes[:, 1], boxes[:, 0], boxes[:, 3] - boxes[:, 1], boxes[:, 2] - boxes[:, 0]], -1)
            np.testing.assert_allclose(xywh, by_image[int(b["image_id"][i])], atol=1e-3)
            # Fits the network input: 64 px -> min(48/64, 56/64).
            assert b["scale"][i] == pytest.approx(0.75)
            checked += 1
    assert checked == N_EVAL


def test_dataset_info(data_dir):
    info = input_pipeline.get_dataset_info(make_config(data_dir))
    assert info.name == "synthetic_shapes" and info.num_classes == 4
    assert info.class_names == ss.CLASS_NAMES
    assert info.label_to_category_id == (1, 2, 3, 4)
    assert info.num_eval_examples == N_EVAL


def test_unknown_dataset_is_an_error(data_dir):
    config = make_config(data_dir, **{"dataset.name": "imagenette"})
    with pytest.raises(input_pipeline.DatasetError, match="synthetic_shapes.*coco_json.*coco/2017"):
        input_pipeline.get_dataset_info(config)
    with pytest.raises(input_pipeline.DatasetError, match="imagenette"):
        input_pipeline.create_train_iterator(config)


def test_indivisible_global_batch_is_an_error(data_dir):
    config = make_config(data_dir, global_batch_size=6)
    # The one global-batch check (sharding.split_global_batch), as the trainer's mesh check raises it.
    with pytest.raises(
        sharding.MeshError, match=r"global_batch_size=6 does not divide over 4 processes; use a multiple of 4"
    ):
        pipeline.train_dataset(config, process_count=4)
    with pytest.raises(sharding.MeshError, match="global_batch_size=6 does not divide over 4 processes"):
        pipeline.eval_dataset(config, process_count=4)
    assert pipeline.local_batch_size(config, 3) == 2


def test_missing_coco_is_an_error(tmp_path):
    config = make_config(tmp_path, **{"dataset.name": "coco/2017"})
    with pytest.raises(input_pipeline.DatasetError) as err:
        input_pipeline.get_dataset_info(config)
    message = str(err.value)
    assert "\n" not in message
    assert f"cannot read split 'train' of coco/2017 from {tmp_path}" in message
    assert f"tfds build coco/2017 --data_dir={tmp_path}" in message
    assert "--config.dataset.data_dir" in message
    assert list(tmp_path.iterdir()) == []  # Nothing was downloaded or created.


def test_missing_data_dir_parent_is_an_error(tmp_path):
    missing = tmp_path / "no" / "such" / "dir"
    config = make_config(missing)
    parent = re.escape(str(tmp_path / "no" / "such"))
    with pytest.raises(input_pipeline.DatasetError, match=f"{parent} does not exist"):
        input_pipeline.create_train_iterator(config)


@pytest.mark.slow  # 8-10 s of compiling
def test_mosaics_are_a_function_of_the_position_and_stop_at_mosaic_until(data_dir):
    """Half the examples of the first half of the run are 2 x 2 mosaics; resuming draws the same ones, and past
    `input.mosaic_until` the stream is the one without mosaics."""
    steps = 8
    config = make_config(data_dir, **{"total_steps": steps, "input.mosaic_probability": 0.5, "input.mosaic_until": 0.5})
    plain = _take(input_pipeline.create_train_iterator(make_config(data_dir, total_steps=steps)), steps)
    mixed = _take(input_pipeline.create_train_iterator(config), steps)
    changed = [[not np.array_equal(a["image"][i], b["image"][i]) for i in range(8)] for a, b in zip(mixed, plain)]
    first_half = np.array(changed[: steps // 2])
    assert 0.25 < first_half.mean() < 0.75  # about half are mosaics
    assert not np.any(changed[steps // 2 :])  # the second half: the same examples, bit for bit
    for got, want in zip(mixed[steps // 2 :], plain[steps // 2 :]):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    # A mosaic holds four images' boxes (up to max_boxes): more than its single image had.
    boxes = [
        (a["boxes_mask"][i].sum(), b["boxes_mask"][i].sum())
        for a, b, c in zip(mixed, plain, changed)
        for i in range(8)
        if c[i]
    ]
    assert np.mean([m for m, _ in boxes]) > 1.5 * np.mean([p for _, p in boxes])
    resumed = _take(input_pipeline.create_train_iterator(config, start_position=3 * 8), 2)
    for got, want in zip(resumed, mixed[3:5]):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.parametrize("key", ["mosaic_probability", "mosaic_until"])
def test_mosaic_settings_out_of_range_are_one_error(data_dir, key):
    config = make_config(
        data_dir,
        **{f"input.{key}": 1.5, "input.mosaic_probability": 0.5}
        if key != "mosaic_probability"
        else {f"input.{key}": 1.5},
    )
    with pytest.raises(input_pipeline.DatasetError, match=rf"input\.{key} must be in \[0, 1\], got 1.5"):
        pipeline.train_dataset(config)


_EVAL_PASS = """
import pathlib, sys
import numpy as np
import input_pipeline
from tests.helpers.coco_folders import write_folder
from tests.helpers.pipeline_config import make_config

root = pathlib.Path(sys.argv[1])
json_path, image_dir, _ = write_folder(root, "val", 100, crowd_every=0)
config = make_config(
    root / "data",
    global_batch_size=32,
    **{
        "dataset.name": "coco_json",
        "dataset.train_json": str(json_path),
        "dataset.train_images": str(image_dir),
        "dataset.eval_json": str(json_path),
        "dataset.eval_images": str(image_dir),
        "dataset.cache_dir": str(root / "prepared"),
    },
)
batches, num_batches, counts = input_pipeline.create_eval_iterator(config)
masks = [b["example_mask"] for b in batches]
print(num_batches, int(np.sum(masks)), counts.counts["decode_failed"])
"""


def test_padding_an_eval_pass_logs_no_tensorflow_warning(tmp_path):
    """100 validation images at batch 32: 28 padding slots, none of which reaches the record parser (TensorFlow
    logs every failed op at its default log level, one parse warning per slot per evaluation)."""
    result = subprocess.run(
        [sys.executable, "-c", _EVAL_PASS, str(tmp_path)],
        cwd=REPO_ROOT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0", "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["4", "100", "0"]  # 4 batches, every image once, no slot counted as failed
    assert "OP_REQUIRES failed" not in result.stderr, result.stderr[-3000:]
    assert "is required but could not be found" not in result.stderr
