from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from detector.models import convolution
from detector.models.layers import conv

NHWC = ("NHWC", "HWIO", "NHWC")


def _grads(conv_fn, x, kernel, strides, padding):
    def loss(x, kernel):
        y = conv_fn(x, kernel, strides, padding, dimension_numbers=NHWC)
        # A weighted sum, so every output position has its own gradient.
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, kernel)


@pytest.fixture(params=["leading", "transposed"])
def product_form(request, monkeypatch):
    """Both forms of the per-tap products: x and dy contracted over their leading dim as they lie, or dy transposed."""
    threshold = 0 if request.param == "leading" else 2**62
    monkeypatch.setattr(convolution, "MIN_LEADING_CONTRACTION_MACS", threshold)
    return request.param


@pytest.mark.parametrize(
    "shape, kernel_size, strides, padding",
    [
        ((2, 9, 10), 3, 1, "SAME"),
        ((2, 10, 12), 3, 2, "SAME"),  # asymmetric: pads (0, 1)
        ((2, 10, 12), 3, 2, ((1, 1), (1, 1))),  # torchvision's symmetric padding
        ((1, 11, 9), 7, 2, ((3, 3), (3, 3))),
        ((2, 8, 8), 1, 1, "VALID"),
        ((2, 8, 8), 1, 2, "SAME"),
        ((2, 8, 12), 4, 4, "VALID"),  # a patchify convolution: one matmul over patches
        ((1, 9, 7), 3, 1, "VALID"),
    ],
)
def test_gradients_equal_xla_convolution(shape, kernel_size, strides, padding, product_form):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(*shape, 32)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(kernel_size, kernel_size, 32, 48)) * 0.1, jnp.float32)
    (ref_loss, (ref_dx, ref_dk)) = _grads(lax.conv_general_dilated, x, kernel, (strides, strides), padding)
    (loss, (dx, dk)) = _grads(convolution.conv_general_dilated, x, kernel, (strides, strides), padding)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dk, ref_dk, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(ref_dk))))


def test_bfloat16_kernel_gradient_accumulates_in_float32(product_form):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(4, 16, 16, 32)), jnp.bfloat16)
    dy = jnp.asarray(rng.normal(size=(4, 16, 16, 64)), jnp.bfloat16)
    dk = convolution.kernel_gradient(x, dy, (3, 3), (1, 1), ((1, 1), (1, 1)))
    assert dk.dtype == jnp.bfloat16 and dk.shape == (3, 3, 32, 64)
    exact = convolution.kernel_gradient(x.astype(jnp.float32), dy.astype(jnp.float32), (3, 3), (1, 1), ((1, 1), (1, 1)))
    # One bf16 rounding of the result, not 4096 of partial sums.
    np.testing.assert_allclose(dk.astype(jnp.float32), exact, rtol=1e-2, atol=1e-2 * float(jnp.max(jnp.abs(exact))))


def _uses_custom_gradient(fn, *args) -> bool:
    return "custom_vjp_call" in str(jax.make_jaxpr(fn)(*args))


def test_narrow_dilated_and_grouped_convolutions_keep_xla():
    x = jnp.zeros((1, 8, 8, 32))
    wide = jnp.zeros((3, 3, 32, 32))
    assert _uses_custom_gradient(
        lambda x, k: convolution.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=NHWC), x, wide
    )
    # RGB input: XLA's own kernel gradient is faster for 3 channels.
    assert not _uses_custom_gradient(
        lambda x, k: convolution.conv_general_dilated(x, k, (2, 2), "SAME", dimension_numbers=NHWC),
        jnp.zeros((1, 8, 8, 3)),
        jnp.zeros((7, 7, 3, 64)),
    )
    assert not _uses_custom_gradient(
        lambda x, k: convolution.conv_general_dilated(
            x, k, (1, 1), "SAME", rhs_dilation=(2, 2), dimension_numbers=NHWC
        ),
        x,
        wide,
    )
    assert not _uses_custom_gradient(
        lambda x, k: convolution.conv_general_dilated(
            x, k, (1, 1), "SAME", dimension_numbers=NHWC, feature_group_count=2
        ),
        x,
        jnp.zeros((3, 3, 16, 32)),
    )


def test_layers_conv_trains_like_flax_conv():
    """The project's conv layer (which routes CPU kernel gradients through matmuls) matches nn.Conv."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(2, 12, 12, 32)), jnp.float32)
    ours = conv(40, 3, 2)
    plain = nn.Conv(40, (3, 3), strides=(2, 2), padding="SAME")
    params = plain.init(jax.random.key(0), x)
    assert jax.default_backend() == "cpu"
    assert _uses_custom_gradient(lambda p: ours.apply(p, x), params)
    grads = [jax.grad(lambda p: jnp.sum(module.apply(p, x) ** 2))(params) for module in (ours, plain)]
    for got, want in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(want))))


def test_pointwise_convolution_runs_as_a_matmul():
    """A 1x1, stride-1, unpadded convolution is lowered as a dot (faster on XLA:CPU); a strided one is not."""
    x = jnp.ones((2, 8, 8, 32))
    kernel = jnp.ones((1, 1, 32, 48))

    def lowered(strides):
        return (
            jax.jit(lambda x, k: convolution.conv_general_dilated(x, k, strides, "VALID", dimension_numbers=NHWC))
            .lower(x, kernel)
            .as_text()
        )

    assert "convolution" not in lowered((1, 1)) and "dot_general" in lowered((1, 1))
    assert "convolution" in lowered((2, 2))
