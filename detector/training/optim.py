"""Optimizer and learning-rate schedule from `config.optimizer`."""

from __future__ import annotations

import jax
import optax
from flax import traverse_util

from detector.errors import ConfigError
from detector.models.resnet import check_norm, frozen_parameter_mask


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


def frozen_parameters(model_config):
    """`params -> tree of bools` (True: keep fixed) for `config.model`, or None when every parameter trains.

    Frozen: a ResNet's frozen-BatchNorm parameters (`model.backbone.norm ==
    'frozen_bn'`) and its first `model.backbone.freeze_stages` stages (see
    `detector.models.resnet.frozen_parameter_mask`). Other backbones freeze nothing.
    """
    backbone_config = model_config.backbone
    if backbone_config.name != "resnet":
        return None
    norm = backbone_config.norm
    freeze_stages = backbone_config.freeze_stages
    check_norm(norm)
    if not isinstance(freeze_stages, int) or freeze_stages < 0:
        raise ConfigError(f"model.backbone.freeze_stages={freeze_stages!r}; use an integer >= 0")
    if norm != "frozen_bn" and freeze_stages == 0:
        return None

    def mask(params):
        frozen = traverse_util.flatten_dict(
            frozen_parameter_mask(params["backbone"], norm=norm, freeze_stages=freeze_stages)
        )
        return traverse_util.unflatten_dict(
            {path: path[0] == "backbone" and frozen[path[1:]] for path in traverse_util.flatten_dict(params)}
        )

    return mask


def create_optimizer(
    optimizer_config, total_steps: int, *, model_config=None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Returns (optimizer, schedule). Names: 'adamw' or 'sgd' (momentum, decoupled decay).

    With `model_config` (`config.model`), parameters the model config freezes
    (see `frozen_parameters`) get zero updates.
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
    tx = optax.chain(*parts)
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
