import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import sharding
from configs import default
from detector.errors import ConfigError
from detector.models import families
from detector.models.retinanet import create_model
from detector.training.run import create_run


def _abstract_outputs(config, num_classes=4, batch=2):
    model = create_model(config.model, num_classes, families.num_anchors_per_location(config))
    images = jax.ShapeDtypeStruct((batch, *config.input.image_size, 3), jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.key(0), images)
    outputs = jax.eval_shape(model.apply, variables, images)
    return variables, outputs


@pytest.mark.parametrize(
    "image_size,levels",
    [
        ((128, 128), (3, 5)),
        # Tracing the full-width network takes 8-12 s: the other layouts run in the slow tier.
        pytest.param((96, 160), (3, 7), marks=pytest.mark.slow),
        pytest.param((100, 100), (4, 6), marks=pytest.mark.slow),
    ],
)
def test_head_outputs_line_up_with_anchors(image_size, levels):
    config = default.get_config()
    config.input.image_size = image_size
    config.model.anchors.min_level, config.model.anchors.max_level = levels
    _, (cls_logits, box_deltas) = _abstract_outputs(config, num_classes=5)
    num_anchors = families.anchors_for_config(config).shape[0]
    assert cls_logits.shape == (2, num_anchors, 5)
    assert box_deltas.shape == (2, num_anchors, 4)
    assert cls_logits.dtype == jnp.float32


def test_bfloat16_compute_keeps_float32_params_and_outputs():
    config = default.get_config()
    config.model.dtype = "bfloat16"
    variables, (cls_logits, _) = _abstract_outputs(config)
    assert cls_logits.dtype == jnp.float32
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nn.meta.unbox(variables["params"])))


def test_every_parameter_has_logical_axis_names():
    variables, _ = _abstract_outputs(default.get_config())
    leaves = jax.tree.leaves(variables["params"], is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert leaves and all(isinstance(x, nn.LogicallyPartitioned) for x in leaves)
    for boxed in leaves:
        assert len(boxed.names) == boxed.value.ndim


def test_classification_bias_starts_at_the_prior():
    config = default.get_config()
    model = create_model(config.model, 4, families.num_anchors_per_location(config))
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 64, 64, 3)))
    bias = nn.meta.unbox(variables["params"])["head"]["cls_logits"]["bias"]
    assert jnp.allclose(jax.nn.sigmoid(bias), 0.01, atol=1e-4)


@pytest.mark.parametrize(
    "mesh_shape,packs",
    [
        (dict(data=8, fsdp=1, model=1), True),
        (dict(data=1, fsdp=2, model=4), True),  # fsdp splits the batch too
        (dict(data=2, fsdp=1, model=4), True),
        (dict(data=1, fsdp=1, model=8), False),  # every device sees the same examples
        (dict(data=1, fsdp=1, model=1), False),
    ],
)
def test_auto_head_level_packing_packs_for_training_split_over_several_devices(mesh_shape, packs):
    config = default.get_config()
    assert config.model.head_level_packing == "auto"
    devices = jax.devices()[: mesh_shape["data"] * mesh_shape["fsdp"] * mesh_shape["model"]]
    mesh = sharding.create_mesh(mesh_shape, devices)
    run = create_run(config, 4, mesh, training=True)
    model = run.model
    assert model.head.pack_levels is packs
    # Prediction never packs under "auto".
    assert run.predict_model.head.pack_levels is False
    assert families.create_model(config, 4).head.pack_levels is False
    # Either way the parameter tree is the same, so checkpoints load into both.
    images = jax.ShapeDtypeStruct((2, 64, 64, 3), jnp.float32)
    trained = jax.eval_shape(model.init, jax.random.key(0), images)
    predicting = jax.eval_shape(families.create_model(config, 4).init, jax.random.key(0), images)
    assert jax.tree.structure(trained) == jax.tree.structure(predicting)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(trained)] == [
        (x.shape, x.dtype) for x in jax.tree.leaves(predicting)
    ]


@pytest.mark.parametrize("choice,packs", [("always", True), ("never", False)])
def test_forced_head_level_packing_ignores_the_devices(choice, packs):
    config = default.get_config()
    config.model.head_level_packing = choice
    for devices in (1, 8):
        assert families.create_model(config, 4, data_parallel_devices=devices).head.pack_levels is packs
    assert create_run(config, 4, sharding.create_mesh(config.mesh), training=True).model.head.pack_levels is packs


def test_unknown_head_level_packing_is_a_config_error():
    config = default.get_config()
    config.model.head_level_packing = "sometimes"
    with pytest.raises(ConfigError, match=r"^model\.head_level_packing='sometimes'; use one of auto, always, never$"):
        families.create_model(config, 4, data_parallel_devices=8)
