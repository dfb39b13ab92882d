"""detector.models.layers: the GroupNorm the conv models share."""

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
