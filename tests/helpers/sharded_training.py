"""Test helper: a few train steps on a chosen mesh, exactly as the trainer runs them."""

from __future__ import annotations

import math
import types

import flax
import jax
import numpy as np

import input_pipeline
import sharding
from configs import default
from detector.models import families
from detector.training import optim, steps
from detector.training.train_state import TrainState, describe_param_shardings, state_shardings

NUM_CLASSES = 4  # synthetic_shapes


def abstract_state_on_mesh(config, mesh) -> TrainState:
    """The trainer's train state for `config` as ShapeDtypeStructs carrying `mesh`'s shardings (restore target)."""
    rules = sharding.logical_rules(config.sharding)
    info = input_pipeline.get_dataset_info(config)
    model = families.create_model(config, info.num_classes)
    tx, _ = optim.create_optimizer(config.optimizer, config.total_steps, model_config=config.model)
    with sharding.use_mesh(mesh, rules):
        abstract_state, _ = state_shardings(
            model, tx, tuple(config.input.image_size), mesh, rules, ema=steps.ema_decay_of(config.optimizer) > 0
        )
    return abstract_state


def train_on_mesh(config, mesh_shape, initial_params, batches, num_classes: int) -> types.SimpleNamespace:
    """Runs the AOT-compiled, state-donating train step from `initial_params` over `batches`.

    Returns metrics (one dict per step), params (flat {'a/b/kernel': array}),
    ema_params (flat, or None when the config keeps no EMA) and param_specs
    (flat {'a/b/kernel': 'PartitionSpec(...)'}).
    """
    devices = jax.devices()[: math.prod(mesh_shape)]
    mesh = sharding.create_mesh(dict(zip(sharding.MESH_AXES, mesh_shape)), devices=devices)
    rules = sharding.logical_rules(config.sharding)
    model = families.create_model(config, num_classes)
    tx, schedule = optim.create_optimizer(config.optimizer, config.total_steps, model_config=config.model)
    with sharding.use_mesh(mesh, rules):
        compiled, _, shardings = steps.compile_train_step(
            config, model, tx, schedule, num_classes=num_classes, mesh=mesh, rules=rules
        )
        # From host copies: the step donates its state, so every run needs its own buffers.
        params = jax.device_put(jax.device_get(initial_params), shardings.params)
        state = TrainState(
            step=jax.device_put(np.int32(0), shardings.step),
            params=params,
            opt_state=jax.jit(tx.init, out_shardings=shardings.opt_state)(params),
            ema_params=None
            if shardings.ema_params is None
            else jax.device_put(jax.device_get(initial_params), shardings.ema_params),
        )
    param_specs = describe_param_shardings(state.params)
    metrics = []
    for batch in batches:
        state, step_metrics = compiled(state, input_pipeline.to_global_batch(batch, mesh, sharding.batch_axes(mesh)))
        metrics.append(jax.device_get(step_metrics))
    params = flax.traverse_util.flatten_dict(jax.device_get(state.params), sep="/")
    ema_params = None
    if state.ema_params is not None:
        ema_params = flax.traverse_util.flatten_dict(jax.device_get(state.ema_params), sep="/")
    return types.SimpleNamespace(metrics=metrics, params=params, ema_params=ema_params, param_specs=param_specs)


def assert_same_training(
    reference: types.SimpleNamespace, sharded: types.SimpleNamespace, initial_params: dict[str, np.ndarray]
) -> None:
    """Two `train_on_mesh` results agree: losses, gradient norms, parameters and each update.

    `initial_params` is flat like the results' params. Updates are compared
    against their own size: a wrong gradient hides under a parameter's
    magnitude, not there.
    """
    for step, (expected, actual) in enumerate(zip(reference.metrics, sharded.metrics), start=1):
        for key in ("loss", "cls_loss", "box_loss", "grad_norm"):
            np.testing.assert_allclose(actual[key], expected[key], rtol=1e-4, err_msg=f"step {step} {key}")
    for name, expected in reference.params.items():
        np.testing.assert_allclose(sharded.params[name], expected, rtol=1e-4, atol=1e-5, err_msg=name)
        expected_update = expected - initial_params[name]
        error = np.max(np.abs((sharded.params[name] - initial_params[name]) - expected_update))
        assert error <= 1e-3 * np.max(np.abs(expected_update)) + 1e-7, (name, error)


def spatial_config(image_size: int):
    """The default conv detector with image height split over `model`, one image per step."""
    config = default.get_config()
    config.sharding.spatial_partitioning = True
    config.input.image_size = (image_size, image_size)
    config.global_batch_size = 1
    return config
