import jax.numpy as jnp
import numpy as np
import pytest

from configs import default, retinanet_r50_coco
from detector.errors import ConfigError
from detector.models import families
from detector.training import optim


def test_cosine_schedule_warms_up_then_decays_to_zero():
    config = default.get_config().optimizer
    schedule = optim.learning_rate_schedule(config, 1000)
    assert float(schedule(0)) == 0.0
    np.testing.assert_allclose(float(schedule(config.warmup_steps)), config.learning_rate, rtol=1e-6)
    assert float(schedule(500)) < config.learning_rate
    assert float(schedule(1000)) == pytest.approx(0.0, abs=1e-9)


def test_step_schedule_matches_detectron2_1x():
    config = retinanet_r50_coco.get_config().optimizer
    schedule = optim.learning_rate_schedule(config, 90_000)
    np.testing.assert_allclose(float(schedule(500)), 0.005, rtol=1e-5)
    np.testing.assert_allclose(float(schedule(30_000)), 0.01, rtol=1e-5)
    np.testing.assert_allclose(float(schedule(70_000)), 0.001, rtol=1e-5)
    np.testing.assert_allclose(float(schedule(85_000)), 0.0001, rtol=1e-5)


def test_weight_decay_skips_biases_and_norm_scales():
    config = default.get_config().optimizer
    config.grad_clip_norm = 0.0
    config.name = "sgd"
    config.learning_rate = 1.0
    config.momentum = 0.0
    config.weight_decay = 0.5
    config.warmup_steps = 0
    tx, _ = optim.create_optimizer(config, 10)
    params = {"kernel": jnp.ones((2, 2)), "bias": jnp.ones((2,))}
    zero_grads = {"kernel": jnp.zeros((2, 2)), "bias": jnp.zeros((2,))}
    updates, _ = tx.update(zero_grads, tx.init(params), params)
    np.testing.assert_allclose(updates["kernel"], -0.5 * np.ones((2, 2)))
    np.testing.assert_allclose(updates["bias"], np.zeros(2))


def test_unknown_optimizer_is_a_config_error():
    config = default.get_config().optimizer
    config.name = "adam2"
    with pytest.raises(ConfigError, match="optimizer.name='adam2'"):
        optim.create_optimizer(config, 10)


def _model_params(config):
    """Initial parameters of `config`'s model (4 classes), as a plain tree."""
    import jax

    from detector.models.retinanet import create_model
    from detector.training.train_state import _strip_axis_metadata

    model = create_model(config.model, 4, families.num_anchors_per_location(config))
    images = jnp.zeros((1, *config.input.image_size, 3))
    return _strip_axis_metadata(jax.jit(model.init)(jax.random.key(0), images)["params"])


def _one_adamw_update(config, params, grads):
    import jax

    tx, _ = optim.create_optimizer(config.optimizer, 10, model_config=config.model)
    # One program rather than hundreds of eagerly dispatched leaf updates.
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    return updates


@pytest.mark.slow  # 10-20 s of compiling or real processes
def test_backbone_multiplier_scales_every_backbone_step_and_leaves_the_head_alone():
    import jax
    from flax import traverse_util

    config = default.get_config()
    config.input.image_size = (64, 64)
    config.optimizer.warmup_steps = 0  # a non-zero learning rate at step 0
    params = _model_params(config)
    # numpy's generator: jax.random.normal would compile a program per parameter shape.
    rng = np.random.default_rng(1)
    grads = jax.tree.map(lambda p: rng.standard_normal(p.shape, dtype=np.float32), params)
    full = traverse_util.flatten_dict(_one_adamw_update(config, params, grads), sep="/")
    config.optimizer.lr_multipliers = (("backbone/.*", 0.1),)
    scaled = traverse_util.flatten_dict(_one_adamw_update(config, params, grads), sep="/")
    backbone = [name for name in full if name.startswith("backbone/")]
    assert backbone and len(backbone) < len(full)
    for name, update in full.items():
        if name.startswith("backbone/"):
            # The step itself (AdamW's direction and its decoupled weight decay) is 0.1x.
            np.testing.assert_array_equal(scaled[name], update * np.float32(0.1), err_msg=name)
            assert np.any(update != 0), name
            # What the parameter moved in float32: 0.1x, up to the rounding of p + update (a few ulps of p).
            moved = params_after(params, scaled, name) - params_at(params, name)
            full_moved = params_after(params, full, name) - params_at(params, name)
            np.testing.assert_allclose(moved, 0.1 * full_moved, rtol=1e-6, atol=1e-7, err_msg=name)
        else:
            np.testing.assert_array_equal(scaled[name], update, err_msg=name)


def params_at(params, name):
    from flax import traverse_util

    return np.asarray(traverse_util.flatten_dict(params, sep="/")[name])


def params_after(params, flat_updates, name):
    return (params_at(params, name) + np.asarray(flat_updates[name])).astype(np.float32)


@pytest.mark.slow  # 8-10 s of compiling
def test_first_matching_multiplier_wins_and_frozen_parameters_stay_frozen():
    from flax import traverse_util

    config = default.get_config()
    config.input.image_size = (64, 64)
    config.optimizer.warmup_steps = 0
    config.model.backbone.freeze_stages = 1  # the stem
    config.optimizer.lr_multipliers = (("backbone/stem.*", 5.0), ("backbone/.*", 0.5), ("head/.*", 0.0))
    params = _model_params(config)
    grads = jax_tree_ones(params)
    updates = traverse_util.flatten_dict(_one_adamw_update(config, params, grads), sep="/")
    config.optimizer.lr_multipliers = ()
    plain = traverse_util.flatten_dict(_one_adamw_update(config, params, grads), sep="/")
    for name, update in updates.items():
        if name.startswith("backbone/stem"):
            np.testing.assert_array_equal(update, 0.0, err_msg=name)  # frozen beats x5
        elif name.startswith("backbone/"):
            np.testing.assert_array_equal(update, plain[name] * np.float32(0.5), err_msg=name)
        elif name.startswith("head/"):
            np.testing.assert_array_equal(update, 0.0, err_msg=name)
        else:
            np.testing.assert_array_equal(update, plain[name], err_msg=name)


def jax_tree_ones(tree):
    import jax

    return jax.tree.map(lambda leaf: np.ones(leaf.shape, leaf.dtype), tree)


@pytest.mark.parametrize("scan", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_layer_decay_follows_vitdet_block_depth(scan):
    """Depth 4, a global block every 2: blocks 0 and 2 windowed, 1 and 3 global, scanned or unrolled alike."""
    from flax import traverse_util

    from configs import vitdet_tiny

    config = vitdet_tiny.get_config()
    config.model.backbone.scan = scan
    config.optimizer.layer_decay = 0.5
    params = _model_params(config)
    multipliers = traverse_util.flatten_dict(
        optim.learning_rate_multipliers(config.optimizer, config.model)(params), sep="/"
    )
    flat_params = traverse_util.flatten_dict(params, sep="/")
    depth = config.model.backbone.depth

    def block_of(name):  # the block index by name, independently of the scanned layout
        parts = name.split("/")
        if parts[1] in ("patch_embed", "pos_embed"):
            return -1
        if parts[1].startswith("stage") and parts[1] != "stages":
            stage = int(parts[1][len("stage") :])
            return stage * 2 + (1 if parts[2] == "global" else int(parts[2][len("windowed") :] or 0))
        return None

    for name, multiplier in multipliers.items():
        value = np.broadcast_to(np.asarray(multiplier, np.float32), flat_params[name].shape)
        if not name.startswith("backbone/") or name == "backbone/norm/scale" or name == "backbone/norm/bias":
            np.testing.assert_array_equal(value, 1.0, err_msg=name)
        elif scan and name.startswith("backbone/stages/"):
            stacked = name.split("/")[2]  # windowed: [stage, layer, ...]; global: [stage, ...]
            for stage in range(depth // 2):
                block = stage * 2 + (1 if stacked == "global" else 0)
                np.testing.assert_allclose(value[stage], 0.5 ** (depth - block), err_msg=name)
        else:
            np.testing.assert_allclose(value, 0.5 ** (depth - block_of(name)), err_msg=name)
    assert multipliers["backbone/pos_embed"] == pytest.approx(0.5 ** (depth + 1))


def test_layer_decay_puts_prefix_tokens_with_the_embeddings():
    """A DINOv3-style ViT (global blocks, class and register tokens): tokens at decay ** (depth + 1), block i at
    decay ** (depth - i)."""
    from flax import traverse_util

    from configs import dino_dinov3_tiny

    config = dino_dinov3_tiny.get_config()
    config.optimizer.layer_decay = 0.5
    multipliers = traverse_util.flatten_dict(
        optim.learning_rate_multipliers(config.optimizer, config.model)(_model_params(config)), sep="/"
    )
    depth = config.model.backbone.depth
    for name in ("cls_token", "reg_token", "patch_embed/kernel"):
        assert multipliers[f"backbone/{name}"] == pytest.approx(0.5 ** (depth + 1)), name
    np.testing.assert_allclose(
        np.ravel(multipliers["backbone/stages/global/ls1"]), 0.5 ** (depth - np.arange(depth)), rtol=1e-6
    )
    assert multipliers["backbone/norm/scale"] == 1.0


def test_bad_multipliers_are_config_errors():
    config = default.get_config()
    config.optimizer.layer_decay = 0.8
    with pytest.raises(ConfigError, match="layer_decay=0.8 needs a ViT backbone"):
        optim.create_optimizer(config.optimizer, 10, model_config=config.model)
    config.optimizer.layer_decay = 1.5
    with pytest.raises(ConfigError, match=r"layer_decay=1.5; use a value in \(0, 1\]"):
        optim.create_optimizer(config.optimizer, 10, model_config=config.model)
    config.optimizer.layer_decay = 1.0
    config.optimizer.lr_multipliers = (("head/.*", -1.0),)
    with pytest.raises(ConfigError, match="'head/.\\*' has multiplier -1.0"):
        optim.create_optimizer(config.optimizer, 10, model_config=config.model)
