"""predictor.network_input: one image file's example, in the batch layout the predict step is compiled for."""

import numpy as np

from detector.serving.predictor import network_input
from input_pipeline import batch as batch_layout
from input_pipeline import transforms


def test_network_input_is_one_example_of_the_batch_layout():
    opts = transforms.TransformOptions(image_size=(48, 56), max_boxes=5)
    image = np.random.default_rng(0).integers(0, 256, size=(30, 70, 3), dtype=np.uint8)
    example = network_input(image, 7, opts)
    assert list(example) == list(batch_layout.KEYS)
    spec = batch_layout.example_spec((48, 56), 5)
    assert {k: (v.shape, v.dtype) for k, v in example.items()} == spec
    assert example["image_id"] == 7 and example["example_mask"] and not example["boxes_mask"].any()
    np.testing.assert_array_equal(example["original_size"], [30, 70])
    assert example["scale"] == np.float32(56 / 70)


def test_network_input_is_the_eager_eval_transform():
    """One graph for every image size gives what the transform gives op by op (evaluation's tf.data graph too)."""
    import tensorflow as tf

    opts = transforms.TransformOptions(image_size=(64, 64), max_boxes=3)
    rng = np.random.default_rng(1)
    for height, width in ((30, 70), (64, 64), (200, 41), (7, 9)):
        image = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        eager = transforms.eval_transform(
            {
                "image": tf.constant(image),
                "boxes": tf.zeros((0, 4), tf.float32),
                "labels": tf.zeros((0,), tf.int32),
                "image_id": tf.constant(5, tf.int32),
            },
            opts,
        )
        example = network_input(image, 5, opts)
        for key in batch_layout.KEYS:
            np.testing.assert_array_equal(example[key], np.asarray(eager[key]), err_msg=f"{key} at {height}x{width}")
