"""TFDS coco/2017 and voc through the same prepared-split path, on tfds.testing.mock_data.

Nothing can be downloaded here, so TFDS is mocked: the builders, their
feature specs and TFDS's own encode/decode of examples are real; the stored
examples come from `_fake_examples` (valid detection examples, since TFDS's
random generator gives sequence features of unequal lengths).
"""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

import input_pipeline
from input_pipeline import datasets
from input_pipeline.datasets import cache
from input_pipeline.datasets import synthetic_shapes as ss
from tests.helpers.pipeline_config import make_config

HEIGHT, WIDTH, NUM = 48, 64, 6


def _fake_examples(name, split):
    """NUM examples in the TFDS layout of `name`; every other image has one ignore-region box."""
    examples = []
    for index in range(NUM):
        shapes = ss.generate_example(split, index, WIDTH)
        image = shapes.image[:HEIGHT]
        boxes = np.clip(shapes.boxes, 0, [HEIGHT, WIDTH, HEIGHT, WIDTH])
        keep = (boxes[:, 2] - boxes[:, 0] > 1) & (boxes[:, 3] - boxes[:, 1] > 1)
        boxes, labels = boxes[keep], shapes.labels[keep] + 5 * index % 3  # a few classes beyond 0-3
        normalized = (boxes / [HEIGHT, WIDTH, HEIGHT, WIDTH]).astype(np.float32)
        ignore = np.zeros(len(labels), bool)
        if index % 2 == 0:
            ignore[0] = True
        objects = {"bbox": normalized, "label": labels.astype(np.int64)}
        if name == "coco":
            objects.update(
                is_crowd=ignore, area=np.ones(len(labels), np.int64), id=np.arange(len(labels), dtype=np.int64)
            )
            examples.append(
                {"image": image, "image/filename": f"{index}.jpg", "image/id": 1000 + index, "objects": objects}
            )
        else:
            objects.update(
                is_difficult=ignore, is_truncated=np.zeros(len(labels), bool), pose=np.zeros(len(labels), np.int64)
            )
            examples.append(
                {
                    "image": image,
                    "image/filename": f"{index}.jpg",
                    "objects": objects,
                    "labels": labels.astype(np.int64),
                    "labels_no_difficult": labels[~ignore].astype(np.int64),
                }
            )
    return examples


def _as_dataset(self, split, decoders=None, read_config=None, **kwargs):
    del read_config, kwargs
    features = self.info.features
    serialized = [features.serialize_example(ex) for ex in _fake_examples(self.name, split)]
    return tf.data.Dataset.from_tensor_slices(serialized).map(
        lambda s: features.deserialize_example(s, decoders=decoders)
    )


@pytest.mark.parametrize("name", ["coco/2017", "voc/2007"])
def test_tfds_dataset_reads_through_the_prepared_split(name, tmp_path):
    config = make_config(
        tmp_path,
        **{"dataset.name": name, "dataset.eval_split": "validation", "dataset.cache_dir": str(tmp_path / "prepared")},
    )
    expected = _fake_examples(name.split("/")[0], "validation")
    with tfds.testing.mock_data(policy=tfds.testing.MockPolicy.USE_CODE, as_dataset_fn=_as_dataset):
        info = input_pipeline.get_dataset_info(config)
        split = input_pipeline.prepare_split(config, "eval")
        ground_truth = input_pipeline.coco_ground_truth(config)
        train_split = input_pipeline.prepare_split(config, "train")
        batch = next(input_pipeline.create_train_iterator(config))

    is_coco = name == "coco/2017"
    assert info.class_names == (datasets.COCO_CLASS_NAMES if is_coco else datasets.VOC_CLASS_NAMES)
    assert info.num_eval_examples == NUM
    # COCO keeps its ids; VOC has none, so records are numbered 1..N in file order.
    want_ids = [1000 + i for i in range(NUM)] if is_coco else list(range(1, NUM + 1))
    assert split.image_ids.tolist() == want_ids
    assert split.heights.tolist() == [HEIGHT] * NUM and split.widths.tolist() == [WIDTH] * NUM
    num_boxes = sum(len(ex["objects"]["label"]) for ex in expected)
    assert split.counts["images"] == split.counts["usable_images"] == NUM
    assert split.counts["annotations"] == num_boxes == len(split.labels)
    assert split.counts["crowd_box"] == NUM // 2  # COCO crowd / VOC difficult: kept as ignore regions
    # Boxes back in pixels, labels unchanged; ignore regions flagged for evaluation.
    first = expected[0]["objects"]
    np.testing.assert_allclose(
        split.boxes_yxyx[: len(first["label"])], first["bbox"] * [HEIGHT, WIDTH, HEIGHT, WIDTH], atol=1e-3
    )
    np.testing.assert_array_equal(split.labels[: len(first["label"])], first["label"])
    crowd = [a for a in ground_truth["annotations"] if a["iscrowd"]]
    assert len(crowd) == NUM // 2
    category_ids = datasets.COCO_CATEGORY_IDS if is_coco else tuple(range(1, 21))
    assert {a["category_id"] for a in ground_truth["annotations"]} <= set(category_ids)
    # Training batches: decoded images, ignore regions are no targets.
    assert batch["example_mask"].all() and batch["image"].shape[1:] == (*config.input.image_size, 3)
    targets = dict(zip(train_split.image_ids.tolist(), train_split.num_training_boxes().tolist()))
    assert sum(targets.values()) == len(train_split.labels) - NUM // 2
    for image_id, mask in zip(batch["image_id"], batch["boxes_mask"]):
        assert mask.sum() <= targets[int(image_id)]


def test_prepared_split_ground_truth_columns_are_its_dicts(tmp_path):
    """The columns scoring reads from a prepared split equal the COCO dicts built from it."""
    config = make_config(tmp_path)
    split = input_pipeline.prepare_split(config, "eval")
    as_dicts = cache.ground_truth(split)
    columns = cache.ground_truth_columns(split)
    annotations = as_dicts["annotations"]
    assert len(annotations) == split.box_offsets[-1] > 0
    np.testing.assert_array_equal(columns["image_ids"], [i["id"] for i in as_dicts["images"]])
    np.testing.assert_array_equal(columns["box_image_ids"], [a["image_id"] for a in annotations])
    np.testing.assert_array_equal(columns["box_category_ids"], [a["category_id"] for a in annotations])
    np.testing.assert_array_equal(columns["boxes_xywh"], [a["bbox"] for a in annotations])
    np.testing.assert_array_equal(columns["areas"], [a["area"] for a in annotations])
    y0, x0, y1, x1 = split.boxes_yxyx[0].astype(np.float64)
    np.testing.assert_allclose(columns["boxes_xywh"][0], [x0, y0, x1 - x0, y1 - y0], atol=5e-4)


def test_prepared_split_ground_truth_carries_the_generators_masks(tmp_path):
    """The synthetic eval split's ground truth holds each object's mask, as COCO compressed RLE in columns."""
    from pycocotools import mask as coco_mask

    from tests.helpers.pipeline_config import N_EVAL, SIZE

    split = input_pipeline.prepare_split(make_config(tmp_path), "eval")
    columns = cache.ground_truth_columns(split)
    assert split.has_masks and "mask_runs" not in vars(split)
    assert len(columns["mask_heights"]) == len(columns["mask_widths"]) == len(columns["areas"])
    assert (columns["mask_heights"] == SIZE).all() and (columns["mask_widths"] == SIZE).all()
    data, offsets = columns["mask_counts"].tobytes(), columns["mask_offsets"]
    assert offsets[0] == 0 and offsets[-1] == len(data)
    decoded = np.stack(
        [
            coco_mask.decode({"size": [SIZE, SIZE], "counts": data[offsets[i] : offsets[i + 1]]})
            for i in range(len(offsets) - 1)
        ]
    ).astype(bool)
    assert sorted(columns["image_ids"].tolist()) == list(range(1, N_EVAL + 1))
    for image_id in columns["image_ids"].tolist():
        expected = ss.generate_example("validation", image_id - 1, SIZE).masks
        np.testing.assert_array_equal(decoded[columns["box_image_ids"] == image_id], expected)
