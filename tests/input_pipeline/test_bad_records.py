"""Every kind of bad record: what happens to it, and how it is counted, from conversion to batches."""

import io
import json

import numpy as np
import pytest
from PIL import Image

import input_pipeline
from tests.helpers.pipeline_config import make_config

SIZE = 32


def _image(mode="RGB", seed=0):
    rgb = np.random.default_rng(seed).integers(0, 256, (SIZE, SIZE, 3), np.uint8)
    if mode == "I;16":
        return Image.fromarray(rgb[..., 0].astype(np.uint16) * 257)
    return Image.fromarray(rgb).convert(mode)


def _encoded(mode="RGB", fmt="PNG", seed=0):
    buffer = io.BytesIO()
    _image(mode, seed).save(buffer, fmt)
    return buffer.getvalue()


def _box(x, y, w, h, category_id=1, **extra):
    return {"bbox": [x, y, w, h], "category_id": category_id, **extra}


# name -> (file bytes or None for a missing file, annotations)
GOOD = [_box(2, 2, 10, 10)]
CASES = {
    "good0.png": (_encoded(seed=1), GOOD),
    "good1.jpg": (_encoded(fmt="JPEG", seed=2), GOOD),
    "good2.png": (_encoded(seed=3), GOOD),
    "good3.png": (_encoded(seed=4), GOOD),
    "good4.png": (_encoded(seed=5), GOOD),
    "truncated.jpg": (_encoded(fmt="JPEG", seed=6)[:-400], GOOD),  # header intact, pixels cut off
    "garbage.jpg": (b"this is not an image at all", GOOD),
    "missing.png": (None, GOOD),
    "gray.jpg": (_encoded("L", "JPEG"), GOOD),
    "rgba.png": (_encoded("RGBA"), GOOD),
    "deep.png": (_encoded("I;16"), GOOD),
    "boxes.png": (
        _encoded(seed=7),
        [
            _box(float("nan"), 1, 5, 5),  # invalid_box: dropped
            _box(4, 4, -3, 5),  # empty_box (negative width): dropped
            _box(40, 40, 5, 5),  # outside_box: dropped
            _box(28, 2, 10, 6),  # clipped_box: kept, clipped to x1 = 32
            _box(2, 2, 6, 6, category_id=99),  # unknown_category: dropped
            _box(10, 10, 8, 8, iscrowd=1),  # crowd_box: kept for evaluation only
        ],
    ),
    "crowded.png": (_encoded(seed=8), [_box(x, y, 4, 4) for x in range(0, 28, 7) for y in range(0, 21, 7)]),
}


def _write(root, cases):
    images, annotations = [], []
    for image_id, (name, (data, boxes)) in enumerate(cases.items(), start=1):
        if data is not None:
            (root / name).write_bytes(data)
        images.append({"id": image_id, "file_name": name, "width": SIZE, "height": SIZE})
        for box in boxes:
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, **box})
    json_path = root / "instances.json"
    json_path.write_text(
        json.dumps({"images": images, "annotations": annotations, "categories": [{"id": 1, "name": "thing"}]})
    )
    return str(json_path)


def _config(tmp_path, cases, **overrides):
    json_path = _write(tmp_path, cases)
    folder = {
        "dataset.name": "coco_json",
        "dataset.train_json": json_path,
        "dataset.train_images": str(tmp_path),
        "dataset.eval_json": json_path,
        "dataset.eval_images": str(tmp_path),
        "input.image_size": (SIZE, SIZE),
        "input.scale_jitter": (1.0, 1.0),
        "input.max_boxes": 8,
    }
    return make_config(tmp_path / "data", **{**folder, **overrides})


def test_every_bad_record_is_handled_and_counted(tmp_path):
    config = _config(tmp_path, CASES)
    split = input_pipeline.prepare_split(config, "eval")
    counts = {k: v for k, v in split.counts.items() if v}
    assert counts == {
        "images": 13,
        "annotations": 11 + 6 + 12,
        "usable_images": 11,
        "missing_image_file": 1,
        "unreadable_image": 1,  # skipped images
        "converted_grayscale": 1,
        "converted_alpha": 1,
        "converted_16bit": 1,  # kept, decoded to RGB
        "invalid_box": 1,
        "empty_box": 1,
        "outside_box": 1,
        "unknown_category": 1,  # dropped boxes
        "clipped_box": 1,
        "crowd_box": 1,
    }
    ids = {name: i for i, name in enumerate(CASES, start=1)}
    boxes_record = split.image_ids.tolist().index(ids["boxes.png"])
    rows = slice(split.box_offsets[boxes_record], split.box_offsets[boxes_record + 1])
    np.testing.assert_array_equal(split.boxes_yxyx[rows], [[2, 28, 8, 32], [10, 10, 18, 18]])
    np.testing.assert_array_equal(split.is_crowd[rows], [False, True])

    eval_iter = input_pipeline.create_eval_iterator(config)
    batches = list(eval_iter.batches)
    image_ids = np.concatenate([b["image_id"] for b in batches])
    example_mask = np.concatenate([b["example_mask"] for b in batches])
    # The truncated JPEG passes conversion (its header is fine) but cannot be decoded: its slot is masked.
    assert ids["truncated.jpg"] not in image_ids[example_mask]
    assert sorted(image_ids[example_mask]) == sorted(
        ids[n] for n in CASES if n not in ("truncated.jpg", "garbage.jpg", "missing.png")
    )
    assert eval_iter.input_counts.counts["decode_failed"] == 1
    assert eval_iter.input_counts.counts["boxes_truncated"] == 1  # 12 boxes, max_boxes 8
    assert eval_iter.input_counts.examples == 11
    for batch in batches:
        for i in np.flatnonzero(batch["example_mask"]):
            # Grayscale, alpha and 16-bit images arrive as ordinary 3-channel images.
            assert np.isfinite(batch["image"][i]).all() and batch["image"][i].std() > 0
        masked = ~batch["example_mask"]
        assert not batch["boxes_mask"][masked].any() and (batch["labels"][masked] == -1).all()

    # Training sees the same: the undecodable image is a masked slot, counted.
    train_iter = input_pipeline.create_train_iterator(
        _config(tmp_path, CASES, global_batch_size=11)
    )  # a batch is one epoch of the 11 records
    for _ in range(2):
        next(train_iter)
    assert train_iter.input_counts.counts["decode_failed"] == 2
    assert train_iter.input_counts.counts["boxes_truncated"] == 2


def test_a_source_that_is_mostly_missing_stops(tmp_path):
    cases = {f"gone{i}.png": (None, GOOD) for i in range(3)}
    cases["here.png"] = (_encoded(), GOOD)
    config = _config(tmp_path, cases)
    with pytest.raises(input_pipeline.DatasetError) as error:
        input_pipeline.get_dataset_info(config)
    message = str(error.value)
    assert "only 1 of 4 images are usable" in message and "missing_image_file': 3" in message
    assert "input.max_bad_fraction" in message and "\n" not in message


def test_a_stream_of_undecodable_images_stops(tmp_path):
    cases = {f"cut{i}.jpg": (_encoded(fmt="JPEG", seed=i)[:-400], GOOD) for i in range(3)}
    cases["whole.png"] = (_encoded(), GOOD)
    config = _config(tmp_path, cases)
    train_iter = input_pipeline.create_train_iterator(config)
    with pytest.raises(input_pipeline.DatasetError, match="could not be decoded"):
        for _ in range(64):
            next(train_iter)
    assert train_iter.input_counts.examples >= 256  # stops on evidence, not on the first bad file


def test_a_mosaic_with_an_undecodable_tile_is_a_masked_counted_slot(tmp_path):
    """A truncated JPEG spoils every mosaic it is drawn into (about 4x its share of the single-image stream):
    each such slot is masked and counted as decode_failed, the others train."""
    cases = {f"good{i}.png": (_encoded(seed=i), GOOD) for i in range(7)}
    cases["truncated.jpg"] = (_encoded(fmt="JPEG", seed=9)[:-400], GOOD)
    overrides = {"input.mosaic_probability": 1.0, "input.mosaic_until": 1.0, "total_steps": 100}
    train_iter = input_pipeline.create_train_iterator(_config(tmp_path, cases, **overrides))
    batches = [next(train_iter) for _ in range(8)]  # 64 examples, 8 epochs of the 8 records
    failed = train_iter.input_counts.counts["decode_failed"]
    assert 8 < failed < 48  # single images: 8 (one per epoch); mosaics: 1 - (7/8)^4 = 41% of 64, not all
    masks = np.concatenate([b["example_mask"] for b in batches])
    assert int((~masks).sum()) == failed
    for batch in batches:
        masked = ~batch["example_mask"]
        assert not batch["boxes_mask"][masked].any()
        # A whole mosaic holds four boxes, one from each tile.
        assert (batch["boxes_mask"][~masked].sum(-1) == 4).all()
