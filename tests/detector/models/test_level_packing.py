"""Level packing: a shared conv on the packed canvas equals the conv on each level alone."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detector.models import level_packing
from detector.models.retinanet import RetinaNetHead


def pyramid_shapes(height: int, width: int, min_level: int = 3, max_level: int = 7) -> dict[int, tuple[int, int]]:
    return {level: (-(-height // 2**level), -(-width // 2**level)) for level in range(min_level, max_level + 1)}


@pytest.mark.parametrize("size", [(128, 128), (1024, 1024), (800, 1333), (96, 160)])
def test_regions_fit_the_canvas_and_never_touch(size):
    shapes = pyramid_shapes(*size)
    layout = level_packing.plan_layout(shapes)
    assert set(layout.regions) == set(shapes)
    for level, (y, x, h, w) in layout.regions.items():
        assert (h, w) == shapes[level]
        assert 0 <= y and y + h <= layout.height and 0 <= x and x + w <= layout.width
    for (_, a), (_, b) in itertools.combinations(layout.regions.items(), 2):
        # Grown by the gap, two regions still do not overlap.
        apart_y = a[0] + a[2] + level_packing.GAP <= b[0] or b[0] + b[2] + level_packing.GAP <= a[0]
        apart_x = a[1] + a[3] + level_packing.GAP <= b[1] or b[1] + b[3] + level_packing.GAP <= a[1]
        assert apart_y or apart_x, (a, b)
    area = sum(h * w for h, w in shapes.values())
    if min(size) >= 512:
        assert layout.height * layout.width <= 1.2 * area  # little padding at detection sizes


def test_pack_unpack_round_trip_with_zero_gaps():
    shapes = pyramid_shapes(128, 128)
    rng = np.random.default_rng(0)
    features = {level: jnp.asarray(rng.normal(size=(2, h, w, 5)) + 10, jnp.float32) for level, (h, w) in shapes.items()}
    layout = level_packing.plan_layout(shapes)
    canvas = level_packing.pack(features, layout)
    assert canvas.shape == (2, layout.height, layout.width, 5)
    for level, x in level_packing.unpack(canvas, layout).items():
        np.testing.assert_array_equal(x, features[level])
    # Everything outside the regions is zero (features are ~10, never zero).
    covered = sum(h * w for h, w in shapes.values())
    assert int(jnp.sum(canvas != 0)) == 2 * 5 * covered


def test_conv_on_canvas_equals_conv_per_level():
    shapes = pyramid_shapes(160, 96)
    rng = np.random.default_rng(1)
    features = {level: jnp.asarray(rng.normal(size=(2, h, w, 4)), jnp.float32) for level, (h, w) in shapes.items()}
    kernel = jnp.asarray(rng.normal(size=(3, 3, 4, 6)), jnp.float32)

    def conv(x):
        return jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    layout = level_packing.plan_layout(shapes)
    packed = level_packing.unpack(conv(level_packing.pack(features, layout)), layout)
    for level, x in features.items():
        np.testing.assert_allclose(packed[level], conv(x), rtol=1e-5, atol=1e-5, err_msg=f"P{level}")


def count_convs(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("conv_general_dilated")


@pytest.mark.slow  # two heads' values and gradients: 11-16 s of compiling each
@pytest.mark.parametrize("norm", ["group", "none"])
def test_packed_and_level_by_level_heads_share_parameters_outputs_and_gradients(norm):
    def head(pack_levels):
        return RetinaNetHead(num_classes=3, num_anchors=2, num_convs=2, features=8, norm=norm, pack_levels=pack_levels)

    packed, per_level = head(True), head(False)
    rng = np.random.default_rng(2)
    shapes = pyramid_shapes(64, 96, 3, 6)  # odd sizes down to 1x2
    pyramid = {level: jnp.asarray(rng.normal(size=(2, h, w, 8)), jnp.float32) for level, (h, w) in shapes.items()}
    # Compiled throughout: eagerly, every op of every level would compile a program of its own.
    params = jax.jit(per_level.init)(jax.random.key(0), pyramid)
    # Checkpoints are interchangeable: the same tree, and the same initial values.
    jax.tree.map(np.testing.assert_array_equal, jax.jit(packed.init)(jax.random.key(0), pyramid), params)
    # The two are different programs: one conv per layer, or one per layer and level.
    convs_per_head = 2 * (2 + 1)
    assert count_convs(packed.apply, params, pyramid) == convs_per_head
    assert count_convs(per_level.apply, params, pyramid) == convs_per_head * len(shapes)

    outputs = {pack: jax.jit(head(pack).apply)(params, pyramid) for pack in (True, False)}
    for got, want in zip(outputs[True], outputs[False]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    # Random cotangents, so every anchor's output contributes to the gradients.
    logits_weight, deltas_weight = (jnp.asarray(rng.normal(size=x.shape), jnp.float32) for x in outputs[False])

    def loss(params, pyramid, pack):
        logits, deltas = head(pack).apply(params, pyramid)
        return jnp.sum(logits * logits_weight) + jnp.sum(deltas * deltas_weight)

    grads = {
        pack: jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(params, pyramid, pack) for pack in (True, False)
    }
    # Before a GroupNorm a conv's bias has no effect, so its gradient is
    # float32 noise around 0: the absolute tolerance follows the largest gradient.
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads[False]))
    for got, want in zip(jax.tree.leaves(grads[True]), jax.tree.leaves(grads[False]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale)
