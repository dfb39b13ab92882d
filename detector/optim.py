"""Optimizer and learning-rate schedule from `config.optimizer`."""

from __future__ import annotations

import jax
import optax

from detector.errors import ConfigError


def learning_rate_schedule(optimizer_config, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `learning_rate`, then the configured decay.

    'cosine': cosine decay to 0 at `total_steps`. 'step': x0.1 at each step in
    `decay_boundaries` (detectron2's multi-step schedule).
    """
    warmup = min(int(optimizer_config.warmup_steps), max(total_steps - 1, 0))
    peak = optimizer_config.learning_rate
    if optimizer_config.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=peak, warmup_steps=warmup,
            decay_steps=max(total_steps, warmup + 1), end_value=0.0)
    if optimizer_config.schedule == "step":
        boundaries = sorted(int(b) for b in optimizer_config.decay_boundaries)
        if any(b <= warmup for b in boundaries):
            raise ConfigError(f"optimizer.decay_boundaries={tuple(boundaries)} must all come after "
                              f"optimizer.warmup_steps={warmup}")
        decay = optax.piecewise_constant_schedule(peak, {b - warmup: 0.1 for b in boundaries})
        return optax.join_schedules([optax.linear_schedule(0.0, peak, max(warmup, 1)), decay], [warmup])
    raise ConfigError(f"optimizer.schedule={optimizer_config.schedule!r} is not known; use 'cosine' or 'step'")


def _decay_mask(params):
    # Weight decay on kernels only: decaying biases and norm scales hurts
    # detection accuracy (detectron2 and torchvision exclude them too).
    return jax.tree.map(lambda p: p.ndim > 1, params)


def create_optimizer(optimizer_config, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Returns (optimizer, schedule). Names: 'adamw' or 'sgd' (momentum, decoupled decay)."""
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
    return optax.chain(*parts), schedule
