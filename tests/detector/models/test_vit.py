"""The ViT backbone and simple feature pyramid."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detector.errors import ConfigError
from detector.models.necks import SimpleFeaturePyramid
from detector.models.transformer import merge_lora
from detector.models.vit import Block, ViT, _window_partition, _window_unpartition, rope_angles, rotate


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


@pytest.mark.slow  # 5-7 s of compiling: the slow tier
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


@pytest.mark.parametrize("size", [(64, 64), pytest.param((96, 128), marks=pytest.mark.slow)])
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
    params = jax.jit(scanned.init)(jax.random.key(1), images)["params"]
    # Unstack the scanned parameters [stage, layer, ...] into the unrolled names.
    unrolled_params = {k: v for k, v in params.items() if k != "stages"}
    for stage in range(2):
        take = lambda tree, *index: jax.tree.map(lambda a: a[index], tree)  # noqa: E731
        unrolled_params[f"stage{stage}"] = {
            "windowed0": take(params["stages"]["windowed"], stage, 0),
            "global": take(params["stages"]["global"], stage),
        }
    np.testing.assert_allclose(
        jax.jit(unrolled.apply)({"params": unrolled_params}, images)[4],
        jax.jit(scanned.apply)({"params": params}, images)[4],
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


# ---- foundation-backbone options ----


_INITIALISED = {}


def init_and_apply(vit, size=(64, 64), seed=0):
    """(variables, level-4 output, images) of `vit` on random images, compiled as one program and cached."""
    key = (repr(vit), size, seed)
    if key not in _INITIALISED:
        images = jax.random.normal(jax.random.key(seed), (1, *size, 3))

        def init_and_run(images):
            variables = vit.init(jax.random.key(1), images)
            return variables, vit.apply(variables, images)[4]

        _INITIALISED[key] = (*jax.jit(init_and_run)(images), images)
    return _INITIALISED[key]


_COMPILED = {}


def applied(vit, variables, images, method=None):
    """`vit.apply(variables, images, method=method)`, jitted once per (module, method); level 4 unless a method."""
    key = (repr(vit), method)
    if key not in _COMPILED:
        _COMPILED[key] = jax.jit(lambda v, x: vit.apply(v, x, method=method) if method else vit.apply(v, x)[4])
    return _COMPILED[key](variables, images)


def param_shapes(params):
    return {
        "/".join(str(k.key) for k in path): leaf.shape
        for path, leaf in jax.tree_util.tree_leaves_with_path(nn.meta.unbox(params["params"]))
    }


def test_default_options_keep_the_plain_vit_parameters():
    shapes = param_shapes(tiny_vit().init(jax.random.key(0), jnp.zeros((1, 64, 64, 3))))
    assert shapes["stages/windowed/mlp/fc1/kernel"] == (2, 1, 32, 128)
    assert shapes["stages/global/attn/qkv/bias"] == (2, 3, 4, 8)
    assert not any(k in name for name in shapes for k in ("ls1", "cls_token", "reg_token", "lora", "mlp/norm"))


@pytest.mark.parametrize(
    "options, present, absent",
    [
        # Each option compiles its own ViT (4-8 s): half of them run in the slow tier.
        pytest.param(
            dict(layer_scale=1e-5),
            {"stages/global/ls1": (2, 32), "stages/global/ls2": (2, 32)},
            (),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            dict(mlp="swiglu", mlp_hidden=24, mlp_norm=True),
            {
                "stages/global/mlp/fc1/kernel": (2, 32, 2, 24),
                "stages/global/mlp/fc1/bias": (2, 2, 24),
                "stages/global/mlp/norm/scale": (2, 24),
                "stages/global/mlp/fc2/kernel": (2, 24, 32),
            },
            (),
            marks=pytest.mark.slow,
        ),
        (dict(qkv_bias="none"), {"stages/global/attn/qkv/kernel": (2, 32, 3, 4, 8)}, ("stages/global/attn/qkv/bias",)),
        (dict(absolute_position=False, rope="dinov3"), {"patch_embed/kernel": (16, 16, 3, 32)}, ("pos_embed",)),
        pytest.param(
            dict(global_attention_every=1, class_token=True, register_tokens=3),
            {"cls_token": (1, 1, 32), "class_pos_embed": (1, 1, 32), "reg_token": (1, 3, 32)},
            (),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            dict(lora_rank=2),
            {
                "stages/global/attn/qkv/lora_a": (2, 32, 2),
                "stages/global/attn/qkv/lora_b": (2, 2, 3, 4, 8),
                "stages/global/attn/out/lora_a": (2, 4, 8, 2),
                "stages/global/mlp/fc2/lora_b": (2, 2, 32),
            },
            (),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["layer_scale", "swiglu_norm", "no_qkv_bias", "rope_only", "prefix_tokens", "lora"],
)
def test_each_option_changes_the_parameters_and_the_output(options, present, absent):
    _, plain, _ = init_and_apply(tiny_vit())
    vit = tiny_vit(**options)
    params, out, _ = init_and_apply(vit)
    shapes = param_shapes(params)
    assert {name: shapes.get(name) for name in present} == present
    assert not set(absent) & set(shapes)
    assert out.shape == plain.shape
    if "lora_rank" not in options:  # LoRA starts as the identity (tested below)
        assert not np.allclose(out, plain, atol=1e-3)


@pytest.mark.slow  # 5-7 s of compiling: the slow tier
def test_logical_axes_of_the_new_parameters():
    vit = tiny_vit(
        global_attention_every=1, class_token=True, layer_scale=0.1, mlp="swiglu", mlp_norm=True, lora_rank=2
    )
    params = vit.init(jax.random.key(0), jnp.zeros((1, 64, 64, 3)))["params"]
    block = params["stages"]["global"]
    assert block["ls1"].names == ("stages", "norm")
    assert block["mlp"]["fc1"]["kernel"].names == ("stages", "embed", None, "mlp")
    assert block["mlp"]["fc1"]["bias"].names == ("stages", None, "mlp")
    assert block["mlp"]["norm"]["scale"].names == ("stages", "mlp")
    assert block["attn"]["qkv"]["lora_a"].names == ("stages", "embed", None)
    assert block["attn"]["qkv"]["lora_b"].names == ("stages", None, None, "heads", "kv")
    assert block["attn"]["out"]["lora_a"].names == ("stages", "heads", "kv", None)
    assert params["cls_token"].names == (None, None, "norm")


@pytest.mark.slow  # 7 s of compiling
def test_qv_bias_ignores_the_k_part():
    vit = tiny_vit(qkv_bias="qv")
    params, _, images = init_and_apply(vit)
    out = applied(vit, params, images)
    changed = jax.tree.map(lambda x: x, nn.meta.unbox(params))
    bias = changed["params"]["stages"]["global"]["attn"]["qkv"]["bias"]
    changed["params"]["stages"]["global"]["attn"]["qkv"]["bias"] = bias.at[:, 1].add(3.0)
    np.testing.assert_array_equal(applied(vit, changed, images), out)
    changed["params"]["stages"]["global"]["attn"]["qkv"]["bias"] = bias.at[:, 0].add(3.0)
    assert not np.allclose(applied(vit, changed, images), out, atol=1e-3)


def reference_angles(kind, grid, head_dim, temperature, reference):
    """The formulas as timm writes them, one token and one channel pair at a time."""
    h, w = grid
    n = head_dim // 4
    angles = np.zeros((h * w, head_dim // 2))
    for y in range(h):
        for x in range(w):
            for j in range(head_dim // 2):
                axis, band = divmod(j, n)
                position, size = (y, h) if axis == 0 else (x, w)
                if kind == "dinov3":  # centre normalised to [-1, 1], period temperature ** (4 band / head_dim)
                    coord = 2 * ((position + 0.5) / size) - 1
                    angles[y * w + x, j] = 2 * np.pi * coord / temperature ** (4 * band / head_dim)
                else:  # index (rescaled to the reference grid) times 1 / temperature ** (band / n)
                    coord = position / size * reference if reference else position
                    angles[y * w + x, j] = coord / temperature ** (band / n)
    return angles


@pytest.mark.parametrize(
    "kind,grid,head_dim,temperature,reference",
    [("dinov3", (3, 5), 16, 100.0, 0), ("eva02", (4, 3), 24, 10000.0, 16), ("eva02", (2, 2), 8, 10000.0, 0)],
)
def test_rope_angles_match_the_reference_formula(kind, grid, head_dim, temperature, reference):
    np.testing.assert_allclose(
        rope_angles(kind, grid, head_dim, temperature, reference),
        reference_angles(kind, grid, head_dim, temperature, reference),
        rtol=1e-6,
        atol=1e-6,
    )


def test_rotate_pairs_channels_as_each_layout_does():
    x = jnp.arange(8.0)
    cos, sin = jnp.zeros(4), jnp.ones(4)  # a quarter turn
    # Half layout: (x_j, x_{j+4}) -> (-x_{j+4}, x_j); interleaved: (x_2j, x_2j+1) -> (-x_2j+1, x_2j).
    np.testing.assert_array_equal(rotate(x, cos, sin, False), [-4, -5, -6, -7, 0, 1, 2, 3])
    np.testing.assert_array_equal(rotate(x, cos, sin, True), [-1, 0, -3, 2, -5, 4, -7, 6])


@pytest.mark.slow  # 7 s of compiling
def test_rope_with_windows_keeps_the_full_grids_rotation():
    # One 4x4 window covering the whole grid attends exactly as global attention, RoPE included.
    kwargs = dict(absolute_position=False, rope="dinov3", rope_temperature=100.0)
    windowed, global_ = tiny_vit(window_size=4, **kwargs), tiny_vit(window_size=0, **kwargs)
    params, out, images = init_and_apply(windowed)
    np.testing.assert_allclose(applied(global_, params, images), out, rtol=1e-5, atol=1e-5)
    # Padded windows (3x3 over 4x4) differ from global attention but stay finite.
    assert np.isfinite(applied(tiny_vit(window_size=3, **kwargs), params, images)).all()


@pytest.mark.slow  # ~10 s of compiling
def test_patch_14_grid_is_resized_to_stride_16():
    vit = tiny_vit(patch_size=14, pretrain_image_size=56)
    params, out, images = init_and_apply(vit, size=(70, 98))
    tokens = applied(vit, params, images, method=ViT.patch_tokens)
    assert tokens.shape == (1, 5, 7, 32) and out.shape == (1, 5, 7, 32)  # ceil(70/16), ceil(98/16)
    params, out, images = init_and_apply(vit, size=(112, 112))
    assert applied(vit, params, images, method=ViT.patch_tokens).shape == (1, 8, 8, 32) and out.shape == (1, 7, 7, 32)
    np.testing.assert_allclose(
        out,
        jax.image.resize(applied(vit, params, images, method=ViT.patch_tokens), (1, 7, 7, 32), "bilinear"),
        atol=1e-6,
    )


@pytest.mark.slow  # ~10 s of compiling
def test_lora_with_zero_b_is_the_plain_network_and_merges_exactly():
    plain, adapted = tiny_vit(mlp="swiglu"), tiny_vit(mlp="swiglu", lora_rank=2, lora_alpha=4.0)
    images = jax.random.normal(jax.random.key(0), (1, 64, 64, 3))
    params = nn.meta.unbox(adapted.init(jax.random.key(1), images)["params"])
    merged = merge_lora(params, 4.0 / 2)
    assert not any("lora" in "/".join(str(k.key) for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(merged))
    np.testing.assert_allclose(
        applied(adapted, {"params": params}, images), applied(plain, {"params": merged}, images), atol=1e-6
    )
    # Trained adapters (b no longer zero) change the output, and merging still reproduces it.
    trained = jax.tree_util.tree_map_with_path(lambda path, x: x + 0.1 if path[-1].key == "lora_b" else x, params)
    out = applied(adapted, {"params": trained}, images)
    assert not np.allclose(out, applied(adapted, {"params": params}, images), atol=1e-3)
    np.testing.assert_allclose(applied(plain, {"params": merge_lora(trained, 2.0)}, images), out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(class_token=True), "prefix tokens need global attention in every block, not global_attention_every=2"),
        (dict(register_tokens=4), "set global_attention_every=1, or class_token=False and register_tokens=0"),
        (dict(rope="alibi"), "model.backbone.rope='alibi'"),
        (dict(mlp="relu"), "model.backbone.mlp='relu'"),
        (dict(qkv_bias="k"), "model.backbone.qkv_bias='k'"),
        (dict(rope="eva02", embed_dim=40, num_heads=4), "divisible by 4"),
    ],
)
def test_bad_foundation_options_name_the_config_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        tiny_vit(**overrides).init(jax.random.key(0), jnp.zeros((1, 64, 64, 3)))
