"""Convolution and normalisation layers whose parameters carry logical axis names.

Kernels are `[kh, kw, in, out]` with logical names
`('kernel_h', 'kernel_w', 'conv_in', 'conv_out')`; per-channel vectors are
`('conv_out',)`. Activations are `[batch, height, width, channels]` with names
`('batch', 'height', 'width', 'channels')`. `config.sharding.rules` maps these
names to mesh axes.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from detector.errors import ConfigError
from detector.models import convolution

KERNEL_AXES = ("kernel_h", "kernel_w", "conv_in", "conv_out")
CHANNEL_AXES = ("conv_out",)
ACTIVATION_AXES = ("batch", "height", "width", "channels")


def constrain_activation(x: jax.Array) -> jax.Array:
    """Pins a `[B, H, W, C]` activation to the mesh as the logical rules say."""
    return nn.with_logical_constraint(x, ACTIVATION_AXES)


@jax.custom_vjp
def relu(x: jax.Array) -> jax.Array:
    """max(x, 0) whose backward pass keeps one bit per element, not x.

    The gradient is `jax.nn.relu`'s bit for bit. The layer that follows keeps
    the output for its own gradient anyway; with `jax.nn.relu` XLA also keeps
    the input alive until the backward pass, one more activation-sized
    buffer per ReLU at the step's memory peak (DINO's FFNs: 85 MB per
    encoder layer at 512 px, batch 2). Here the input is freed after the
    forward pass; the sign is kept packed, 1/32 of a float32 activation.
    """
    return jnp.maximum(x, 0)


def _relu_forward(x):
    y = jnp.maximum(x, 0)
    # The backward pass reads the sign as packed bits: a reduction, which XLA
    # must write out, where a plain `y > 0` would be fused into the backward
    # pass's select reading x, and x would live until then.
    positive = (x > 0).astype(jnp.uint8)
    padding = -x.shape[-1] % 8
    if padding:
        positive = jnp.pad(positive, [(0, 0)] * (x.ndim - 1) + [(0, padding)])
    positive = positive.reshape(*x.shape[:-1], -1, 8)
    bits = jnp.sum(positive << jnp.arange(8, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)
    return y, bits


def _relu_backward(bits, y_grad):
    positive = ((bits[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1).reshape(*bits.shape[:-1], -1)
    positive = positive[..., : y_grad.shape[-1]]
    return (jnp.where(positive > 0, y_grad, jnp.zeros_like(y_grad)),)


relu.defvjp(_relu_forward, _relu_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def normalize(x: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float) -> jax.Array:
    """LayerNorm of `x [..., E]` over its last axis: `(x - mean) / sqrt(var + epsilon) * scale + bias`.

    Statistics in float32 at least (float64 stays float64), two-pass variance,
    the result in `x`'s dtype; `scale`, `bias`: `[E]`. The backward pass is
    written out (the normalised input and one reciprocal deviation per row
    kept): JAX's derivative of the same formula took XLA:CPU 2.4x as long
    (DINO's encoder rows, forward + backward).
    """
    return _normalize_forward(x, scale, bias, epsilon)[0]


def _normalize_forward(x, scale, bias, epsilon):
    dtype = jnp.promote_types(jnp.float32, x.dtype)
    centred = x.astype(dtype) - jnp.mean(x.astype(dtype), axis=-1, keepdims=True)
    inverse_deviation = jax.lax.rsqrt(jnp.mean(jnp.square(centred), axis=-1, keepdims=True) + epsilon)
    normalised = centred * inverse_deviation
    out = (normalised * scale.astype(dtype) + bias.astype(dtype)).astype(x.dtype)
    return out, (normalised, inverse_deviation, scale, bias)


def _normalize_backward(epsilon, residuals, out_grad):
    normalised, inverse_deviation, scale, bias = residuals
    dtype = normalised.dtype
    out_grad_wide = out_grad.astype(dtype)
    rows = tuple(range(out_grad.ndim - 1))
    normalised_grad = out_grad_wide * scale.astype(dtype)
    # d/dx of (x - mean) * rsqrt(var): the gradient less its mean and its projection on the normalised row.
    x_grad = inverse_deviation * (
        normalised_grad
        - jnp.mean(normalised_grad, axis=-1, keepdims=True)
        - normalised * jnp.mean(normalised_grad * normalised, axis=-1, keepdims=True)
    )
    scale_grad = jnp.sum(out_grad_wide * normalised, axis=rows).astype(scale.dtype)
    bias_grad = jnp.sum(out_grad_wide, axis=rows).astype(bias.dtype)
    return x_grad.astype(out_grad.dtype), scale_grad, bias_grad


normalize.defvjp(_normalize_forward, _normalize_backward)


class LayerNorm(nn.Module):
    """LayerNorm over the last axis (`normalize`), float32 parameters `scale` and `bias` named ('norm',).

    The variance takes two passes, as PyTorch's: one pass cancels where the
    mean dwarfs the spread (transformers' outlier channels), and a width split
    over `model` then rounds differently enough to move training.
    """

    epsilon: float = 1e-6
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = (x.shape[-1],)
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), features)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)), features)
        # Statistics from the input as it comes (float32 even where `dtype` is bf16).
        return normalize(x, scale, bias, self.epsilon).astype(self.dtype)


# Whether a CPU backend builds convolutions with the matmul kernel gradient (`convolution`). `detector.plan`
# compiles for accelerators on fake CPU devices and turns it off, so that it measures the convolution an
# accelerator runs: the matmul form holds each tap's shifted copy of the input (GBs at 1024 px).
_cpu_matmul_kernel_gradient = True


@contextlib.contextmanager
def accelerator_convolutions() -> Iterator[None]:
    """Within it, `conv` builds XLA's own convolution on every backend (for programs compiled for accelerators)."""
    global _cpu_matmul_kernel_gradient
    previous, _cpu_matmul_kernel_gradient = _cpu_matmul_kernel_gradient, False
    try:
        yield
    finally:
        _cpu_matmul_kernel_gradient = previous


def conv(
    features: int,
    kernel_size: int = 3,
    strides: int = 1,
    *,
    use_bias: bool = True,
    dtype: Any = jnp.float32,
    kernel_init: Any = nn.initializers.variance_scaling(2.0, "fan_out", "normal"),
    bias_init: Any = nn.initializers.zeros,
    padding: Any = "SAME",
    name: str | None = None,
) -> nn.Conv:
    """`nn.Conv` (f32 params) with logically partitioned kernel and bias.

    `padding` is what `nn.Conv` takes: 'SAME' (the default) or explicit
    `((top, bottom), (left, right))` pixels; see `symmetric_padding`. On a
    CPU backend the kernel gradient runs as matmuls (`detector.models.convolution`:
    XLA:CPU's own is several times slower); elsewhere, and within
    `accelerator_convolutions`, XLA's convolution is used.
    """
    on_cpu = _cpu_matmul_kernel_gradient and jax.default_backend() == "cpu"
    return nn.Conv(
        features,
        (kernel_size, kernel_size),
        strides=(strides, strides),
        padding=padding,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=jnp.float32,
        kernel_init=nn.with_logical_partitioning(kernel_init, KERNEL_AXES),
        bias_init=nn.with_logical_partitioning(bias_init, CHANNEL_AXES),
        conv_general_dilated=convolution.conv_general_dilated if on_cpu else None,
        name=name,
    )


def group_norm(
    channels: int,
    *,
    num_groups: int = 8,
    dtype: Any = jnp.float32,
    scale_init: Any = nn.initializers.ones,
    name: str | None = None,
) -> Callable[[jax.Array], jax.Array]:
    """GroupNorm with logically partitioned scale/bias: `[B, ..., channels] -> same shape`.

    GroupNorm rather than BatchNorm: detection trains at a few images per
    device, where batch statistics are noisy, and it keeps the model free of
    mutable state, so results do not depend on how the batch is sharded.
    `num_groups` is lowered to the largest divisor of `channels` for narrow layers.

    The variance is Flax's one pass, `mean(x^2) - mean(x)^2`, taken about an
    estimate of each group's mean (`_group_mean_estimate`, without gradient;
    the output does not depend on it): about zero it cancels catastrophically
    where the mean dwarfs the spread, and a split reduction (channels over
    `model`) then rounds differently enough to move training (3e-4 relative in
    three steps of a 2x2x2 ViT detector). Two passes cost the default
    RetinaNet's CPU step 12%, the shift 3.6%.
    """
    groups = min(num_groups, channels)
    while channels % groups:
        groups -= 1
    norm = nn.GroupNorm(
        num_groups=groups,
        dtype=dtype,
        param_dtype=jnp.float32,
        scale_init=nn.with_logical_partitioning(scale_init, CHANNEL_AXES),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, CHANNEL_AXES),
        name=name,
    )
    return lambda x: norm(x - _group_mean_estimate(x, groups))


# Positions per image whose mean stands for a group's: within a fraction of a
# standard deviation of the true mean, which is all the shift needs.
_SHIFT_SAMPLES = 64


def _group_mean_estimate(x: jax.Array, num_groups: int) -> jax.Array:
    """`[B, ..., C]` -> `[B, 1, ..., 1, C]`: each (image, group)'s mean over a strided sample, no gradient."""
    batch, channels = x.shape[0], x.shape[-1]
    positions = x.reshape(batch, -1, channels)
    stride = max(1, positions.shape[1] // _SHIFT_SAMPLES)
    sample = positions[:, ::stride].astype(jnp.float32)
    group_means = jnp.mean(sample.reshape(batch, sample.shape[1], num_groups, -1), axis=(1, 3))  # [B, groups]
    shift = jnp.repeat(group_means, channels // num_groups, axis=-1)  # [B, C], groups are contiguous channels
    return jax.lax.stop_gradient(shift.reshape(batch, *([1] * (x.ndim - 2)), channels).astype(x.dtype))


def symmetric_padding(kernel_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """`kernel_size // 2` pixels on every side, as PyTorch convolutions pad.

    'SAME' pads a stride-2 3x3 convolution of an even input by (0, 1): the
    same output shape as (1, 1), but the windows sit one pixel apart, so
    weights trained in PyTorch would see shifted inputs.
    """
    pad = kernel_size // 2
    return ((pad, pad), (pad, pad))


class FrozenBatchNorm(nn.Module):
    """BatchNorm in inference form with fixed statistics: `y = x * scale + bias` per channel.

    detectron2's FrozenBatchNorm2d: a pretrained BatchNorm's weight `w`, bias
    `b`, running mean `m` and variance `v` fold into `scale = w / sqrt(v + eps)`
    and `bias = b - m * scale` (see `detector.models.weights.torchvision_resnet`). Detection batches
    of a few images per device are too small to re-estimate the statistics,
    so they stay as pretrained; the optimizer keeps these parameters fixed
    (`detector.training.optim`). Initialised as the identity. Parameters `scale`, `bias`:
    `[channels]` float32, logical axes `('conv_out',)`. Input and output
    `[..., channels]`.
    """

    channels: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, CHANNEL_AXES), (self.channels,), jnp.float32
        )
        bias = self.param(
            "bias", nn.with_logical_partitioning(nn.initializers.zeros, CHANNEL_AXES), (self.channels,), jnp.float32
        )
        return x.astype(self.dtype) * scale.astype(self.dtype) + bias.astype(self.dtype)


REMAT_POLICIES = {
    "none": None,
    # Recompute everything in the backward pass: least memory, ~1/3 more FLOPs.
    "full": jax.checkpoint_policies.nothing_saveable,
    # Keep matmul outputs, recompute the cheap elementwise ops around them.
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def rematerialized(module_cls: type[nn.Module], policy_name: str, *, prevent_cse: bool = True) -> type[nn.Module]:
    """`module_cls` wrapped in `nn.remat` with the named policy ('none' returns it unchanged).

    Rematerialisation drops the block's activations after the forward pass and
    recomputes them in the backward pass: per-device temporaries fall roughly
    with the number of blocks, at the price of a second forward.
    """
    if policy_name not in REMAT_POLICIES:
        raise ConfigError(f"model.remat={policy_name!r}; use one of {', '.join(REMAT_POLICIES)}")
    if policy_name == "none":
        return module_cls
    return nn.remat(module_cls, policy=REMAT_POLICIES[policy_name], prevent_cse=prevent_cse)
