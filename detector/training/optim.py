"""Optimizer, learning-rate schedule and per-parameter learning-rate multipliers from `config.optimizer`."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from detector.errors import ConfigError
from detector.models import backbones


def learning_rate_schedule(optimizer_config, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `learning_rate`, then the configured decay.

    'cosine': cosine decay to 0 at `total_steps`. 'step': x0.1 at each step in
    `decay_boundaries` (detectron2's multi-step schedule).
    """
    warmup = min(int(optimizer_config.warmup_steps), max(total_steps - 1, 0))
    peak = optimizer_config.learning_rate
    if optimizer_config.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=peak,
            warmup_steps=warmup,
            decay_steps=max(total_steps, warmup + 1),
            end_value=0.0,
        )
    if optimizer_config.schedule == "step":
        boundaries = sorted(int(b) for b in optimizer_config.decay_boundaries)
        if any(b <= warmup for b in boundaries):
            raise ConfigError(
                f"optimizer.decay_boundaries={tuple(boundaries)} must all come after optimizer.warmup_steps={warmup}"
            )
        decay = optax.piecewise_constant_schedule(peak, {b - warmup: 0.1 for b in boundaries})
        return optax.join_schedules([optax.linear_schedule(0.0, peak, max(warmup, 1)), decay], [warmup])
    raise ConfigError(f"optimizer.schedule={optimizer_config.schedule!r} is not known; use 'cosine' or 'step'")


def _decay_mask(params):
    # Weight decay on kernels only: decaying biases and norm scales hurts
    # detection accuracy (detectron2 and torchvision exclude them too).
    return jax.tree.map(lambda p: p.ndim > 1, params)


BACKBONE_TRAINING = ("full", "frozen", "lora")
# The low-rank adapters' parameter names inside a ViT backbone (model.backbone.lora_rank > 0).
LORA_PARAMS = ("lora_a", "lora_b")


def backbone_training(model_config) -> str:
    """`model.backbone.training`, checked: "full", "frozen", or "lora" (with a ViT of lora_rank > 0 only)."""
    backbone = model_config.backbone
    mode = backbone.training
    if mode not in BACKBONE_TRAINING:
        raise ConfigError(f"model.backbone.training={mode!r}; use one of {', '.join(map(repr, BACKBONE_TRAINING))}")
    rank = backbone.get("lora_rank", 0)  # a ResNet has no adapters, so no key
    if mode == "lora" and not rank > 0:
        raise ConfigError(
            f"model.backbone.training='lora' needs a ViT backbone with model.backbone.lora_rank > 0 (here "
            f"name={backbone.name!r}, lora_rank={rank}); use 'frozen' or 'full' for other backbones"
        )
    if rank > 0 and mode != "lora":
        raise ConfigError(f"model.backbone.lora_rank={rank} needs model.backbone.training='lora' (here {mode!r})")
    return mode


def trainable_parameters(model_config) -> Callable[[tuple[str, ...]], bool] | None:
    """`param path (tuple of names) -> whether it trains` for `model.backbone.training`, or None: all train.

    The parameters it rejects get no gradient, optimizer state or EMA at all
    (see `train_state.select_params`): "frozen" trains everything outside the
    backbone, "lora" that and the backbone's adapters (`LORA_PARAMS`). Under
    "full" every parameter is differentiated; `frozen_parameters` may still
    hold some fixed.
    """
    mode = backbone_training(model_config)
    if mode == "full":
        return None
    if mode == "frozen":
        return lambda path: path[0] != "backbone"
    return lambda path: path[0] != "backbone" or path[-1] in LORA_PARAMS


def frozen_parameters(model_config):
    """`params -> tree of bools` (True: keep fixed) for `config.model`, or None when every parameter trains.

    Frozen: what the backbone's kind holds fixed (`backbones.Backbone.frozen_parameters`:
    a ResNet's frozen-BatchNorm parameters with `model.backbone.norm == 'frozen_bn'`
    and its first `model.backbone.freeze_stages` stages). Other backbones freeze
    nothing, and neither does a backbone outside `model.backbone.training="full"`,
    whose parameters `trainable_parameters` leaves out of training altogether.
    """
    backbone_config = model_config.backbone
    kind = backbones.backbone_kind(backbone_config)
    if kind.frozen_parameters is None or backbone_training(model_config) != "full":
        return None
    backbone_mask = kind.frozen_parameters(backbone_config)
    if backbone_mask is None:
        return None

    def mask(params):
        frozen = traverse_util.flatten_dict(backbone_mask(params["backbone"]))
        return traverse_util.unflatten_dict(
            {path: path[0] == "backbone" and frozen[path[1:]] for path in traverse_util.flatten_dict(params)}
        )

    return mask


def _path_string(path) -> str:
    return "/".join(str(getattr(key, "key", key)) for key in path)


def learning_rate_multipliers(optimizer_config, model_config) -> Callable[[Any], Any] | None:
    """`params -> tree of multipliers` (floats or arrays broadcastable to each parameter), or None when all are 1.

    The product of two rules: `optimizer.lr_multipliers` ((regex, multiplier),
    ...; the first pattern that fully matches a parameter's '/'-joined path
    applies) and, for a ViT backbone, `optimizer.layer_decay` (ViTDet: block
    i of a depth-D ViT at decay ** (D - i), the embeddings at decay ** (D + 1),
    everything above the blocks at 1).
    """
    rules = [(re.compile(str(pattern)), float(multiplier)) for pattern, multiplier in optimizer_config.lr_multipliers]
    for pattern, multiplier in rules:
        if multiplier < 0:
            raise ConfigError(f"optimizer.lr_multipliers: {pattern.pattern!r} has multiplier {multiplier}; use >= 0")
    decay = float(optimizer_config.layer_decay)
    if not 0.0 < decay <= 1.0:
        raise ConfigError(f"optimizer.layer_decay={decay}; use a value in (0, 1] (1.0: off)")
    exponents = None
    if decay != 1.0:
        kind = backbones.backbone_kind(model_config.backbone) if model_config is not None else None
        if kind is None or kind.layer_decay is None:
            raise ConfigError(
                f"optimizer.layer_decay={decay} needs a ViT backbone (model.backbone.name='vit'); "
                "use optimizer.lr_multipliers for other backbones"
            )
        exponents = kind.layer_decay(model_config.backbone)
    if not rules and exponents is None:
        return None

    def multiplier_of(path, leaf) -> Any:
        name = _path_string(path)
        scale = next((m for pattern, m in rules if pattern.fullmatch(name)), 1.0)
        if exponents is not None and name.startswith("backbone/"):
            exponent = exponents(tuple(name.split("/")[1:]), leaf.shape)
            if exponent is not None:
                scale = scale * np.power(decay, exponent).astype(np.float32)
        return scale

    return lambda params: jax.tree_util.tree_map_with_path(multiplier_of, params)


def scale_by_multipliers(multipliers: Callable[[Any], Any]) -> optax.GradientTransformation:
    """Multiplies each parameter's update by its multiplier: that parameter's learning rate times it.

    Applied to the optimizer's final update, so for AdamW and SGD it scales
    the step and the decoupled weight decay together, as a PyTorch parameter
    group's `lr` does.
    """

    def update(updates, state, params=None):
        del params
        scaled = jax.tree.map(
            lambda u, m: u if isinstance(m, float) and m == 1.0 else u * jnp.asarray(m, u.dtype),
            updates,
            multipliers(updates),
        )
        return scaled, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


# `create_optimizer`'s default: derive the frozen parameters from `model_config`.
_FROM_MODEL_CONFIG = object()


def create_optimizer(
    optimizer_config, total_steps: int, *, model_config=None, frozen=_FROM_MODEL_CONFIG
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Returns (optimizer, schedule). Names: 'adamw' or 'sgd' (momentum, decoupled decay).

    With `model_config` (`config.model`), parameters the model config freezes
    (see `frozen_parameters`) get zero updates, and `optimizer.layer_decay`
    knows the ViT's depth. Learning-rate multipliers (`learning_rate_multipliers`)
    scale each parameter's final update. Under `model.backbone.training`
    "frozen" or "lora" the optimizer is initialised and updated over the
    trainable parameters alone (`train_state.select_params` with
    `trainable_parameters`): it holds no state for the others. `frozen`:
    `frozen_parameters(model_config)` when the caller has it already.
    """
    schedule = learning_rate_schedule(optimizer_config, total_steps)
    name = optimizer_config.name
    if name == "adamw":
        base = optax.adamw(schedule, weight_decay=optimizer_config.weight_decay, mask=_decay_mask)
    elif name == "sgd":
        base = optax.chain(
            optax.add_decayed_weights(optimizer_config.weight_decay, mask=_decay_mask),
            optax.sgd(schedule, momentum=optimizer_config.momentum),
        )
    else:
        raise ConfigError(f"optimizer.name={name!r} is not known; use 'adamw' or 'sgd'")
    parts = []
    if optimizer_config.grad_clip_norm and optimizer_config.grad_clip_norm > 0:
        parts.append(optax.clip_by_global_norm(optimizer_config.grad_clip_norm))
    parts.append(base)
    multipliers = learning_rate_multipliers(optimizer_config, model_config)
    if multipliers is not None:
        parts.append(scale_by_multipliers(multipliers))
    tx = optax.chain(*parts)
    if frozen is _FROM_MODEL_CONFIG:
        frozen = frozen_parameters(model_config) if model_config is not None else None
    if frozen is not None:
        # Zeroed before the optimizer, frozen gradients count neither in
        # clipping nor in momenta; zeroed after it, weight decay cannot move
        # them either. The optimizer state keeps the shape of all parameters
        # (zero momenta for frozen ones), so checkpoints and shardings do
        # not depend on what is frozen.
        keep_fixed = optax.masked(optax.set_to_zero(), frozen)
        tx = optax.chain(keep_fixed, tx, keep_fixed)
    return tx, schedule
