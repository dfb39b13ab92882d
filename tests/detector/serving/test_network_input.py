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
