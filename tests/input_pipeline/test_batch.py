"""The batch layout (input_pipeline.batch) is what every producer of batches yields and what the steps compile for."""

import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import input_pipeline
from input_pipeline import batch as batch_layout
from input_pipeline import pipeline
from tests.helpers import REPO_ROOT
from tests.helpers.pipeline_config import MAX_BOXES, NET, make_config


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    config = make_config(tmp_path_factory.mktemp("data"))
    input_pipeline.get_dataset_info(config)  # Prepare once.
    return config


def _layout(arrays):
    return {key: (np.shape(value), np.asarray(value).dtype) for key, value in arrays.items()}


def test_spec_matches_the_documented_layout():
    spec = batch_layout.batch_spec(4, (48, 56), 8)
    assert list(spec) == list(batch_layout.KEYS)
    assert spec == {
        "image": ((4, 48, 56, 3), np.uint8),
        "image_hw": ((4, 2), np.int32),
        "source_hw": ((4, 2), np.int32),
        "source_to_image": ((4, 4), np.float32),
        "source_flipped": ((4,), np.bool_),
        "boxes": ((4, 8, 4), np.float32),
        "labels": ((4, 8), np.int32),
        "boxes_mask": ((4, 8), np.bool_),
        "image_id": ((4,), np.int32),
        "scale": ((4,), np.float32),
        "original_size": ((4, 2), np.int32),
        "example_mask": ((4,), np.bool_),
    }


def test_abstract_batch_carries_spec_and_sharding():
    import jax

    mesh = jax.make_mesh((8, 1, 1), ("data", "fsdp", "model"), axis_types=(AxisType.Auto,) * 3)
    sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    abstract = batch_layout.abstract_batch(16, (32, 40), 5, sharding)
    spec = batch_layout.batch_spec(16, (32, 40), 5)
    assert {k: (v.shape, v.dtype) for k, v in abstract.items()} == spec
    assert all(v.sharding == sharding for v in abstract.values())


@pytest.mark.parametrize("which", ["train", "eval"])
def test_pipeline_batches_have_exactly_the_abstract_batch_layout(config, which):
    if which == "train":
        batch = next(input_pipeline.create_train_iterator(config))
    else:
        batch = next(input_pipeline.create_eval_iterator(config).batches)
    abstract = batch_layout.abstract_batch(int(config.global_batch_size), NET, MAX_BOXES)
    assert list(batch) == list(abstract)  # Same keys, none extra (the report flags are taken out).
    assert _layout(batch) == {k: (v.shape, v.dtype) for k, v in abstract.items()}


def test_training_batches_resized_on_the_device_carry_source_size_images(config):
    """input.source_size: the training batches' images (the abstract batch's too) are the larger source canvas."""
    from detector.training import steps

    source_size = (NET[0] + 16, NET[1] + 8)
    overrides = {"input.resize_on_device": True, "input.source_size": source_size}
    larger = config.copy_and_resolve_references()
    larger.update_from_flattened_dict(overrides)
    assert batch_layout.training_image_size(larger.input) == source_size
    assert batch_layout.training_image_size(config.input) == NET
    batch = next(input_pipeline.create_train_iterator(larger))
    abstract = steps.abstract_batch(larger, int(larger.global_batch_size), None, training=True)
    assert _layout(batch) == {k: (v.shape, v.dtype) for k, v in abstract.items()}
    assert batch["image"].shape[1:3] == source_size
    assert steps.abstract_batch(larger, 4, None)["image"].shape == (4, *NET, 3)  # eval and predict batches


def test_empty_example_is_masked_and_matches_the_pipeline_fallback():
    empty = batch_layout.empty_example(NET, MAX_BOXES)
    assert _layout(empty) == batch_layout.example_spec(NET, MAX_BOXES)
    assert not empty["example_mask"] and not empty["boxes_mask"].any()
    assert empty["image_id"] == -1 and (empty["labels"] == -1).all() and empty["scale"] == 1.0
    assert not empty["image"].any() and not empty["boxes"].any() and not empty["original_size"].any()
    # What the tf.data graph puts in an undecodable image's slot is the same example, as tensors.
    fallback = pipeline._masked_example(NET, MAX_BOXES, decode_failed=tf.constant(True))
    assert set(fallback) == {*batch_layout.KEYS, *pipeline.REPORT_KEYS}
    for key in batch_layout.KEYS:
        value = fallback[key].numpy()
        assert value.dtype == empty[key].dtype, key
        np.testing.assert_array_equal(value, empty[key], err_msg=key)
    assert fallback["decode_failed"].numpy() and not fallback["boxes_truncated"].numpy()


def test_benchmark_random_batch_follows_the_layout():
    from benchmarks.synthetic import random_batch

    cfg = make_config("unused", global_batch_size=4)
    batch = random_batch(cfg, num_classes=3)
    assert list(batch) == list(batch_layout.KEYS)
    assert _layout(batch) == batch_layout.batch_spec(4, NET, MAX_BOXES)


def test_layout_and_box_geometry_import_without_tensorflow_or_jax():
    # benchmarks' PyTorch worker and detector.ops rely on it (see input_pipeline/__init__.py).
    code = (
        "import sys; import input_pipeline.batch, input_pipeline.box_geometry, benchmarks.synthetic; "
        "print(sorted(m for m in ('tensorflow', 'jax', 'flax') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
