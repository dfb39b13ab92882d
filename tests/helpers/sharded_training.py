"""Test helper: a few train steps on a chosen mesh, exactly as the trainer runs them."""

from __future__ import annotations

import contextlib
import math
import types

import flax
import jax
import jax.numpy as jnp
import numpy as np

import input_pipeline
import sharding
from configs import default
from detector.models import dino, families
from detector.ops import matching
from detector.training import optim, steps
from detector.training.train_state import TrainState, describe_param_shardings, select_params, state_shardings
from sharding.collectives import parse_collectives, summarize

NUM_CLASSES = 4  # synthetic_shapes


def abstract_state_on_mesh(config, mesh, num_classes: int | None = None) -> TrainState:
    """The trainer's train state for `config` as ShapeDtypeStructs carrying `mesh`'s shardings (restore target).

    `num_classes`: None reads it from the config's dataset.
    """
    rules = sharding.logical_rules(config.sharding)
    if num_classes is None:
        num_classes = input_pipeline.get_dataset_info(config).num_classes
    model = families.create_model(config, num_classes)
    tx, _ = optim.create_optimizer(config.optimizer, config.total_steps, model_config=config.model)
    with sharding.use_mesh(mesh, rules):
        abstract_state, _ = state_shardings(
            model,
            tx,
            tuple(config.input.image_size),
            mesh,
            rules,
            ema=steps.ema_decay_of(config.optimizer) > 0,
            trainable=optim.trainable_parameters(config.model),
        )
    return abstract_state


def train_on_mesh(config, mesh_shape, initial_params, batches, num_classes: int) -> types.SimpleNamespace:
    """Runs the AOT-compiled, state-donating train step from `initial_params` over `batches`.

    Returns metrics (one dict per step), params (flat {'a/b/kernel': array}),
    ema_params (flat, or None when the config keeps no EMA), param_specs
    (flat {'a/b/kernel': 'PartitionSpec(...)'}) and collectives (the compiled
    step's {kind: executions per step}).
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
        trained = select_params(params, optim.trainable_parameters(config.model))
        state = TrainState(
            step=jax.device_put(np.int32(0), shardings.step),
            params=params,
            opt_state=jax.jit(tx.init, out_shardings=shardings.opt_state)(trained),
            ema_params=None
            if shardings.ema_params is None
            else jax.device_put(jax.device_get(trained), shardings.ema_params),
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
    executions = {kind: summary.count for kind, summary in summarize(parse_collectives(compiled.as_text())).items()}
    return types.SimpleNamespace(
        metrics=metrics, params=params, ema_params=ema_params, param_specs=param_specs, collectives=executions
    )


# What float rounding alone does to 3 SGD steps of the tiny models once
# their discontinuous decisions are held fixed, with a margin: measured on a
# 2-core AMD EPYC, a 2x2x2 mesh against one device differs by at most 3.8e-6
# in a loss or gradient norm (DINO's: deformable sampling's gradient is
# piecewise) and 5e-3 in a parameter's update (sampling offsets aside,
# below), relative. Data parallelism alone moves both 10-1000x less (it
# reorders batch sums only, model parallelism every contraction), so the
# yardstick below cannot stand in for these floors. A sharding bug (a
# gradient reduced over part of the batch, the wrong shard of a parameter
# used) moves both by tens of percents.
METRIC_RTOL = 1e-4
UPDATE_RTOL = 1e-2
# Deformable attention's sampling offsets reach the loss through bilinear
# interpolation, whose derivative in a sampling location jumps where the
# location crosses a pixel edge: a rounding-level move of one location
# changes that point's gradient by a finite amount, not a rounding-level one.
# Measured the same on AMD and Intel CPUs: the tiny DINO's first encoder
# layer's offsets differ by 3.6e-3 (focal class loss) and 1.3e-2 (DEIM's
# matchability-aware loss) relative, where every other parameter stays under
# 5e-3; a sharding bug moves them by tens of percents.
PIECEWISE_UPDATE_RTOL = 5e-2
PIECEWISE_GRADIENT_PARAMETERS = ("sampling_offsets",)
# A parameter's update is read as new - initial, both float32: each of the
# steps rounds it to the parameter's own spacing (6e-8 for a norm's scale of 1).
UPDATE_ULPS = 4.0
# Parameters whose exact gradient is 0 (an attention key's bias: softmax
# ignores a shift shared by all keys) update by pure rounding; their error is
# measured against the median parameter's update size instead of their own.
UPDATE_ATOL_OF_MEDIAN = 1e-4
# How much further than the yardstick (the same batch split over 'data'
# alone) the compared run may deviate: on a CPU whose summation order is
# noisier than the one measured, the tolerance grows with it.
NOISE_FACTOR = 10.0


def _updates(run: types.SimpleNamespace, initial_params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: np.asarray(value, np.float64) - initial_params[name] for name, value in run.params.items()}


def training_deviation(
    reference: types.SimpleNamespace, other: types.SimpleNamespace, initial_params: dict[str, np.ndarray]
) -> dict[str, float]:
    """How far `other` ran from `reference`: {'step S KEY': |difference|, 'NAME': ||update difference||_2}."""
    deviation = {}
    for step, (expected, actual) in enumerate(zip(reference.metrics, other.metrics), start=1):
        for key in ("loss", "cls_loss", "box_loss", "grad_norm"):
            deviation[f"step {step} {key}"] = abs(float(actual[key]) - float(expected[key]))
    expected_updates, actual_updates = _updates(reference, initial_params), _updates(other, initial_params)
    for name, expected in expected_updates.items():
        deviation[name] = float(np.linalg.norm(actual_updates[name] - expected))
    return deviation


def assert_same_training(
    reference: types.SimpleNamespace,
    candidate: types.SimpleNamespace,
    initial_params: dict[str, np.ndarray],
    yardstick: types.SimpleNamespace | None = None,
) -> None:
    """Two `train_on_mesh` results agree: losses, gradient norms and each parameter's update.

    `initial_params` is flat like the results' params. Updates are compared
    against their own size (a wrong gradient hides under a parameter's
    magnitude, not there). `yardstick`, when given, is a run of the same
    steps that differs from `reference` by float summation order alone (the
    batch split over devices, nothing else): the candidate may deviate
    NOISE_FACTOR times as far as it does, so the tolerance follows the noise
    of the machine the test runs on, on top of floors that catch no bug.
    """
    if len(candidate.metrics) != len(reference.metrics):
        raise AssertionError(f"{len(candidate.metrics)} steps against the reference's {len(reference.metrics)}")
    noise = {}
    if yardstick is not None:
        # A bug of the data-parallel path would widen its own tolerance: the
        # yardstick must first pass the floors on its own.
        try:
            assert_same_training(reference, yardstick, initial_params)
        except AssertionError as error:
            raise AssertionError(f"the data-parallel yardstick itself differs from one device: {error}") from None
        noise = training_deviation(reference, yardstick, initial_params)
    deviation = training_deviation(reference, candidate, initial_params)
    updates = _updates(reference, initial_params)
    median_update_rms = float(np.median([np.sqrt(np.mean(u**2)) for u in updates.values()]))
    failures = []
    for step, expected in enumerate(reference.metrics, start=1):
        for key in ("loss", "cls_loss", "box_loss", "grad_norm"):
            name = f"step {step} {key}"
            allowed = METRIC_RTOL * abs(float(expected[key])) + NOISE_FACTOR * noise.get(name, 0.0)
            if not deviation[name] <= allowed:  # `not <=`: a NaN fails
                failures.append(f"{name}: {candidate.metrics[step - 1][key]} against {expected[key]}")
    for name, update in updates.items():
        rtol = PIECEWISE_UPDATE_RTOL if any(part in name for part in PIECEWISE_GRADIENT_PARAMETERS) else UPDATE_RTOL
        scale = rtol * float(np.linalg.norm(update))
        floor = UPDATE_ATOL_OF_MEDIAN * median_update_rms * np.sqrt(update.size)
        rounding = UPDATE_ULPS * float(np.linalg.norm(np.spacing(np.abs(reference.params[name]).astype(np.float32))))
        allowed = max(scale, floor) + rounding + NOISE_FACTOR * noise.get(name, 0.0)
        if not deviation[name] <= allowed:
            failures.append(
                f"{name}: update off by {deviation[name]:.3g} (allowed {allowed:.3g}; update norm "
                f"{np.linalg.norm(update):.3g}, yardstick's deviation {noise.get(name, 0.0):.3g})"
            )
    assert not failures, f"{len(failures)} quantities differ:\n" + "\n".join(failures[:20])


def data_parallel_shape(mesh_shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """The yardstick mesh for `mesh_shape`: the same batch split, all of it over 'data', no model parallelism."""
    data, fsdp, _ = mesh_shape
    return (data * fsdp, 1, 1)


@contextlib.contextmanager
def fixed_dino_decisions():
    """DINO's discontinuous choices held fixed while tracing: what equality tests of its training need.

    The top-k proposal selection and the Hungarian matching are exact
    functions of scores and costs that rounding can reorder on a near-tie, and
    one flipped choice changes the loss by far more than rounding does. Here
    the first `count` valid proposals are selected, and gt slot g is matched
    to query g (when the slot holds a box): fixed by position, so two runs
    that round differently still take the same decisions. The matcher's and
    the selection's own sharding are tested on their own.
    """
    real_select, real_match = dino.select_proposals, matching.match_batch

    def first_valid_proposals(scores, count, *distinct):
        rank = jnp.where(jnp.isfinite(scores), -jnp.arange(scores.shape[-1], dtype=jnp.float32), -jnp.inf)
        return jax.lax.top_k(rank, count)[1]

    def diagonal_matching(pred_logits, pred_boxes, gt_labels, gt_boxes, gt_mask, **cost_kwargs):
        num_queries, num_slots = pred_logits.shape[1], gt_mask.shape[1]
        query_for_gt = jnp.where(gt_mask, jnp.arange(num_slots, dtype=jnp.int32), -1)
        gt_for_query = jnp.pad(query_for_gt, ((0, 0), (0, num_queries - num_slots)), constant_values=-1)
        return query_for_gt, gt_for_query

    dino.select_proposals, matching.match_batch = first_valid_proposals, diagonal_matching
    try:
        yield
    finally:
        dino.select_proposals, matching.match_batch = real_select, real_match


def spatial_config(image_size: int):
    """The default conv detector with image height split over `model`, one image per step."""
    config = default.get_config()
    config.sharding.spatial_partitioning = True
    config.input.image_size = (image_size, image_size)
    config.global_batch_size = 1
    return config


def random_batch(config, seed: int) -> dict[str, np.ndarray]:
    """A global batch shaped like the pipeline's: a few random boxes per image."""
    rng = np.random.default_rng(seed)
    b, (h, w), m = config.global_batch_size, config.input.image_size, config.input.max_boxes
    corners = rng.uniform(0, h * 0.6, size=(b, m, 2))
    sizes = rng.uniform(h * 0.1, h * 0.4, size=(b, m, 2))
    boxes = np.concatenate([corners, corners + sizes], axis=-1).astype(np.float32)
    boxes_mask = np.arange(m)[None, :] < rng.integers(1, 4, size=(b, 1))
    image_hw = np.stack([rng.integers(h // 2, h + 1, size=b), np.full(b, w)], -1).astype(np.int32)
    return {
        "image": rng.integers(0, 256, size=(b, h, w, 3), dtype=np.uint8),
        "image_hw": image_hw,
        # Resized on the host: the identity geometry.
        "source_hw": image_hw,
        "source_to_image": np.tile(np.float32([1, 1, 0, 0]), (b, 1)),
        "source_flipped": np.zeros((b,), bool),
        "boxes": np.where(boxes_mask[..., None], boxes, 0).astype(np.float32),
        "labels": np.where(boxes_mask, rng.integers(0, NUM_CLASSES, size=(b, m)), -1).astype(np.int32),
        "boxes_mask": boxes_mask,
        "image_id": np.arange(b, dtype=np.int32),
        "scale": np.ones((b,), np.float32),
        "original_size": np.full((b, 2), h, np.int32),
        "example_mask": np.ones((b,), bool),
    }
