"""The jitted train and predict steps as pure functions of (state, batch).

Both are plain functions closed over config-time constants (the family's
objective, the optimizer); the trainer compiles them ahead of time with
explicit shardings.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import NamedSharding, PartitionSpec

import sharding
from detector.errors import ConfigError
from detector.training.run import Run
from detector.training.train_state import TrainState, merge_params, select_params, state_shardings
from input_pipeline import batch as batch_layout


def split_micro_batches(batch: dict[str, jax.Array], count: int, micro_batch_sharding=None) -> dict[str, jax.Array]:
    """`[B, ...]` -> `[count, B / count, ...]`: micro-batch k holds rows k, k + count, k + 2 count, ...

    Interleaved rather than contiguous so that, with the batch split over
    devices in contiguous blocks, every micro-batch keeps an equal share on
    every device and splitting moves no data (`micro_batch_sharding`:
    P(None, batch axes)).
    """

    def split(x):
        x = jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)
        return x if micro_batch_sharding is None else jax.lax.with_sharding_constraint(x, micro_batch_sharding)

    return jax.tree.map(split, batch)


def ema_update(ema_params, params, step: jax.Array, *, decay: float, warmup: bool):
    """One update of the parameters' exponential moving average, in float32.

    With `warmup` the decay at update `step` is min(decay, (1 + step) / (10 + step)):
    the average follows the parameters closely at first and forgets its
    random start (TF's ExponentialMovingAverage with num_updates).
    """
    rate = jnp.asarray(decay, jnp.float32)
    if warmup:
        t = step.astype(jnp.float32)
        rate = jnp.minimum(rate, (1.0 + t) / (10.0 + t))
    return jax.tree.map(lambda e, p: (e - (1.0 - rate) * (e - p.astype(e.dtype))).astype(e.dtype), ema_params, params)


def train_step(
    state: TrainState,
    batch: dict[str, jax.Array],
    *,
    loss: Callable[..., tuple[jax.Array, dict[str, jax.Array]]],
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    seed: int = 0,
    trainable: Callable[[tuple[str, ...]], bool] | None = None,
    frozen: Callable[[Any], Any] | None = None,
    accumulate_steps: int = 1,
    micro_batch_sharding: Any = None,
    ema_decay: float = 0.0,
    ema_warmup: bool = True,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on a global batch. Returns (new_state, scalar metrics).

    `loss` is the family's (`families.Objective.loss`); its random draws
    (DINO's denoising noise) come from a key of `seed` and the step number,
    which every micro-batch shares (the DINO objective draws per image, from
    the image id), so a resumed, re-sharded or accumulated run draws the same.

    `trainable` (`optim.trainable_parameters`: param path -> bool; None: all)
    splits the parameters statically: only the trainable ones are
    differentiated, updated and averaged (`gradients`); the state's
    optimizer state and EMA hold them alone. `frozen`
    (`optim.frozen_parameters`: params -> tree of bools) names trainable
    parameters the optimizer keeps fixed; their gradients are not computed.
    With `accumulate_steps` K > 1 the batch goes through the network as K
    micro-batches in a `lax.scan` (activations of one micro-batch at a time),
    their loss sums and gradients are added, and the totals are divided by
    the whole batch's positive count: the same update as one pass over the
    batch. With `ema_decay` > 0 the state's EMA follows the new parameters.
    When the loss or the gradient is not finite, parameters, optimizer state
    and EMA are returned unchanged and metrics['nonfinite'] is 1.
    """
    step_rng = jax.random.fold_in(jax.random.key(seed), state.step)
    trained = select_params(state.params, trainable)
    total, terms, grads = gradients(
        state.params,
        batch,
        step_rng,
        loss=loss,
        trainable=trainable,
        frozen=frozen,
        accumulate_steps=accumulate_steps,
        micro_batch_sharding=micro_batch_sharding,
    )
    grad_norm = optax.tree.norm(grads)
    updates, new_opt_state = tx.update(grads, state.opt_state, trained)
    new_trained = optax.apply_updates(trained, updates)
    # A non-finite loss or gradient (a bad batch, an overflow) must not reach
    # the parameters: the update is skipped on device, without a host sync.
    # The step counter still advances, since the batch was consumed and the
    # input position and schedule follow the step.
    finite = jnp.isfinite(total) & jnp.isfinite(grad_norm)

    def keep_if_finite(new, old):
        return jnp.where(finite, new, old)

    new_trained = jax.tree.map(keep_if_finite, new_trained, trained)
    opt_state = jax.tree.map(keep_if_finite, new_opt_state, state.opt_state)
    ema_params = state.ema_params
    if ema_decay > 0:
        # `new_trained` already fell back to the old ones on a skipped step, but
        # the average must not take a step either.
        new_ema = ema_update(state.ema_params, new_trained, state.step, decay=ema_decay, warmup=ema_warmup)
        ema_params = jax.tree.map(keep_if_finite, new_ema, state.ema_params)
    metrics = {
        **{key: value.astype(jnp.float32) for key, value in terms.items()},
        "loss": total,
        "grad_norm": grad_norm,
        "learning_rate": schedule(state.step),
        "nonfinite": jnp.logical_not(finite).astype(jnp.float32),
    }
    # The parameters that do not train pass through untouched (a donated
    # state aliases their buffers: no copy).
    params = new_trained if trainable is None else merge_params(state.params, new_trained)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, ema_params=ema_params)
    return new_state, metrics


def gradients(
    params: Any,
    batch: dict[str, jax.Array],
    rng: jax.Array,
    *,
    loss: Callable[..., tuple[jax.Array, dict[str, jax.Array]]],
    trainable: Callable[[tuple[str, ...]], bool] | None = None,
    frozen: Callable[[Any], Any] | None = None,
    accumulate_steps: int = 1,
    micro_batch_sharding: Any = None,
) -> tuple[jax.Array, dict[str, jax.Array], Any]:
    """(loss, loss terms, gradient) of `loss` at `params` on a global batch; see `train_step` for the arguments.

    The gradient is a nested dict over `select_params(params, trainable)`
    alone: the other parameters enter the loss as constants
    (`stop_gradient`), so no backward pass runs through them and none of
    their activations is kept for one. A frozen backbone costs its forward
    pass only, and the step reduces no gradient of it across devices.
    """
    fixed = select_params(params, None if trainable is None else lambda path: not trainable(path))

    def loss_of_trainable(trained, batch, rng, normalizer=None):
        full = trained if trainable is None else merge_params(jax.lax.stop_gradient(fixed), trained)
        if frozen is not None:
            # The optimizer ignores these gradients anyway; stopping them here
            # also drops their backward pass (kernel gradients, and the input
            # gradients below the lowest trainable layer) from the program.
            full = jax.tree.map(lambda p, fixed: jax.lax.stop_gradient(p) if fixed else p, full, frozen(full))
        return loss(full, batch, rng, normalizer)

    trained = select_params(params, trainable)
    grad_fn = jax.value_and_grad(loss_of_trainable, has_aux=True)
    if accumulate_steps == 1:
        (total, terms), grads = grad_fn(trained, batch, rng)
        return total, terms, grads

    def add_micro_batch(totals, micro_batch):
        (loss_sum, sums), grads = grad_fn(trained, micro_batch, rng, 1.0)
        return jax.tree.map(jnp.add, totals, (grads, {"loss": loss_sum, **sums})), None

    micro_batches = split_micro_batches(batch, accumulate_steps, micro_batch_sharding)
    first = jax.tree.map(lambda x: x[0], micro_batches)
    term_shapes = jax.eval_shape(lambda: grad_fn(trained, first, rng, 1.0)[0][1])
    zeros = (
        jax.tree.map(jnp.zeros_like, trained),
        {key: jnp.zeros((), jnp.float32) for key in ("loss", *term_shapes)},
    )
    (grad_sums, sums), _ = jax.lax.scan(add_micro_batch, zeros, micro_batches)
    normalizer = jnp.maximum(sums["num_positives"], 1.0)
    grads = jax.tree.map(lambda g: g / normalizer, grad_sums)
    total = sums["loss"] / normalizer
    terms = {key: value / normalizer for key, value in sums.items() if key not in ("loss", "num_positives")}
    terms["num_positives"] = sums["num_positives"]
    return total, terms, grads


def predict_step(
    params, batch: dict[str, jax.Array], *, detect: Callable[[Any, jax.Array, jax.Array], dict[str, jax.Array]]
) -> dict[str, Any]:
    """Detections in network-input pixels plus the batch fields needed to map them back.

    `detect` is the family's (`families.Objective.detect`). Returns dict:
    boxes `[B, D, 4]` yxyx, scores `[B, D]`, classes int32 `[B, D]`, valid
    bool `[B, D]` (and a mask family's masks `[B, D, H/4, W/4]`), and
    image_id / image_hw / scale / original_size / example_mask passed through.
    """
    return {
        **detect(params, batch["image"], batch["image_hw"]),
        "image_id": batch["image_id"],
        "image_hw": batch["image_hw"],
        "scale": batch["scale"],
        "original_size": batch["original_size"],
        "example_mask": batch["example_mask"],
    }


def abstract_batch(
    config: ml_collections.ConfigDict,
    global_batch_size: int,
    batch_sharding: jax.sharding.NamedSharding,
    *,
    training: bool = False,
) -> dict[str, jax.ShapeDtypeStruct]:
    """One global batch of `config` as ShapeDtypeStructs carrying `batch_sharding` (see input_pipeline.batch).

    `training`: a training batch, whose images may be larger source canvases (`input.source_size`) and which
    carries the boxes' masks when `input.mask_stride` asks for them.
    """
    if training:
        image_size, mask_grid_hw = (
            batch_layout.training_image_size(config.input),
            batch_layout.training_mask_grid(config.input),
        )
    else:
        image_size, mask_grid_hw = config.input.image_size, None
    return batch_layout.abstract_batch(
        global_batch_size, image_size, config.input.max_boxes, sharding=batch_sharding, mask_grid_hw=mask_grid_hw
    )


def ema_decay_of(optimizer_config) -> float:
    """`optimizer.ema_decay`, checked: 0 (off) or in (0, 1)."""
    decay = float(optimizer_config.ema_decay)
    if not 0.0 <= decay < 1.0:
        raise ConfigError(f"optimizer.ema_decay={decay}; use 0 (off) or a decay in (0, 1), e.g. 0.9998")
    return decay


def check_accumulate_steps(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> int:
    """`optimizer.accumulate_steps`, checked: each micro-batch must split evenly over the batch shards."""
    steps = config.optimizer.accumulate_steps
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"optimizer.accumulate_steps={steps!r}; use a whole number >= 1")
    shards = math.prod(mesh.shape[axis] for axis in sharding.batch_axes(mesh))
    if config.global_batch_size % (steps * shards):
        raise ConfigError(
            f"optimizer.accumulate_steps={steps}: global_batch_size={config.global_batch_size} must be a multiple "
            f"of accumulate_steps x batch shards (data x fsdp = {shards}) = {steps * shards}, so every "
            "micro-batch splits evenly over the devices; change one of the three"
        )
    return steps


def compile_train_step(run: Run) -> tuple[Any, TrainState, TrainState]:
    """Compiles `train_step` of a training `run` ahead of time with explicit shardings and a donated state.

    Must run inside `sharding.use_mesh(run.mesh, run.rules)`.
    Returns (compiled step `(state, global_batch) -> (state, metrics)`,
    abstract state carrying its shardings, state shardings).
    """
    config, mesh = run.config, run.mesh
    ema_decay = ema_decay_of(config.optimizer)
    abstract_state, shardings = state_shardings(
        run.model, run.tx, run.image_size, mesh, run.rules, ema=ema_decay > 0, trainable=run.trainable
    )
    batch_axes = sharding.batch_axes(mesh)
    batch_sharding = sharding.batch_sharding(mesh, batch_axes)
    accumulate_steps = check_accumulate_steps(config, mesh)
    train_fn = jax.jit(
        functools.partial(
            train_step,
            loss=run.objective.loss,
            tx=run.tx,
            schedule=run.schedule,
            seed=config.seed,
            trainable=run.trainable,
            frozen=run.frozen,
            accumulate_steps=accumulate_steps,
            micro_batch_sharding=NamedSharding(mesh, PartitionSpec(None, batch_axes)),
            ema_decay=ema_decay,
            ema_warmup=bool(config.optimizer.ema_warmup),
        ),
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, sharding.replicated(mesh)),
        donate_argnums=0,
    )
    compiled = train_fn.lower(
        abstract_state, abstract_batch(config, config.global_batch_size, batch_sharding, training=True)
    ).compile()
    release_freed_heap()
    return compiled, abstract_state, shardings


def release_freed_heap() -> None:
    """Returns the heap that the process has freed to the OS (glibc's `malloc_trim`; a no-op elsewhere).

    Compiling a large step leaves the compiler's freed working memory in the
    process's heap, resident under the step's own buffers for the whole run:
    DINO-R50 at 512 px, batch 2, on a CPU: 3.0 GB resident after compiling,
    1.9 GB after this, so the run's peak is 1.1 GB lower.
    """
    libc_name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_name) if libc_name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def compile_predict_step(run: Run, *, abstract_params: Any, param_shardings: Any, batch_size: int) -> Any:
    """Compiles `predict_step` of `run` for global batches of `batch_size`, sharded like training.

    Must run inside `sharding.use_mesh(run.mesh, run.rules)`.
    Returns the compiled `(params, global_batch) -> outputs` (see `predict_step`).
    """
    config, batch_sharding = run.config, run.batch_sharding
    predict_fn = jax.jit(
        functools.partial(predict_step, detect=run.objective.detect),
        in_shardings=(param_shardings, batch_sharding),
        out_shardings=batch_sharding,
    )
    compiled = predict_fn.lower(abstract_params, abstract_batch(config, batch_size, batch_sharding)).compile()
    release_freed_heap()
    return compiled
