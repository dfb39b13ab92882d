import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from configs import default
from detector.models import families
from detector.models.retinanet import create_model


def _abstract_outputs(config, num_classes=4, batch=2):
    model = create_model(config.model, num_classes, families.num_anchors_per_location(config))
    images = jax.ShapeDtypeStruct((batch, *config.input.image_size, 3), jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.key(0), images)
    outputs = jax.eval_shape(model.apply, variables, images)
    return variables, outputs


@pytest.mark.parametrize("image_size,levels", [((128, 128), (3, 5)), ((96, 160), (3, 7)), ((100, 100), (4, 6))])
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
    variables = model.init(jax.random.key(0), jnp.zeros((1, 64, 64, 3)))
    bias = nn.meta.unbox(variables["params"])["head"]["cls_logits"]["bias"]
    assert jnp.allclose(jax.nn.sigmoid(bias), 0.01, atol=1e-4)
