import jax.numpy as jnp
import numpy as np
import pytest

from configs import default, retinanet_r50_coco
from detector.errors import ConfigError
from detector.training import optim


def test_cosine_schedule_warms_up_then_decays_to_zero():
    config = default.get_config().optimizer
    schedule = optim.learning_rate_schedule(config, 1000)
    assert float(schedule(0)) == 0.0
    np.testing.assert_allclose(float(schedule(config.warmup_steps)), config.learning_rate, rtol=1e-6)
    assert float(schedule(500)) < config.learning_rate
    assert float(schedule(1000)) == pytest.approx(0.0, abs=1e-9)


def test_step_schedule_matches_detectron2_1x():
    config = retinanet_r50_coco.get_config().optimizer
    schedule = optim.learning_rate_schedule(config, 90_000)
    np.testing.assert_allclose(float(schedule(500)), 0.005, rtol=1e-5)
    np.testing.assert_allclose(float(schedule(30_000)), 0.01, rtol=1e-5)
    np.testing.assert_allclose(float(schedule(70_000)), 0.001, rtol=1e-5)
    np.testing.assert_allclose(float(schedule(85_000)), 0.0001, rtol=1e-5)


def test_weight_decay_skips_biases_and_norm_scales():
    config = default.get_config().optimizer
    config.grad_clip_norm = 0.0
    config.name = "sgd"
    config.learning_rate = 1.0
    config.momentum = 0.0
    config.weight_decay = 0.5
    config.warmup_steps = 0
    tx, _ = optim.create_optimizer(config, 10)
    params = {"kernel": jnp.ones((2, 2)), "bias": jnp.ones((2,))}
    zero_grads = {"kernel": jnp.zeros((2, 2)), "bias": jnp.zeros((2,))}
    updates, _ = tx.update(zero_grads, tx.init(params), params)
    np.testing.assert_allclose(updates["kernel"], -0.5 * np.ones((2, 2)))
    np.testing.assert_allclose(updates["bias"], np.zeros(2))


def test_unknown_optimizer_is_a_config_error():
    config = default.get_config().optimizer
    config.name = "adam2"
    with pytest.raises(ConfigError, match="optimizer.name='adam2'"):
        optim.create_optimizer(config, 10)
