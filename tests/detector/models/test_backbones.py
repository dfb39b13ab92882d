"""The backbone registry: config blocks become modules key for key, and bad blocks are named in one line."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_collections
import pytest

from configs import common, default, vitdet_tiny
from detector.errors import ConfigError
from detector.models import backbones
from detector.models.resnet import ResNet
from detector.models.vit import BlockOptions, ViT


def test_every_block_key_reaches_its_module_field():
    config = vitdet_tiny.get_config()
    config.model.remat = "dots"
    config.model.backbone.qkv_bias = "qv"
    config.model.backbone.register_tokens = 3
    vit = backbones.create_backbone(config.model, jnp.bfloat16)
    assert isinstance(vit, ViT) and vit.dtype == jnp.bfloat16 and vit.remat == "dots"
    options = [f.name for f in dataclasses.fields(ViT) if f.name not in ("parent", "name", "dtype", "remat")]
    assert {name: getattr(vit, name) for name in options} == {name: config.model.backbone[name] for name in options}

    config = default.get_config()
    config.model.backbone.stage_sizes = [2, 1, 1, 1]  # a list from Python: the module keeps a tuple
    config.model.backbone.norm = "frozen_bn"
    resnet = backbones.create_backbone(config.model, jnp.float32)
    assert resnet == ResNet((2, 1, 1, 1), 16, "basic", "none", jnp.float32, norm="frozen_bn")


def test_block_options_are_the_vits_fields_of_the_same_name():
    vit_fields = {f.name: f.default for f in dataclasses.fields(ViT)}
    block_fields = {f.name: f.default for f in dataclasses.fields(BlockOptions)}
    assert block_fields == {name: vit_fields[name] for name in block_fields}
    vit = ViT(qkv_bias="none", layer_scale=1e-5, rope="dinov3", rope_temperature=100.0, lora_rank=2, mlp_norm=True)
    assert vit.block_options() == BlockOptions(
        qkv_bias="none", layer_scale=1e-5, rope="dinov3", rope_temperature=100.0, lora_rank=2, mlp_norm=True
    )


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda block: block.update(qkv_bais="qv"), r"\(name='vit'\) has keys no vit backbone reads: qkv_bais;"),
        (lambda block: block.pop("final_norm"), r"\(name='vit'\) lacks final_norm; start from .*vit_backbone$"),
        (lambda block: block.update(name="swin"), r"model.backbone.name='swin'; use one of resnet, vit"),
    ],
)
def test_a_bad_block_is_named_in_one_line(edit, message):
    config = vitdet_tiny.get_config()
    block = config.model.backbone.to_dict()
    edit(block)
    config.model.backbone = ml_collections.ConfigDict(block)
    with pytest.raises(ConfigError, match=message) as error:
        backbones.create_backbone(config.model, jnp.float32)
    assert "\n" not in str(error.value)


def test_a_resnet_block_holds_freeze_stages_for_the_optimizer():
    """A key that is no field of the module is the registry's `other_keys`, read by the kind's hooks."""
    block = common.resnet_backbone((1, 1, 1, 1), 8, "basic", norm="frozen_bn", freeze_stages=2)
    assert "freeze_stages" not in {f.name for f in dataclasses.fields(ResNet)}
    assert "freeze_stages" in backbones.backbone_kind(block).other_keys
    assert backbones.backbone_kind(block).frozen_parameters(block) is not None
    model_config = ml_collections.ConfigDict({"backbone": block, "remat": "none"})
    assert isinstance(backbones.create_backbone(model_config, jnp.float32), ResNet)


def test_an_unknown_compute_dtype_is_named():
    with pytest.raises(ConfigError, match="model.dtype='float16'; use one of float32, bfloat16"):
        backbones.compute_dtype(ml_collections.ConfigDict({"dtype": "float16"}))
