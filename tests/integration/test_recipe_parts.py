"""Gradient accumulation and the EMA of the parameters, end to end on the default model.

Accumulation must give the update of one pass over the whole global batch (on
a (2, 2, 2) mesh; DINO's, whose micro-batches also split its denoising and
global box count: tests/integration/test_sharded_equivalence.py) while holding
one micro-batch's activations; the EMA must be what evaluation, the best
checkpoint, the predictor and the exported artifact use.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import input_pipeline
import sharding
from detector.loop import trainer
from detector.models import families
from detector.serving import artifact
from detector.serving.predictor import load_predictor
from detector.training import checkpointing
from tests.helpers.runs import flat
from tests.helpers.sharded_training import (
    NUM_CLASSES,
    abstract_state_on_mesh,
    assert_same_training,
    train_on_mesh,
)
from tests.helpers.tiny_config import make_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compilation_cache_dir")]

ACCUMULATION = {
    "global_batch_size": 16,
    # SGD: Adam's first updates are +-lr whatever a gradient's size, which turns
    # rounding-level differences of the summation order into lr-sized ones.
    "optimizer.name": "sgd",
    "optimizer.learning_rate": 0.05,
    "optimizer.warmup_steps": 0,
}


def initial_params(config):
    model = families.create_model(config, NUM_CLASSES)
    images = jnp.zeros((1, *config.input.image_size, 3))
    return jax.device_get(flax.linen.meta.unbox(jax.jit(lambda r: model.init(r, images))(jax.random.key(0))["params"]))


def test_four_micro_batches_give_the_update_of_one_pass_holding_one_micro_batchs_activations(data_dir):
    # On a sharded mesh: the accumulation's sums and the data/fsdp/model reductions together.
    mesh_shape = (2, 2, 2)
    one_pass = make_config(data_dir, **ACCUMULATION)
    accumulated = make_config(data_dir, **ACCUMULATION, **{"optimizer.accumulate_steps": 4})
    train_iter = input_pipeline.create_train_iterator(one_pass)
    batches = [next(train_iter) for _ in range(2)]  # real batches: their positive counts differ per micro-batch
    initial = initial_params(one_pass)
    reference = train_on_mesh(one_pass, mesh_shape, initial, batches, NUM_CLASSES)
    result = train_on_mesh(accumulated, mesh_shape, initial, batches, NUM_CLASSES)
    for step_metrics in (reference.metrics, result.metrics):
        assert [m["num_positives"] for m in step_metrics] == [m["num_positives"] for m in reference.metrics]
    assert_same_training(reference, result, flax.traverse_util.flatten_dict(initial, sep="/"))
    # The compiled step's temporaries (what the trainer's memory report reads): a quarter of the batch's
    # activations at a time, plus what does not scale with the batch. 0.74 of one pass's under the
    # collective-ordering schedule the suite runs with (tests/helpers), under 0.6 under XLA:CPU's
    # concurrency-optimised one; one pass over all micro-batches at once would be 1.
    assert result.memory.temp_bytes < 0.8 * reference.memory.temp_bytes, (result.memory, reference.memory)


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory, data_dir):
    """4 steps with an EMA (decay 0.5: far from the parameters after 4 steps), evaluated at step 4."""
    # Every detection kept (score_threshold 0): after 4 steps all scores are low.
    config = make_config(data_dir, **{"optimizer.ema_decay": 0.5, "postprocess.score_threshold": 0.0})
    workdir = tmp_path_factory.mktemp("ema_run")
    trainer.train_and_evaluate(config, str(workdir))
    return config, workdir


def test_the_ema_is_checkpointed_evaluated_and_exported(ema_run, tmp_path):
    config, workdir = ema_run
    manager = checkpointing.create_manager(str(workdir), max_to_keep=3, read_only=True)
    try:
        mesh = sharding.create_mesh(dict(data=1, fsdp=1, model=1), devices=jax.devices()[:1])
        state = jax.device_get(checkpointing.restore_latest(manager, abstract_state_on_mesh(config, mesh))[0])
    finally:
        manager.close()
    params, ema = flat(state.params), flat(state.ema_params)
    assert params.keys() == ema.keys()
    assert any(not np.allclose(ema[k], params[k]) for k in params)  # the average is not the parameters

    # The evaluation at step 4 scored the EMA: its parameters are the best checkpoint's.
    best_step, best = checkpointing.restore_best(str(workdir))
    assert best_step == 4
    for name, value in flat(best).items():
        np.testing.assert_array_equal(value, ema[name], err_msg=name)
    exported = flat(jax.device_get(_restore_export(workdir)))
    for name, value in exported.items():
        np.testing.assert_array_equal(value, ema[name], err_msg=name)

    # evaluate/predict/export read the EMA unless told otherwise.
    predictor = load_predictor(config, str(workdir), "last")
    raw = load_predictor(config, str(workdir), "last", raw_params=True)
    for name, value in flat(jax.device_get(predictor.params)).items():
        np.testing.assert_array_equal(value, ema[name], err_msg=name)
    for name, value in flat(jax.device_get(raw.params)).items():
        np.testing.assert_array_equal(value, params[name], err_msg=name)

    # The exported program computes with the EMA parameters: its scores are the EMA predictor's, not the raw one's.
    images = np.random.default_rng(0).integers(0, 256, size=(1, *config.input.image_size, 3), dtype=np.uint8)
    image_hw = np.array([config.input.image_size], np.int32)
    program = artifact.export_predictor(predictor, 1)
    exported_scores = np.asarray(program.call(images, image_hw)["scores"])
    expected = np.asarray(jax.jit(artifact.detection_function(predictor))(images, image_hw)["scores"])
    raw_scores = np.asarray(jax.jit(artifact.detection_function(raw))(images, image_hw)["scores"])
    np.testing.assert_allclose(exported_scores, expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(raw_scores, expected, rtol=1e-5, atol=1e-6)


def _restore_export(workdir):
    return ocp.StandardCheckpointer().restore(checkpointing.export_dir(str(workdir)) / checkpointing.PARAMS_ITEM)
