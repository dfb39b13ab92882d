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
from detector.ops import deformable_attention, mask_losses, matching
from detector.training import optim, steps
from detector.training.run import create_run
from detector.training.train_state import TrainState, describe_param_shardings, select_params, state_shardings
from sharding.collectives import parse_collectives, summarize
from sharding.memory import memory_report

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


def equivalence_config(config):
    """`config` set up for comparing runs: 3 SGD steps at lr 0.05, the head's levels packed (a copy).

    SGD: Adam's first updates are +-lr whatever the gradient's size, which
    would turn rounding-level gradient differences into lr-sized ones. Both
    runs pack the head's levels, as training on a data-parallel mesh does
    ("auto"), so they differ only in how the work is split.
    """
    config = config.copy_and_resolve_references()
    config.optimizer.name = "sgd"
    config.optimizer.learning_rate = 0.05
    config.optimizer.warmup_steps = 0
    config.total_steps = 3
    config.model.head_level_packing = "always"
    return config


def initial_params(config, num_classes: int = NUM_CLASSES) -> dict:
    """The model's parameters from seed 0, as host numpy arrays (nested)."""
    model = families.create_model(config, num_classes)
    init = jax.jit(lambda rng: model.init(rng, jnp.zeros((1, *config.input.image_size, 3))))
    return jax.device_get(flax.linen.meta.unbox(init(jax.random.key(0))["params"]))


def train_on_mesh(config, mesh_shape, initial_params, batches, num_classes: int) -> types.SimpleNamespace:
    """Runs the AOT-compiled, state-donating train step from `initial_params` over `batches`.

    Returns metrics (one dict per step), params (flat {'a/b/kernel': array}),
    ema_params (flat, or None when the config keeps no EMA), param_specs
    (flat {'a/b/kernel': 'PartitionSpec(...)'}), collectives (the compiled
    step's {kind: executions per step}) and memory (its per-device
    `sharding.memory.MemoryReport`).
    """
    devices = jax.devices()[: math.prod(mesh_shape)]
    mesh = sharding.create_mesh(dict(zip(sharding.MESH_AXES, mesh_shape)), devices=devices)
    run = create_run(config, num_classes, mesh, training=True)
    with sharding.use_mesh(mesh, run.rules):
        compiled, _, shardings = steps.compile_train_step(run)
        # From host copies: the step donates its state, so every run needs its own buffers.
        params = jax.device_put(jax.device_get(initial_params), shardings.params)
        trained = select_params(params, run.trainable)
        state = TrainState(
            step=jax.device_put(np.int32(0), shardings.step),
            params=params,
            opt_state=jax.jit(run.tx.init, out_shardings=shardings.opt_state)(trained),
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
        metrics=metrics,
        params=params,
        ema_params=ema_params,
        param_specs=param_specs,
        collectives=executions,
        memory=memory_report(compiled),
    )


# What float rounding alone does to 3 SGD steps of the tiny models once
# their discontinuities are taken out (`continuous_dino`), with a margin. A
# sharding bug (a gradient reduced over part of the batch, the wrong shard
# of a parameter used) moves these quantities by tens of percents.
# Losses: a 2x2x2 mesh against one device differs by at most 3.8e-6
# relative (2-core AMD EPYC). Gradient norms carry the gradients' own noise,
# which backpropagation through DINO's set losses and deformable attention
# makes larger: up to 7.5e-5 relative for the tiny DINO when the summation
# order changes in ways no sharding is involved in (one device under other
# XLA:CPU flags; python -m tests.helpers.equivalence_margin tabulates it).
# Updates: at most 5e-3 relative. The worst of these under every
# perturbation measured (other meshes, micro-batches, other XLA:CPU kernels
# and vectorisation) uses a fifth of its floor or less for each tested model but
# Mask DINO (the worst: 0.19, the tiny DINO's step-2 gradient norm on a 4-device
# data mesh). Mask DINO's stem-conv update uses 0.71 of its floor under three of
# them: a reordered sum can flip which pool point is among a mask's most
# uncertain (a top-k near a tie), and the point's finite change of the gradient
# reaches the stride-4 features and the stem, whose updates are small.
# (A yardstick run, the same batch split over 'data' alone, once widened
# these floors by its own deviation: data parallelism reorders batch sums
# only and moved them 10-1000x less than the floors, so it widened nothing
# and cost a compile per test.)
METRIC_RTOL = 1e-4
GRAD_NORM_RTOL = 1e-3
UPDATE_RTOL = 1e-2
# A parameter's update is read as new - initial, both float32: each of the
# steps rounds it to the parameter's own spacing (6e-8 for a norm's scale of 1).
UPDATE_ULPS = 4.0
# Parameters whose exact gradient is 0 (an attention key's bias: softmax
# ignores a shift shared by all keys) update by pure rounding; their error is
# measured against the median parameter's update size instead of their own.
UPDATE_ATOL_OF_MEDIAN = 1e-4


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


def training_margins(
    reference: types.SimpleNamespace,
    candidate: types.SimpleNamespace,
    initial_params: dict[str, np.ndarray],
) -> dict[str, tuple[float, float]]:
    """{quantity: (how far `candidate` ran from `reference`, how far it may)} for every loss, gradient norm
    and parameter update."""
    deviation = training_deviation(reference, candidate, initial_params)
    updates = _updates(reference, initial_params)
    median_update_rms = float(np.median([np.sqrt(np.mean(u**2)) for u in updates.values()]))
    margins = {}
    for step, expected in enumerate(reference.metrics, start=1):
        for key in ("loss", "cls_loss", "box_loss", "grad_norm"):
            name = f"step {step} {key}"
            rtol = GRAD_NORM_RTOL if key == "grad_norm" else METRIC_RTOL
            allowed = rtol * abs(float(expected[key]))
            margins[name] = (deviation[name], allowed)
    for name, update in updates.items():
        scale = UPDATE_RTOL * float(np.linalg.norm(update))
        floor = UPDATE_ATOL_OF_MEDIAN * median_update_rms * np.sqrt(update.size)
        rounding = UPDATE_ULPS * float(np.linalg.norm(np.spacing(np.abs(reference.params[name]).astype(np.float32))))
        margins[name] = (deviation[name], max(scale, floor) + rounding)
    return margins


def assert_same_training(
    reference: types.SimpleNamespace,
    candidate: types.SimpleNamespace,
    initial_params: dict[str, np.ndarray],
) -> None:
    """Two `train_on_mesh` results agree: losses, gradient norms and each parameter's update.

    `initial_params` is flat like the results' params. Updates are compared
    against their own size (a wrong gradient hides under a parameter's
    magnitude, not there).
    """
    if len(candidate.metrics) != len(reference.metrics):
        raise AssertionError(f"{len(candidate.metrics)} steps against the reference's {len(reference.metrics)}")
    failures = []
    for name, (deviation, allowed) in training_margins(reference, candidate, initial_params).items():
        if deviation <= allowed:  # a NaN fails
            continue
        if name.startswith("step "):
            step, key = int(name.split()[1]), name.split()[2]
            failures.append(f"{name}: {candidate.metrics[step - 1][key]} against {reference.metrics[step - 1][key]}")
        else:
            update_norm = float(np.linalg.norm(np.asarray(reference.params[name], np.float64) - initial_params[name]))
            failures.append(
                f"{name}: update off by {deviation:.3g} (allowed {allowed:.3g}; update norm {update_norm:.3g})"
            )
    assert not failures, f"{len(failures)} quantities differ:\n" + "\n".join(failures[:20])


def _smoothstep_sampling(bilinear_corners):
    """`deformable_attention._bilinear_corners` with each coordinate's fraction within its pixel cell passed
    through smoothstep (3f^2 - 2f^3) first: the same cells, corners and values at pixel centres, but a sampled
    value whose derivative in the location is continuous (0 on every cell edge) instead of jumping there."""

    def smoothed(normalised, size):
        pixel = normalised * size - 0.5
        cell = jax.lax.stop_gradient(jnp.floor(pixel))
        fraction = pixel - cell
        return (cell + fraction * fraction * (3.0 - 2.0 * fraction) + 0.5) / size

    def corners(x_normalised, y_normalised, attention, height, width, start):
        return bilinear_corners(
            smoothed(x_normalised, width), smoothed(y_normalised, height), attention, height, width, start
        )

    return corners


@contextlib.contextmanager
def continuous_dino(*, smooth_sampling: bool = True):
    """DINO with its discontinuities taken out while tracing: what equality tests of its training need.

    Two runs that sum in another order (another mesh, micro-batches) differ by
    rounding; a test of sharding bounds that difference. Three places in DINO
    turn a rounding-level difference into a finite one, and are replaced:

    - The top-k proposal selection, the Hungarian matching and Mask DINO's
      choice of each mask's most uncertain points are exact functions of
      scores, costs and logits that rounding can reorder on a near-tie.
      Here the first `count` valid proposals are selected, and gt slot g is
      matched to query g (when the slot holds a box), and each mask takes its
      pool's first candidates: fixed by position. The
      matcher's and the selection's own sharding are tested on their own.
    - Bilinear sampling's derivative in a sampling location jumps where the
      location crosses a pixel edge, so a rounding-level move of one location
      changes its gradient (the sampling offsets', and from the second step on
      everything they feed) by a finite amount: on one CPU a 2x2x2 mesh moved
      the offsets' update by 1.3e-2 and a later gradient norm by 1.8e-4 relative,
      more than rounding does anywhere else. Which cell a point reads cannot be
      held fixed between two runs, so the weights within the cell are smoothed
      (`_smoothstep_sampling`): the derivative is continuous, and the sampling
      still gathers, weights and scatters the same rows through the same
      sharded code. (`smooth_sampling=False` leaves it as it is, to measure
      what smoothing buys: tests/helpers/equivalence_margin.py.)
    """
    real_select, real_match = dino.select_proposals, matching.match_batch
    real_corners = deformable_attention._bilinear_corners
    real_uncertain = mask_losses.uncertain_points

    def first_candidates(pool_logits, num_points, oversample_ratio=3.0, importance_sample_ratio=0.75):
        candidates, importance, fresh = mask_losses.point_pool_sizes(
            num_points, oversample_ratio, importance_sample_ratio
        )
        chosen = jnp.concatenate([jnp.arange(importance), jnp.arange(candidates, candidates + fresh)]).astype(jnp.int32)
        return jnp.broadcast_to(chosen, (*pool_logits.shape[:-1], num_points))

    def first_valid_proposals(scores, count, *distinct):
        rank = jnp.where(jnp.isfinite(scores), -jnp.arange(scores.shape[-1], dtype=jnp.float32), -jnp.inf)
        return jax.lax.top_k(rank, count)[1]

    def diagonal_matching(pred_logits, pred_boxes, gt_labels, gt_boxes, gt_mask, **cost_kwargs):
        num_queries, num_slots = pred_logits.shape[1], gt_mask.shape[1]
        query_for_gt = jnp.where(gt_mask, jnp.arange(num_slots, dtype=jnp.int32), -1)
        gt_for_query = jnp.pad(query_for_gt, ((0, 0), (0, num_queries - num_slots)), constant_values=-1)
        return query_for_gt, gt_for_query

    dino.select_proposals, matching.match_batch = first_valid_proposals, diagonal_matching
    mask_losses.uncertain_points = first_candidates
    if smooth_sampling:
        deformable_attention._bilinear_corners = _smoothstep_sampling(real_corners)
    try:
        yield
    finally:
        dino.select_proposals, matching.match_batch = real_select, real_match
        deformable_attention._bilinear_corners = real_corners
        mask_losses.uncertain_points = real_uncertain


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
    masks = {}
    if config.input.mask_stride:  # each box's inscribed ellipse at the mask cells; the first image's first box has none
        stride = config.input.mask_stride
        rows = (np.arange(-(-h // stride)) + 0.5) * stride
        columns = (np.arange(-(-w // stride)) + 0.5) * stride
        centre, half = (boxes[..., :2] + boxes[..., 2:]) / 2, (boxes[..., 2:] - boxes[..., :2]) / 2
        inside = ((rows[:, None] - centre[..., 0, None, None]) / half[..., 0, None, None]) ** 2 + (
            (columns[None, :] - centre[..., 1, None, None]) / half[..., 1, None, None]
        ) ** 2 < 1
        valid = boxes_mask.copy()
        valid[0, 0] = False
        masks = {"masks": np.packbits(inside & valid[..., None, None], axis=-1), "masks_valid": valid}
    return {
        **masks,
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
