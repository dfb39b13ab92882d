"""torchvision ResNet weights -> the Flax backbone: conversion, loading, frozen parameters.

State dicts are generated here in torchvision's layout with random values;
most tests use a tiny ResNet (width 8, one or two blocks per stage), one uses
the full ResNet-50 names and shapes. The converted backbone's features are
checked against a reference forward pass written directly on the torch
tensors (NCHW, OIHW kernels, torchvision's padding).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util
from jax import lax

from benchmarks.synthetic import random_batch
from configs import default, retinanet_r50_coco
from detector import cli
from detector.errors import ConfigError, WeightsFileError
from detector.models import families, weights
from detector.models.resnet import ResNet, frozen_parameter_mask
from detector.models.retinanet import create_model
from detector.training import optim, steps
from detector.training.train_state import TrainState
from tests.helpers import REPO_ROOT

BN_TENSORS = ("weight", "bias", "running_mean", "running_var")


def torchvision_state_dict(stage_sizes=(1, 1, 1, 1), width=8, bottleneck=True, num_classes=10, seed=0):
    """A torchvision `resnet*()` state dict with random values, built the way torchvision builds the model."""
    rng = np.random.default_rng(seed)
    state = {}

    def add_conv(name, out_channels, in_channels, kernel):
        std = np.sqrt(2.0 / (in_channels * kernel * kernel))
        state[f"{name}.weight"] = rng.standard_normal(
            (out_channels, in_channels, kernel, kernel), dtype=np.float32
        ) * np.float32(std)

    def add_bn(name, channels):
        state[f"{name}.weight"] = rng.uniform(0.5, 1.5, channels).astype(np.float32)
        state[f"{name}.bias"] = rng.normal(0, 0.1, channels).astype(np.float32)
        state[f"{name}.running_mean"] = rng.normal(0, 0.1, channels).astype(np.float32)
        state[f"{name}.running_var"] = rng.uniform(0.5, 2.0, channels).astype(np.float32)
        state[f"{name}.num_batches_tracked"] = np.array(1000, np.int64)

    expansion = 4 if bottleneck else 1
    add_conv("conv1", width, 3, 7)
    add_bn("bn1", width)
    inplanes = width
    for stage, blocks in enumerate(stage_sizes):
        planes = width * 2**stage
        for index in range(blocks):
            prefix = f"layer{stage + 1}.{index}"
            stride = 2 if stage > 0 and index == 0 else 1
            if bottleneck:
                add_conv(f"{prefix}.conv1", planes, inplanes, 1)
                add_conv(f"{prefix}.conv2", planes, planes, 3)
                add_conv(f"{prefix}.conv3", planes * 4, planes, 1)
                for k, channels in enumerate((planes, planes, planes * 4)):
                    add_bn(f"{prefix}.bn{k + 1}", channels)
            else:
                add_conv(f"{prefix}.conv1", planes, inplanes, 3)
                add_conv(f"{prefix}.conv2", planes, planes, 3)
                add_bn(f"{prefix}.bn1", planes)
                add_bn(f"{prefix}.bn2", planes)
            if stride != 1 or inplanes != planes * expansion:
                add_conv(f"{prefix}.downsample.0", planes * expansion, inplanes, 1)
                add_bn(f"{prefix}.downsample.1", planes * expansion)
            inplanes = planes * expansion
    state["fc.weight"] = rng.standard_normal((num_classes, inplanes), dtype=np.float32) * np.float32(0.01)
    state["fc.bias"] = np.zeros(num_classes, np.float32)
    return state


@functools.partial(jax.jit, static_argnames=("stage_sizes", "bottleneck"))
def reference_features(state, images_nchw, stage_sizes, bottleneck=True):
    """torchvision's ResNet forward in eval mode, on the state dict's own tensors: {level: [B, C, H, W]}."""

    def conv(x, name, stride=1):
        weight = jnp.asarray(state[f"{name}.weight"])  # OIHW, as torch stores it
        pad = weight.shape[-1] // 2
        return lax.conv_general_dilated(
            x,
            weight,
            (stride, stride),
            [(pad, pad), (pad, pad)],
            dimension_numbers=("NCHW", "OIHW", "NCHW"),
            precision=lax.Precision.HIGHEST,
        )

    def batch_norm(x, name):
        weight, bias, mean, var = (jnp.asarray(state[f"{name}.{t}"]).reshape(1, -1, 1, 1) for t in BN_TENSORS)
        return (x - mean) / jnp.sqrt(var + 1e-5) * weight + bias

    x = jax.nn.relu(batch_norm(conv(jnp.asarray(images_nchw), "conv1", 2), "bn1"))
    x = lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 3, 3), (1, 1, 2, 2), ((0, 0), (0, 0), (1, 1), (1, 1)))
    features = {}
    for stage, blocks in enumerate(stage_sizes):
        for index in range(blocks):
            prefix = f"layer{stage + 1}.{index}"
            stride = 2 if stage > 0 and index == 0 else 1
            if bottleneck:  # torchvision strides the 3x3 conv (ResNet v1.5)
                y = jax.nn.relu(batch_norm(conv(x, f"{prefix}.conv1"), f"{prefix}.bn1"))
                y = jax.nn.relu(batch_norm(conv(y, f"{prefix}.conv2", stride), f"{prefix}.bn2"))
                y = batch_norm(conv(y, f"{prefix}.conv3"), f"{prefix}.bn3")
            else:
                y = jax.nn.relu(batch_norm(conv(x, f"{prefix}.conv1", stride), f"{prefix}.bn1"))
                y = batch_norm(conv(y, f"{prefix}.conv2"), f"{prefix}.bn2")
            if f"{prefix}.downsample.0.weight" in state:
                x = batch_norm(conv(x, f"{prefix}.downsample.0", stride), f"{prefix}.downsample.1")
            x = jax.nn.relu(x + y)
        features[stage + 2] = x
    return features


def _tensors(state):
    # The reference takes only arrays (num_batches_tracked is a 0-d counter it does not read).
    return {name: value for name, value in state.items() if value.ndim}


def assert_features_match(ours_nhwc, reference_nchw):
    assert set(ours_nhwc) == set(reference_nchw) == {2, 3, 4, 5}
    for level, expected in reference_nchw.items():
        expected = np.asarray(expected).transpose(0, 2, 3, 1)
        scale = max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(
            np.asarray(ours_nhwc[level]), expected, rtol=1e-4, atol=1e-4 * scale, err_msg=f"C{level}"
        )


def random_images(size, batch=2, seed=1):
    return np.random.default_rng(seed).standard_normal((batch, 3, *size)).astype(np.float32)


@pytest.mark.parametrize(
    "bottleneck,stage_sizes,size",
    [
        (True, (2, 1, 1, 1), (32, 32)),
        (True, (1, 1, 1, 1), (33, 31)),  # odd sizes: symmetric padding must still line up with torch's
        (False, (1, 2, 1, 1), (32, 32)),
    ],
    ids=["bottleneck", "bottleneck_odd_size", "basic"],
)
def test_converted_backbone_matches_reference_forward(bottleneck, stage_sizes, size):
    state = torchvision_state_dict(stage_sizes, bottleneck=bottleneck)
    params = weights.convert_torchvision_resnet(state, stage_sizes)
    images = random_images(size)
    model = ResNet(stage_sizes, 8, "bottleneck" if bottleneck else "basic", norm="frozen_bn")
    ours = jax.jit(model.apply)({"params": params}, images.transpose(0, 2, 3, 1))
    assert_features_match(ours, reference_features(_tensors(state), images, stage_sizes, bottleneck))


def test_resnet50_layout_converts_and_loads_into_the_model(tmp_path):
    state = torchvision_state_dict((3, 4, 6, 3), width=64, num_classes=1000)
    path = tmp_path / "resnet50_torchvision.npz"
    np.savez(path, **state)

    config = retinanet_r50_coco.get_config()
    config.model.backbone.norm = "frozen_bn"
    model = create_model(config.model, 80, families.num_anchors_per_location(config))
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 128, 128, 3)))["params"]
    loaded = weights.load_backbone_params(abstract, path)

    assert loaded["neck"] is abstract["neck"] and loaded["head"] is abstract["head"]
    model_leaves = traverse_util.flatten_dict(abstract["backbone"], sep="/")
    loaded_leaves = traverse_util.flatten_dict(loaded["backbone"], sep="/")
    assert set(loaded_leaves) == set(model_leaves)
    assert len(loaded_leaves) == 53 * 3  # 53 convs, each with a kernel and a frozen BN's scale and bias
    for name, boxed in loaded_leaves.items():
        assert isinstance(boxed, nn.LogicallyPartitioned)  # logical axis names kept for sharding
        assert boxed.names == model_leaves[name].names
        assert boxed.value.shape == model_leaves[name].value.shape, name
        assert boxed.value.dtype == np.float32
    np.testing.assert_array_equal(loaded_leaves["stem_conv/kernel"].value, state["conv1.weight"].transpose(2, 3, 1, 0))
    np.testing.assert_array_equal(
        loaded_leaves["stage3_block6/Conv_2/kernel"].value, state["layer3.5.conv3.weight"].transpose(2, 3, 1, 0)
    )
    np.testing.assert_array_equal(
        loaded_leaves["stage4_block1/Conv_3/kernel"].value, state["layer4.0.downsample.0.weight"].transpose(2, 3, 1, 0)
    )
    weight, bias, mean, var = (state[f"layer2.3.bn2.{t}"].astype(np.float64) for t in BN_TENSORS)
    scale = weight / np.sqrt(var + 1e-5)
    np.testing.assert_allclose(loaded_leaves["stage2_block4/FrozenBatchNorm_1/scale"].value, scale, rtol=1e-6)
    np.testing.assert_allclose(
        loaded_leaves["stage2_block4/FrozenBatchNorm_1/bias"].value, bias - mean * scale, rtol=1e-6, atol=1e-7
    )


def test_missing_tensor_is_named():
    state = torchvision_state_dict()
    del state["layer1.0.bn2.running_var"]
    with pytest.raises(WeightsFileError, match=r"1 missing \(layer1\.0\.bn2\.running_var\)") as error:
        weights.convert_torchvision_resnet(state, (1, 1, 1, 1))
    assert "unexpected" not in str(error.value)


def test_unexpected_tensors_are_named_and_counted():
    state = torchvision_state_dict()
    state["layer1.0.se.weight"] = np.zeros(3, np.float32)
    with pytest.raises(WeightsFileError, match=r"1 unexpected \(layer1\.0\.se\.weight\)") as error:
        weights.convert_torchvision_resnet(state, (1, 1, 1, 1))
    # The classifier and BatchNorm counters are skipped, not reported.
    assert "fc." not in str(error.value) and "num_batches_tracked" not in str(error.value)

    with pytest.raises(WeightsFileError, match=r"30 missing \(layer1\.1\.bn1\.bias, .* and 25 more\)"):
        weights.convert_torchvision_resnet(torchvision_state_dict(), (3, 1, 1, 1))


def test_shape_mismatch_names_the_tensor_and_both_shapes():
    state = torchvision_state_dict()
    state["layer2.0.conv2.weight"] = np.zeros((16, 16, 1, 1), np.float32)
    with pytest.raises(
        WeightsFileError,
        match=r"layer2\.0\.conv2\.weight has shape \(16, 16, 1, 1\); "
        r"this ResNet needs \(16, 16, 3, 3\)",
    ):
        weights.convert_torchvision_resnet(state, (1, 1, 1, 1))


def test_unknown_suffix_missing_file_and_missing_readers(tmp_path, monkeypatch):
    unknown = tmp_path / "weights.bin"
    unknown.write_bytes(b"")
    with pytest.raises(
        WeightsFileError,
        match=r"weights\.bin: unknown weights file type '\.bin'; "
        r"use one of \.npz, \.safetensors, \.pth, \.pt",
    ):
        weights.read_state_dict(unknown)
    with pytest.raises(FileNotFoundError, match="no_such_weights.npz"):
        weights.read_state_dict(tmp_path / "no_such_weights.npz")
    for name in ("weights.pth", "weights.safetensors"):
        (tmp_path / name).write_bytes(b"")
    # None in sys.modules makes the import fail, whether or not the package is installed.
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(WeightsFileError, match=r"needs torch \(pip install torch\).*\.npz or \.safetensors"):
        weights.read_state_dict(tmp_path / "weights.pth")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    with pytest.raises(WeightsFileError, match=r"needs the safetensors package \(pip install safetensors"):
        weights.read_state_dict(tmp_path / "weights.safetensors")
    assert WeightsFileError in cli.USER_ERRORS  # reported by the CLIs as one line


def test_safetensors_file_reads_like_npz(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    state = {k: v for k, v in torchvision_state_dict().items() if v.ndim}
    safetensors_numpy.save_file(state, str(tmp_path / "weights.safetensors"))
    loaded = weights.read_state_dict(tmp_path / "weights.safetensors")
    assert set(loaded) == set(state)
    np.testing.assert_array_equal(loaded["layer1.0.conv2.weight"], state["layer1.0.conv2.weight"])


def _tiny_frozen_bn_config(**backbone):
    config = default.get_config()
    config.model.backbone.update(dict(norm="frozen_bn", block="bottleneck", width=8, **backbone))
    return config


@pytest.mark.slow  # a subprocess and a compile, ~6 s
def test_cli_converts_to_npz_that_loads_into_the_model(tmp_path):
    state = torchvision_state_dict((1, 1, 1, 1))
    np.savez(tmp_path / "resnet_tiny.npz", **state)
    output = tmp_path / "backbone.npz"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "detector.convert_pretrained"]
    # The model is built while the converter spends seconds importing.
    converting = subprocess.Popen(
        [*command, f"--input={tmp_path / 'resnet_tiny.npz'}", f"--output={output}"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    model = ResNet((1, 1, 1, 1), 8, norm="frozen_bn")
    params = {
        "backbone": nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]),
        "head": {"kernel": jnp.ones((3, 3, 8, 8))},
    }
    images = random_images((32, 32))
    expected = reference_features(_tensors(state), images, (1, 1, 1, 1))

    stdout, stderr = converting.communicate(timeout=120)
    assert converting.returncode == 0, stderr
    assert "stage sizes (1, 1, 1, 1), width 8" in stdout
    assert "fc.bias, fc.weight, 17 num_batches_tracked" in stdout
    with np.load(output) as npz:
        assert "stage1_block1/FrozenBatchNorm_3/scale" in npz.files and "stem_conv/kernel" in npz.files

    loaded = weights.load_backbone_params(params, output)
    assert loaded["head"] is params["head"]
    kernel = loaded["backbone"]["stage2_block1"]["Conv_1"]["kernel"]
    assert isinstance(kernel, jax.Array)
    assert kernel.sharding == params["backbone"]["stage2_block1"]["Conv_1"]["kernel"].sharding
    features = jax.jit(model.apply)({"params": loaded["backbone"]}, images.transpose(0, 2, 3, 1))
    assert_features_match(features, expected)


def test_loading_checks_the_model(tmp_path):
    np.savez(tmp_path / "torchvision.npz", **torchvision_state_dict((1, 1, 1, 1)))
    group_norm_model = ResNet((1, 1, 1, 1), 8)
    params = {"backbone": jax.eval_shape(group_norm_model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]}
    with pytest.raises(
        WeightsFileError,
        match=r"missing \(.*GroupNorm.*unexpected \(.*FrozenBatchNorm"
        r".*config\.model\.backbone\.norm='frozen_bn'",
    ):
        weights.load_backbone_params(params, tmp_path / "torchvision.npz")

    deeper = ResNet((2, 1, 1, 1), 8, norm="frozen_bn")
    params = {"backbone": jax.eval_shape(deeper.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]}
    with pytest.raises(
        WeightsFileError,
        match=r"torchvision\.npz: .*stage sizes \(2, 1, 1, 1\).*missing "
        r"\(layer1\.1\.bn1\.bias",
    ):
        weights.load_backbone_params(params, tmp_path / "torchvision.npz")

    ours = weights.flatten_backbone_params(
        weights.convert_torchvision_resnet(torchvision_state_dict((1, 1, 1, 1)), (1, 1, 1, 1))
    )
    ours["stage3_block1/FrozenBatchNorm_2/scale"] = np.ones(7, np.float32)
    np.savez(tmp_path / "ours.npz", **ours)
    model = ResNet((1, 1, 1, 1), 8, norm="frozen_bn")
    params = {"backbone": jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]}
    with pytest.raises(
        WeightsFileError,
        match=r"ours\.npz: tensor stage3_block1/FrozenBatchNorm_2/scale has "
        r"shape \(7,\); the model's is \(128,\)",
    ):
        weights.load_backbone_params(params, tmp_path / "ours.npz")


def test_group_norm_keeps_its_parameter_names():
    model = ResNet((1, 1, 1, 1), 8)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]
    expected = {"stem_conv/kernel", "stem_norm/scale", "stem_norm/bias"}
    for stage in range(1, 5):
        block = f"stage{stage}_block1"
        expected |= {f"{block}/Conv_{k}/kernel" for k in range(4)}
        expected |= {f"{block}/GroupNorm_{k}/{p}" for k in range(4) for p in ("scale", "bias")}
    assert set(traverse_util.flatten_dict(params, sep="/")) == expected

    frozen = ResNet((1, 1, 1, 1), 8, norm="frozen_bn")
    boxed = traverse_util.flatten_dict(
        jax.eval_shape(frozen.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"], sep="/"
    )
    assert {name.replace("FrozenBatchNorm", "GroupNorm") for name in boxed} == expected
    assert boxed["stage2_block1/FrozenBatchNorm_1/scale"].names == ("conv_out",)


def test_unknown_norm_is_a_config_error():
    config = default.get_config()
    config.model.backbone.norm = "batch"
    model = create_model(config.model, 4, families.num_anchors_per_location(config))
    with pytest.raises(ConfigError, match=r"model\.backbone\.norm='batch'; use one of group, frozen_bn"):
        jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
    with pytest.raises(ConfigError, match=r"model\.backbone\.norm='batch'"):
        optim.create_optimizer(config.optimizer, 10, model_config=config.model)


def test_optimizer_keeps_frozen_parameters_fixed():
    config = _tiny_frozen_bn_config(freeze_stages=2)
    backbone = ResNet((1, 1, 1, 1), 8, norm="frozen_bn")
    shapes = nn.meta.unbox(jax.eval_shape(backbone.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"])
    params = {
        "backbone": jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), shapes),
        "head": {"cls_logits": {"kernel": jnp.ones((3, 3, 8, 4)), "bias": jnp.ones(4)}},
    }
    grads = jax.tree.map(jnp.ones_like, params)
    names = traverse_util.flatten_dict(params, sep="/")
    expected_frozen = {name for name in names if "FrozenBatchNorm" in name} | {
        name for name in names if name.startswith(("backbone/stem_", "backbone/stage1_"))
    }
    assert "backbone/stage1_block1/Conv_0/kernel" in expected_frozen
    assert "backbone/stage2_block1/Conv_0/kernel" not in expected_frozen
    for name in ("sgd", "adamw"):
        config.optimizer.update(dict(name=name, learning_rate=0.1, warmup_steps=0, weight_decay=0.5))
        tx, _ = optim.create_optimizer(config.optimizer, 10, model_config=config.model)

        @jax.jit
        def step(params):
            updates, _ = tx.update(grads, tx.init(params), params)
            return optax.apply_updates(params, updates)

        new_params = step(params)
        changed = traverse_util.flatten_dict(
            jax.tree.map(lambda a, b: bool(jnp.any(a != b)), params, new_params), sep="/"
        )
        assert {k for k, moved in changed.items() if not moved} == expected_frozen, name


def test_nothing_frozen_leaves_the_optimizer_as_it_was():
    config = default.get_config()
    params = {"backbone": {"stem_conv": {"kernel": jnp.ones((3, 3, 3, 4))}}, "head": {"bias": jnp.ones(4)}}
    plain, _ = optim.create_optimizer(config.optimizer, 10)
    with_model, _ = optim.create_optimizer(config.optimizer, 10, model_config=config.model)
    assert jax.tree.structure(with_model.init(params)) == jax.tree.structure(plain.init(params))


def test_freeze_stages_follows_detectron2_freeze_at():
    params = jax.eval_shape(ResNet((1, 1, 1, 1), 8).init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]

    def frozen_modules(freeze_stages):
        mask = frozen_parameter_mask(params, freeze_stages=freeze_stages)
        return {path[0] for path, frozen in traverse_util.flatten_dict(mask).items() if frozen}

    assert frozen_modules(0) == set()
    assert frozen_modules(1) == {"stem_conv", "stem_norm"}
    assert frozen_modules(3) == {"stem_conv", "stem_norm", "stage1_block1", "stage2_block1"}
    assert len(frozen_modules(5)) == 6
    with pytest.raises(ConfigError, match=r"model\.backbone\.freeze_stages=6; use an integer from 0 .* to 5"):
        frozen_parameter_mask(params, freeze_stages=6)


@pytest.mark.slow  # compiles two train steps (about 9 s)
def test_frozen_stages_get_no_backward_pass():
    """Freezing drops the frozen layers' gradients from the step's program: fewer FLOPs."""

    def step_flops(skip_frozen_gradients):
        config = _tiny_frozen_bn_config(freeze_stages=5)
        config.global_batch_size = 2
        config.input.image_size = (64, 64)
        model = create_model(config.model, 3, families.num_anchors_per_location(config))
        tx, schedule = optim.create_optimizer(config.optimizer, 10, model_config=config.model)
        step = jax.jit(
            functools.partial(
                steps.train_step,
                loss=families.objective(config, model, 3).loss,
                tx=tx,
                schedule=schedule,
                frozen=optim.frozen_parameters(config.model) if skip_frozen_gradients else None,
            )
        )
        images = jnp.zeros((1, *config.input.image_size, 3))
        params = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), images)["params"])
        state = TrainState(
            step=jax.ShapeDtypeStruct((), jnp.int32), params=params, opt_state=jax.eval_shape(tx.init, params)
        )
        return step.lower(state, random_batch(config, 3)).cost_analysis()["flops"]

    all_flops = step_flops(False)
    frozen_flops = step_flops(True)
    # The whole (tiny) ResNet is frozen: its backward pass, ~7% of this
    # head-heavy step, is gone; computed and then discarded it would not be.
    assert frozen_flops < 0.95 * all_flops


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_a_truncated_weights_file_is_one_error_line(tmp_path, suffix):
    state = {name: value.astype(np.float32) for name, value in torchvision_state_dict((1, 1, 1, 1)).items()}
    path = tmp_path / f"resnet{suffix}"
    if suffix == ".npz":
        np.savez(path, **state)
    else:
        from safetensors.numpy import save_file

        save_file(state, str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # what an interrupted copy leaves
    with pytest.raises(WeightsFileError, match="damaged or truncated"):
        weights.read_state_dict(path)
    result = subprocess.run(
        [sys.executable, "-m", "detector.convert_pretrained", f"--input={path}", f"--output={tmp_path / 'out.npz'}"],
        cwd=REPO_ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: {path}: cannot read it as {suffix}") and "Traceback" not in result.stderr
    assert not (tmp_path / "out.npz").exists()
