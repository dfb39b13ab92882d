"""detector.models.layers: the GroupNorm the conv models share and the ReLU that keeps less for its gradient."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detector.models import layers


class _Norm(nn.Module):
    groups: int

    @nn.compact
    def __call__(self, x):
        return layers.group_norm(x.shape[-1], num_groups=self.groups, name="norm")(x)


def _exact_group_norm(x: np.ndarray, groups: int, epsilon: float = 1e-6) -> np.ndarray:
    x = np.asarray(x, np.float64)
    grouped = x.reshape(x.shape[0], -1, groups, x.shape[-1] // groups)
    mean, var = grouped.mean(axis=(1, 3), keepdims=True), grouped.var(axis=(1, 3), keepdims=True)
    return ((grouped - mean) / np.sqrt(var + epsilon)).reshape(x.shape)


@pytest.mark.parametrize("shape, groups", [((2, 16, 16, 32), 4), ((2, 5, 7, 8), 1), ((3, 200, 16), 8)])
def test_group_norm_is_exact_where_the_mean_dwarfs_the_spread(shape, groups):
    """Mean 100, spread 0.01: one-pass variance about zero loses every digit; about the shift it keeps them."""
    rng = np.random.default_rng(0)
    # Each group has its own offset, so one shift for all groups would not do.
    offsets = np.repeat(rng.uniform(50, 150, size=(shape[0], groups)), shape[-1] // groups, axis=-1)
    x = (rng.normal(size=shape) * 0.01 + offsets.reshape(shape[0], *([1] * (len(shape) - 2)), shape[-1])).astype(
        np.float32
    )
    module = _Norm(groups)
    variables = module.init(jax.random.key(0), x)
    assert set(variables["params"]["norm"]) == {"scale", "bias"}  # Flax's GroupNorm names, as checkpoints hold
    exact = _exact_group_norm(x, groups)
    np.testing.assert_allclose(np.asarray(module.apply(variables, x)), exact, atol=2e-3)
    unshifted = nn.GroupNorm(num_groups=groups).apply({"params": nn.meta.unbox(variables["params"]["norm"])}, x)
    assert np.max(np.abs(np.asarray(unshifted) - exact)) > 0.5  # what the shift is for


@pytest.mark.slow  # 5-7 s of compiling: the slow tier
def test_group_norm_gradient_is_the_exact_ones():
    """The shift carries no gradient and changes no output, so the input gradient is GroupNorm's own."""
    x = jax.random.normal(jax.random.key(1), (2, 8, 8, 16))
    module = _Norm(4)
    variables = module.init(jax.random.key(0), x)
    weights = jax.random.normal(jax.random.key(2), x.shape)
    plain = nn.GroupNorm(num_groups=4, use_fast_variance=False)
    params = nn.meta.unbox(variables["params"]["norm"])
    ours = jax.grad(lambda v: jnp.sum(module.apply(variables, v) * weights))(x)
    reference = jax.grad(lambda v: jnp.sum(plain.apply({"params": params}, v) * weights))(x)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(reference), atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("width", [16, 13])  # 13: the packed sign bits need padding
def test_relu_values_and_gradient_are_jax_relus_bit_for_bit(width, dtype):
    x = jax.random.normal(jax.random.key(0), (3, 5, width)).astype(dtype)
    x = x.at[0, 0].set(0.0).at[0, 1, 0].set(jnp.nan)  # the kink and a NaN take jax.nn.relu's side
    g = jax.random.normal(jax.random.key(1), x.shape).astype(dtype)
    ours, ours_vjp = jax.vjp(layers.relu, x)
    theirs, theirs_vjp = jax.vjp(jax.nn.relu, x)
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(theirs, np.float32))
    np.testing.assert_array_equal(np.asarray(ours_vjp(g)[0], np.float32), np.asarray(theirs_vjp(g)[0], np.float32))


def test_relu_frees_its_input_after_the_forward_pass():
    """A stack of FFNs keeps one hidden-sized buffer per layer for the backward pass, not two.

    Measured with 4 layers (a hidden activation is 8 MiB): 74.5 MiB of temporaries with
    jax.nn.relu, 50 MiB with ours.
    """

    def temp_bytes(activation, layers=4):
        def loss(weights, x):
            for w1, w2 in weights:
                x = jnp.tanh(x + activation(x @ w1) @ w2)
            return jnp.sum(x**2)

        weights = [(jnp.full((64, 1024), 0.01), jnp.full((1024, 64), 0.01))] * layers
        lowered = jax.jit(jax.grad(loss)).lower(weights, jnp.ones((2, 1024, 64)))
        # Under XLA:CPU's concurrency-optimised schedule, as `detector.plan` compiles: the schedule the
        # suite runs with (tests/helpers) has a 74 MiB peak either way, set by something else than
        # what backward keeps.
        compiled = lowered.compile(
            compiler_options={"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED"}
        )
        return compiled.memory_analysis().temp_size_in_bytes

    hidden = 2 * 1024 * 1024 * 4
    assert temp_bytes(jax.nn.relu) - temp_bytes(layers.relu) >= 2.5 * hidden


def _plain_layer_norm(x, scale, bias, epsilon):
    """The textbook formula, differentiated by JAX."""
    centred = x - jnp.mean(x, -1, keepdims=True)
    return centred / jnp.sqrt(jnp.mean(centred**2, -1, keepdims=True) + epsilon) * scale + bias


def test_normalize_values_and_gradients_are_the_formulas():
    with jax.enable_x64():
        rng = np.random.default_rng(0)
        # Rows whose mean dwarfs their spread, and one constant row (zero variance).
        x = rng.normal(size=(3, 5, 16)) * rng.uniform(0.01, 3, size=(3, 5, 1)) + rng.normal(size=(3, 5, 1)) * 50
        x[0, 0] = 7.0
        scale, bias = rng.normal(size=16), rng.normal(size=16)
        out_grad = rng.normal(size=x.shape)

        def loss(fn):
            return lambda x, s, b: jnp.sum(fn(x, s, b, 1e-5) * out_grad)

        np.testing.assert_allclose(
            layers.normalize(x, scale, bias, 1e-5), _plain_layer_norm(x, scale, bias, 1e-5), rtol=1e-12, atol=1e-12
        )
        ours = jax.grad(loss(layers.normalize), argnums=(0, 1, 2))(x, scale, bias)
        plain = jax.grad(loss(_plain_layer_norm), argnums=(0, 1, 2))(x, scale, bias)
        for got, want in zip(ours, plain):
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())


def test_layer_norm_keeps_float32_statistics_for_bf16():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 32)) + 300.0, jnp.float32)
    norm = layers.LayerNorm(epsilon=1e-6, dtype=jnp.bfloat16)
    params = norm.init(jax.random.key(0), x)
    assert {k: v.value.dtype for k, v in params["params"].items()} == {"scale": jnp.float32, "bias": jnp.float32}
    out = norm.apply(params, x)
    assert out.dtype == jnp.bfloat16
    # From the float32 input: a bf16 copy of x (spacing 2 at 300) would have lost the spread.
    expected = _plain_layer_norm(x, 1.0, 0.0, 1e-6)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=2e-2)
    grads = jax.grad(lambda x: jnp.sum(norm.apply(params, x).astype(jnp.float32) ** 2))(x)
    assert grads.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(grads)))


def test_accelerator_convolutions_build_xlas_kernel_gradient_with_the_same_values():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 8, 32)), jnp.float32)

    def kernel_gradient_and_hlo():
        module = layers.conv(32, 3)
        params = nn.unbox(module.init(jax.random.key(0), x))
        grad = jax.jit(jax.grad(lambda p: jnp.sum(module.apply(p, x) ** 2)))
        return grad(params)["params"]["kernel"], grad.lower(params).compile().as_text()

    matmul_form, matmul_hlo = kernel_gradient_and_hlo()
    with layers.accelerator_convolutions():
        native, native_hlo = kernel_gradient_and_hlo()
    assert layers.conv(32).conv_general_dilated is not None  # the CPU form again after the block
    # The forward pass and the kernel gradient are two convolutions in XLA's form; the matmul form has one.
    assert native_hlo.count(" convolution(") == 2 and matmul_hlo.count(" convolution(") == 1
    np.testing.assert_allclose(native, matmul_form, rtol=1e-4, atol=1e-4)
