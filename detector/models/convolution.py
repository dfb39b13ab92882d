"""A convolution whose kernel gradient is computed as matrix products, for XLA:CPU.

XLA:CPU runs a convolution's forward pass and its input gradient through
fast kernels (XNNPACK, Eigen's spatial convolution), but lowers the kernel
gradient - a convolution that contracts over batch and space - to a slow
generic loop: on a 2-core host a 1x1 conv's kernel gradient took 25x its
forward pass, and the kernel gradients were ~80% of a RetinaNet train step.
The kernel gradient is a sum over the kernel's taps of `x_tap^T @ dy`,
where `x_tap` is the padded input shifted by the tap and strided like the
output; written as one `dot_general` per tap it runs on the matmul kernels
(a 1x1 conv is a single matmul; a patchify conv, kernel == stride, is one
matmul on reshaped patches). Forward pass and input gradient are XLA's
convolution, except for a 1x1 stride-1 one: a matmul over channels, which
XLA:CPU runs faster than its convolution (forward and input gradient).

`conv_general_dilated` has `lax.conv_general_dilated`'s signature, so
`nn.Conv(conv_general_dilated=...)` takes it. Narrow convolutions (fewer
than MIN_MATMUL_CHANNELS input or output channels: a stem reading RGB,
a 16-wide toy model) keep XLA's kernel gradient, which is faster there
(7x7 RGB stem: 21 ms vs 92 ms); so do dilated, grouped or non-NHWC ones.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

# Flax's NHWC / HWIO layout as lax dimension numbers.
_NHWC_HWIO = lax.ConvDimensionNumbers(lhs_spec=(0, 3, 1, 2), rhs_spec=(3, 2, 0, 1), out_spec=(0, 3, 1, 2))

Padding = tuple[tuple[int, int], tuple[int, int]]

# Measured on XLA:CPU: at 32+ channels a side the matmuls win (3x3, 64->64:
# 1.4x; 256->256: 1.7-3x; 1x1: 10x), at 16 they lose (3x3, 16->16: 0.6x).
MIN_MATMUL_CHANNELS = 32

# Per-tap products of at least this many multiply-adds (N*H_out*W_out*C_in*C_out)
# contract x and dy over their leading dim as they lie; smaller ones transpose
# dy first. In a train step XLA:CPU runs the former on Eigen and the latter on
# XNNPACK, and the small ones were slower on Eigen: with every product in the
# leading-dim form the default config's step took 10% longer, while the
# ResNet-50 RetinaNet's (products of 8M-4G) took 12-16% less.
MIN_LEADING_CONTRACTION_MACS = 2**25


def _forward(x, kernel, strides, padding, precision):
    if kernel.shape[:2] == (1, 1) and strides == (1, 1) and padding == ((0, 0), (0, 0)):
        # A 1x1 convolution is a matmul over channels, and XLA:CPU runs it
        # faster as one (its input gradient too): ResNet-50's 1x1 convs at
        # 512 px, batch 2, 1.1-5x (256 -> 64 at 128 x 128: 35 -> 7 ms).
        return lax.dot_general(x, kernel[0, 0], (((3,), (0,)), ((), ())), precision=precision)
    return lax.conv_general_dilated(x, kernel, strides, padding, dimension_numbers=_NHWC_HWIO, precision=precision)


def kernel_gradient(
    x: jax.Array, dy: jax.Array, kernel_size: tuple[int, int], strides: tuple[int, int], padding: Padding
) -> jax.Array:
    """d(loss)/d(kernel) of an NHWC/HWIO convolution as matmuls.

    Args:
      x: the convolution's input `[N, H, W, C_in]`.
      dy: the loss gradient at its output `[N, H_out, W_out, C_out]`.
      kernel_size, strides: `(kh, kw)`, `(sh, sw)`.
      padding: `((top, bottom), (left, right))` pixels.
    Returns:
      `[kh, kw, C_in, C_out]` in float32 accumulation, cast to `x.dtype`.
    """
    (kh, kw), (sh, sw) = kernel_size, strides
    n, out_h, out_w, _ = dy.shape
    channels = x.shape[3]
    patchify = (kh, kw) == (sh, sw) != (1, 1) and padding == ((0, 0), (0, 0))
    if patchify and x.shape[1] == out_h * kh and x.shape[2] == out_w * kw:
        # Non-overlapping windows (a ViT's patch embedding): one matmul over patches.
        # (A 1x1 conv takes the tap loop below, a single tap, which does not
        # transpose x. Through this einsum XLA transposed x, recomputing the
        # frozen-BN chain that produced it: 14% of a ResNet-50 step on a CPU.)
        patches = x.reshape(n, out_h, kh, out_w, kw, channels)
        return jnp.einsum("nhiwjc,nhwd->ijcd", patches, dy, preferred_element_type=jnp.float32).astype(x.dtype)
    x = lax.pad(x, jnp.zeros((), x.dtype), ((0, 0, 0), (*padding[0], 0), (*padding[1], 0), (0, 0, 0)))
    rows = n * out_h * out_w
    out_channels = dy.shape[3]

    def tap(i, j):  # x at tap (i, j): [N, H_out, W_out, C_in]
        limit = (n, i + sh * (out_h - 1) + 1, j + sw * (out_w - 1) + 1, channels)
        return lax.slice(x, (0, i, j, 0), limit, (1, sh, sw, 1))

    taps = [tap(i, j) for i in range(kh) for j in range(kw)]
    if rows * channels * out_channels >= MIN_LEADING_CONTRACTION_MACS:
        # Every tap is `x_tap^T @ dy` on 2-D views ([rows, C_in] and [rows,
        # C_out]) contracted over their leading dim, which the matmul kernel
        # reads transposed in place: nothing is copied but each tap's slice of
        # x, and the taps come out in the kernel's [C_in, C_out] order.
        # (Contracting 4-D operands, as below, XLA transposed dy, and the
        # kernel's transpose fused into the optimizer's update, the gradient
        # norm and the head's sum over levels, each reading the gradient with
        # a stride: ~15% of a RetinaNet step on a CPU.)
        dy_rows = dy.reshape(rows, out_channels)
        leading = (((0,), (0,)), ((), ()))
        products = [
            lax.dot_general(x_tap.reshape(rows, channels), dy_rows, leading, preferred_element_type=jnp.float32)
            for x_tap in taps
        ]
        return jnp.stack(products).reshape(kh, kw, channels, out_channels).astype(x.dtype)
    # dy is transposed once to `[C_out, N, H_out, W_out]`, so every tap is a
    # plain `[C_out, rows] @ [rows, C_in]` product on a row-major slice of x.
    dy_t = jnp.transpose(dy, (3, 0, 1, 2))
    batch_and_space = (((1, 2, 3), (0, 1, 2)), ((), ()))
    products = [lax.dot_general(dy_t, x_tap, batch_and_space, preferred_element_type=jnp.float32) for x_tap in taps]
    return jnp.transpose(jnp.stack(products).reshape(kh, kw, out_channels, channels), (0, 1, 3, 2)).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _conv(x, kernel, strides, padding, precision):
    return _forward(x, kernel, strides, padding, precision)


def _conv_fwd(x, kernel, strides, padding, precision):
    return _forward(x, kernel, strides, padding, precision), (x, kernel)


def _conv_bwd(strides, padding, precision, residuals, dy):
    x, kernel = residuals
    _, input_vjp = jax.vjp(lambda x: _forward(x, kernel, strides, padding, precision), x)
    (dx,) = input_vjp(dy)
    dkernel = kernel_gradient(x, dy.astype(x.dtype), kernel.shape[:2], strides, padding)
    return dx, dkernel.astype(kernel.dtype)


_conv.defvjp(_conv_fwd, _conv_bwd)


def conv_general_dilated(
    lhs: jax.Array,
    rhs: jax.Array,
    window_strides: Sequence[int],
    padding,
    lhs_dilation=None,
    rhs_dilation=None,
    dimension_numbers=None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision=None,
    preferred_element_type=None,
) -> jax.Array:
    """`lax.conv_general_dilated` with the kernel gradient as matmuls (see the module docstring)."""
    plain = (
        lhs.ndim == 4
        and feature_group_count == 1
        and batch_group_count == 1
        and preferred_element_type is None
        and all(d == 1 for d in (lhs_dilation or (1, 1)))
        and all(d == 1 for d in (rhs_dilation or (1, 1)))
        and lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers) == _NHWC_HWIO
    )
    if not plain or min(rhs.shape[2:]) < MIN_MATMUL_CHANNELS:
        return lax.conv_general_dilated(
            lhs,
            rhs,
            window_strides,
            padding,
            lhs_dilation,
            rhs_dilation,
            dimension_numbers,
            feature_group_count,
            batch_group_count,
            precision,
            preferred_element_type,
        )
    strides = tuple(int(s) for s in window_strides)
    if isinstance(padding, str):
        padding = lax.padtype_to_pads(lhs.shape[1:3], rhs.shape[:2], strides, padding)
    padding = tuple((int(lo), int(hi)) for lo, hi in padding)
    return _conv(lhs, rhs, strides, padding, precision)
