"""The ViT backbone and simple feature pyramid."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detector.errors import ConfigError
from detector.models.necks import SimpleFeaturePyramid
from detector.models.vit import Block, ViT, _window_partition, _window_unpartition


def tiny_vit(**overrides) -> ViT:
    kwargs = dict(embed_dim=32, depth=4, num_heads=4, window_size=2, global_attention_every=2, pretrain_image_size=64)
    kwargs.update(overrides)
    return ViT(**kwargs)


def test_window_partition_round_trips_with_padding():
    x = jnp.arange(2 * 5 * 7 * 3, dtype=jnp.float32).reshape(2, 5, 7, 3)
    windows, padded = _window_partition(x, 3)
    assert padded == (6, 9) and windows.shape == (2 * 2 * 3, 3, 3, 3)
    np.testing.assert_array_equal(windows[0], x[0, :3, :3])  # first window = top-left 3x3 tile
    np.testing.assert_array_equal(_window_unpartition(windows, 3, padded, (5, 7)), x)


def test_windowed_block_only_mixes_tokens_within_a_window():
    block = Block(num_heads=2, mlp_hidden=16, window_size=2)
    x = jax.random.normal(jax.random.key(0), (1, 4, 4, 8))
    params = block.init(jax.random.key(1), x)
    y, _ = block.apply(params, x)
    # A token of the top-left window (not a constant shift: LayerNorm would remove it).
    x_changed = x.at[0, 0, 0].add(jnp.arange(8.0))
    y_changed, _ = block.apply(params, x_changed)
    changed = np.any(np.abs(np.asarray(y_changed - y)) > 1e-6, axis=-1)[0]
    assert changed[:2, :2].all() and not changed[2:, :].any() and not changed[:, 2:].any()
    # A global block lets the change reach every token.
    global_block = Block(num_heads=2, mlp_hidden=16, window_size=0)
    y, _ = global_block.apply(params, x)
    y_changed, _ = global_block.apply(params, x_changed)
    assert np.all(np.any(np.abs(np.asarray(y_changed - y)) > 1e-6, axis=-1))


@pytest.mark.parametrize("size", [(64, 64), (96, 128)])
def test_vit_returns_a_stride_16_map_at_any_input_size(size):
    vit = tiny_vit()
    images = jnp.zeros((2, *size, 3))
    params = vit.init(jax.random.key(0), images)
    features = vit.apply(params, images)
    assert list(features) == [4] and features[4].shape == (2, size[0] // 16, size[1] // 16, 32)
    # The position embedding is stored at the pretraining grid and resized on use.
    assert params["params"]["pos_embed"].value.shape == (1, 4, 4, 32)


def test_scanned_blocks_keep_the_program_size_independent_of_depth():
    images = jnp.zeros((1, 64, 64, 3))

    def program_size(depth, scan):
        vit = tiny_vit(depth=depth, scan=scan)
        variables = jax.eval_shape(lambda: vit.init(jax.random.key(0), images))
        return len(jax.jit(lambda v: vit.apply(v, images)).lower(variables).as_text())

    assert program_size(8, scan=True) == program_size(16, scan=True)
    assert program_size(16, scan=False) > 1.5 * program_size(8, scan=False)


@pytest.mark.slow  # 8-10 s of compiling
def test_scanned_and_unrolled_blocks_compute_the_same_function():
    images = jax.random.normal(jax.random.key(0), (1, 64, 64, 3))
    scanned, unrolled = tiny_vit(scan=True), tiny_vit(scan=False)
    params = scanned.init(jax.random.key(1), images)["params"]
    # Unstack the scanned parameters [stage, layer, ...] into the unrolled names.
    unrolled_params = {k: v for k, v in params.items() if k != "stages"}
    for stage in range(2):
        take = lambda tree, *index: jax.tree.map(lambda a: a[index], tree)  # noqa: E731
        unrolled_params[f"stage{stage}"] = {
            "windowed0": take(params["stages"]["windowed"], stage, 0),
            "global": take(params["stages"]["global"], stage),
        }
    np.testing.assert_allclose(
        unrolled.apply({"params": unrolled_params}, images)[4],
        scanned.apply({"params": params}, images)[4],
        rtol=1e-5,
        atol=1e-5,
    )


def test_simple_feature_pyramid_builds_levels_3_to_7():
    neck = SimpleFeaturePyramid(features=16, min_level=3, max_level=7)
    features = {4: jnp.zeros((2, 8, 8, 32))}
    pyramid = neck.apply(neck.init(jax.random.key(0), features), features)
    assert {level: x.shape[1:] for level, x in pyramid.items()} == {
        3: (16, 16, 16),
        4: (8, 8, 16),
        5: (4, 4, 16),
        6: (2, 2, 16),
        7: (1, 1, 16),
    }


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(depth=5), "not a multiple of global_attention_every"),
        (dict(num_heads=5), "not divisible by num_heads"),
        (dict(patch_size=8), "patch_size=8"),
    ],
)
def test_bad_vit_settings_name_the_config_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_vit(**overrides).init(jax.random.key(0), jnp.zeros((1, 64, 64, 3)))
